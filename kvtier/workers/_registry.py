"""Who the group's workers are: the job socket, the handshake, each worker's life and its stop.

:class:`Registry` owns the ROUTER socket and, per rank, the worker that holds
it (:class:`Peer`: its identity on the socket, its pidfd, the write ends of
its job pipes). It answers a :class:`~kvtier.workers.jobs.Hello` with a
:class:`~kvtier.workers.jobs.Welcome` or a typed refusal, follows the
worker's notices (attached, failed, bye), watches its pidfd, and at close
tells every worker to stop and waits for the goodbyes.

It is apart from :class:`~kvtier.workers.group.WorkerGroup` so that the group
holds the copy jobs and the registry holds the processes: the jobs read
:attr:`Registry.by_rank` to reach each rank, and the registry reports a rank
lost after start through the one function the group gives it, because only
the group knows which jobs that rank still owed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvtier.errors import (
    BusyError,
    InvalidArgumentError,
    KVTierError,
    LayoutError,
    WorkerLostError,
)
from kvtier.layout import KVLayout
from kvtier.workers.jobs import Hello, Notice, Welcome

__all__ = ["Peer", "Registry"]

log = logging.getLogger("kvtier.workers")

STOP_WAIT = 10.0
"""Seconds :meth:`Registry.stop` waits for the workers' goodbyes."""


@dataclass(slots=True)
class Peer:
    """One registered worker process."""

    rank: int
    """The tensor-parallel rank it holds."""
    ident: bytes
    """Its identity on the ROUTER socket."""
    pid: int
    """Its process id, as it said in its hello."""
    pidfd: int | None
    """The descriptor the loop watches for its exit; None while unwatched."""
    attached: bool = False
    """Whether it attached the shared region."""
    pipes: dict[str, int] = field(default_factory=dict)
    """Write ends of its job pipes by kind, once it said it reads them."""


class Registry:
    """The job socket and the worker holding each rank, from hello to goodbye."""

    def __init__(
        self,
        world_size: int,
        directory: str,
        address: str,
        on_lost: Callable[[int, WorkerLostError], None],
    ) -> None:
        """Bind the ROUTER socket at ``address``.

        ``on_lost`` is told of each rank lost after start (the group fails its jobs).
        """
        self._world = world_size
        self._dir = directory
        self._on_lost = on_lost
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            # Jobs are bounded by the engine's rows: never drop or block a send.
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(address)
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        self.peers: dict[bytes, Peer] = {}
        """Registered workers by socket identity."""
        self.by_rank: dict[int, Peer] = {}
        """The same workers by rank."""
        self.refusals: list[str] = []
        """Why workers were refused or lost during registration, for the timeout's message."""
        self.closing = False
        """Set by the group's ``aclose``: a goodbye is then expected, a hello refused."""
        self.broken: WorkerLostError | None = None
        """The first rank lost after start: the group refuses every job from then on."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._layout: KVLayout | None = None
        self._welcome: Welcome | None = None
        self._all_attached: asyncio.Future[None] | None = None
        self._all_gone: asyncio.Future[None] | None = None

    def begin(
        self, loop: asyncio.AbstractEventLoop, layout: KVLayout, welcome: Welcome
    ) -> asyncio.Future[None]:
        """Accept workers from now on; the future resolves once every rank attached."""
        self._loop = loop
        self._layout = layout
        self._welcome = welcome
        self._all_attached = loop.create_future()
        return self._all_attached

    @property
    def started(self) -> bool:
        """Whether every rank attached: from then on a lost rank breaks the group."""
        return self._all_attached is not None and self._all_attached.done()

    def missing(self) -> list[int]:
        """The ranks not yet attached."""
        return [r for r in range(self._world) if not self._attached(r)]

    def _attached(self, rank: int) -> bool:
        peer = self.by_rank.get(rank)
        return peer is not None and peer.attached

    async def receive(self) -> list[bytes]:
        """The next message on the socket: the sender's identity, then its frames."""
        return await self._sock.recv_multipart(copy=True)

    def send(self, ident: bytes, frames: list[bytes]) -> None:
        """Send without blocking; a worker that cannot be reached is lost."""
        try:
            self._sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Unroutable: its connection is gone (its pidfd will say so too).
            peer = self.peers.get(ident)
            if peer is not None:
                self.lost(peer, f"cannot be reached ({exc})")

    # -- registration -------------------------------------------------------------------

    def _refuse(self, ident: bytes, exc: KVTierError) -> None:
        self.refusals.append(f"{type(exc).__name__}: {exc}")
        log.warning("refused a worker: %s", exc)
        self.send(ident, Notice("refused", type(exc).__name__, str(exc)).encode())

    def hello(self, ident: bytes, hello: Hello) -> None:
        """Welcome the worker, or refuse it with the error it will raise."""
        layout, welcome = self._layout, self._welcome
        assert layout is not None
        assert welcome is not None
        rank = hello.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self._world:
            self._refuse(
                ident, InvalidArgumentError(f"rank {rank!r} is outside [0, {self._world})")
            )
            return
        if hello.namespace != layout.namespace.hex():
            self._refuse(ident, LayoutError(_layout_diff(rank, layout, hello.layout)))
            return
        if rank in self.by_rank or ident in self.peers:
            self._refuse(
                ident,
                BusyError(
                    f"rank {rank} is already held by the worker of pid "
                    f"{self.by_rank[rank].pid if rank in self.by_rank else '?'}"
                ),
            )
            return
        if self.closing or self.broken is not None:
            self._refuse(ident, BusyError("the worker group is closing or broken"))
            return
        peer = Peer(rank, ident, hello.pid, None)
        self.peers[ident] = peer
        self.by_rank[rank] = peer
        self._watch(peer)
        if self.by_rank.get(rank) is peer:  # not already found dead
            self.send(ident, welcome.encode())

    def notice(self, ident: bytes, note: Notice) -> None:
        """Follow a registered worker's notice: attached, failed or bye."""
        peer = self.peers.get(ident)
        if peer is None:
            return
        if note.op == "attached":
            peer.attached = True
            if note.message == "pipes":
                self._open_pipes(peer)
            done = self._all_attached
            if (
                done is not None
                and not done.done()
                and all(self._attached(r) for r in range(self._world))
            ):
                done.set_result(None)
        elif note.op == "failed":
            # Its region attach failed: it holds nothing; let another take the rank.
            self.refusals.append(f"rank {peer.rank}: {note.error}: {note.message}")
            self.forget(peer)
        elif note.op == "bye" and not self.closing:
            # It stopped unasked (Worker.aclose): as good as dead to this group.
            self.lost(peer, "stopped serving")
        elif note.op == "bye":
            self.forget(peer)
            self._check_all_gone()

    def _open_pipes(self, peer: Peer) -> None:
        """Open the rank's job pipes (the worker made them, and reads them)."""
        for kind in ("store", "load"):
            path = os.path.join(self._dir, f"{peer.rank}.{kind}")
            try:
                # Read-write, though only written: a pipe whose worker died still has
                # a reader then, so a write never raises SIGPIPE (which kills a host
                # process that restored its default); the worker's pidfd tells its death.
                peer.pipes[kind] = os.open(
                    path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
                )
            except OSError as exc:  # its jobs take the socket
                log.warning("rank %d: job pipe %s: %s; jobs go on the socket", peer.rank, path, exc)

    # -- life and death -----------------------------------------------------------------

    def _watch(self, peer: Peer) -> None:
        """Learn of the worker's exit from a pidfd the loop watches (no polling)."""
        loop = self._loop
        assert loop is not None
        try:
            fd = os.pidfd_open(peer.pid)
        except ProcessLookupError:
            self.lost(peer, "exited before it was accepted")
            return
        except OSError as exc:  # pragma: no cover - a kernel without pidfd (before 5.3)
            log.warning(
                "cannot watch the worker of rank %d (%s): its death goes unseen", peer.rank, exc
            )
            return
        peer.pidfd = fd
        loop.add_reader(fd, self.lost, peer, "exited")

    def _unwatch(self, peer: Peer) -> None:
        fd, peer.pidfd = peer.pidfd, None
        if fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    def forget(self, peer: Peer) -> None:
        """Drop the worker: stop watching it and close its job pipes."""
        self._unwatch(peer)
        for fd in peer.pipes.values():
            os.close(fd)
        peer.pipes.clear()
        self.peers.pop(peer.ident, None)
        if self.by_rank.get(peer.rank) is peer:
            del self.by_rank[peer.rank]

    def lost(self, peer: Peer, how: str) -> None:
        """Worker of ``peer`` is gone: fail its jobs; after start, the group is broken."""
        self.forget(peer)
        err = WorkerLostError(
            f"the worker of rank {peer.rank} (pid {peer.pid}) {how}", peer.rank, None
        )
        if not self.started:
            self.refusals.append(str(err))
            log.warning("%s during registration; waiting for another", err)
            return
        if self.broken is None:
            self.broken = err
            log.error("%s: the worker group refuses new jobs", err)
        self._on_lost(peer.rank, err)
        self._check_all_gone()

    # -- stopping -----------------------------------------------------------------------

    def _check_all_gone(self) -> None:
        gone = self._all_gone
        if gone is not None and not gone.done() and not self.by_rank:
            gone.set_result(None)

    async def stop(self) -> None:
        """Tell every worker to stop and wait up to :data:`STOP_WAIT` s for the goodbyes.

        A worker that never answers is left to notice the scheduler's exit.
        """
        if not self.by_rank:
            return
        self._all_gone = asyncio.get_running_loop().create_future()
        for peer in list(self.by_rank.values()):
            self.send(peer.ident, Notice("stop").encode())
        self._check_all_gone()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._all_gone), STOP_WAIT)

    def close(self) -> None:
        """Forget every worker and close the socket."""
        for peer in list(self.peers.values()):
            self.forget(peer)
        self._sock.close(linger=0)
        self._ctx.term()


def _layout_diff(rank: int, mine: KVLayout, theirs: Any) -> str:
    """Name what differs between the scheduler's layout and a worker's description."""
    want = mine.describe()
    got = theirs if isinstance(theirs, dict) else {}
    diffs = [
        f"{k}: scheduler has {want.get(k)!r}, worker has {got.get(k)!r}"
        for k in sorted((set(want) | set(got)) - {"tp_rank"})
        if want.get(k) != got.get(k)
    ]
    return (
        f"the worker of rank {rank} holds another layout than the scheduler "
        f"({'; '.join(diffs) or 'namespace differs'})"
    )
