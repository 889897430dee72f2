"""The scheduler's side of the process split: a :class:`DeviceTransfer` over worker processes.

The engine drives every copy through a
:class:`~kvtier.transfer.device.DeviceTransfer`. In one process that is the
in-process copier; across processes it is a :class:`WorkerGroup`, which sends
each job to every rank's worker and resolves the job's
:class:`~kvtier.transfer.completion.Completion` once every rank has reported
it. One engine, two transports (as httpx sends every request through a
transport)::

    scheduler process                                 worker process, rank r
      Engine --store/load--> WorkerGroup                 Worker
                               ROUTER  ipc://<0700 dir>/jobs  DEALER   registration, control
                               |  pipe <dir>/<r>.store ------> |  store thread: copies slice r
                               |  pipe <dir>/<r>.load  ------> |  load thread:  copies slice r
                               | <------ pipe <dir>/done ----- |  JobDone (job, ok / error)
                               pidfd of each worker            pidfd of the scheduler

Registration (hello, welcome, attached), stop and goodbye travel on a pyzmq
ROUTER/DEALER pair. Jobs and their answers take named pipes in the same
private directory: a job is one record of :func:`~kvtier.workers.jobs.pack_record`
written whole (at most ``PIPE_BUF`` bytes) to the rank's pipe of its
direction, where a thread of the worker waits in ``read``, runs the copy
itself (:class:`~kvtier.transfer.device.RunsNow`) and writes its answer to the
``done`` pipe that the scheduler's loop watches. Why pipes and not the
socket: every zmq message crosses two I/O threads (the sender's and the
receiver's) before the receiver's loop wakes, and the worker's loop then
handed the job to a copy thread and the answer back: about 0.9 ms of wake-ups
per job on the 2-core VM, a third of a 16-block request at 2 MiB rows. A pipe
wakes the copying thread directly, as the in-process copier's queue does
(docs/architecture.md has the figures). A job too large for one record, or
met by a full pipe, goes on the socket instead: jobs need no order between
them (the scheduler sends a job only once its rows are free).

Completions reach the event loop without polling: the loop watches the
``done`` pipe and zmq.asyncio the socket's descriptor, and each worker's exit
is a readable pidfd (``os.pidfd_open``) registered with ``loop.add_reader``.

*A worker that dies* fails every job it had not reported with
:class:`~kvtier.errors.WorkerLostError` (once the other ranks have reported
theirs, so no copy still writes a row the engine reuses), and the group is
broken from then on: every later job is refused with the same error. A
tensor-parallel instance missing a rank cannot serve its model anyway; the
serving engine restarts the instance (vLLM does the same when a worker dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
import zmq.asyncio

from kvtier.errors import (
    BusyError,
    ClosedError,
    InvalidArgumentError,
    KVTierError,
    LayoutError,
    ProtocolError,
    WorkerError,
    WorkerLostError,
)
from kvtier.layout import KVLayout
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import (
    BlockIds,
    DeviceTransfer,
    TransferStatistics,
    check_block_ids,
    check_rows,
)
from kvtier.workers.jobs import (
    PIPE_BUF,
    Hello,
    JobDone,
    JobSpec,
    Notice,
    Welcome,
    decode,
    pack_record,
    unpack_records,
)

if TYPE_CHECKING:
    from kvtier.region import CPURegion

__all__ = ["WorkerGroup"]

log = logging.getLogger("kvtier.workers")

_STOP_WAIT = 10.0
"""Seconds aclose waits for the workers' goodbyes."""


@dataclass(slots=True, eq=False)
class _Pending:
    done: Completion[None]
    waiting: set[int]
    store: bool
    nbytes: int
    error: WorkerError | None = None


@dataclass(slots=True)
class _Peer:
    rank: int
    ident: bytes
    pid: int
    pidfd: int | None
    attached: bool = False
    pipes: dict[str, int] = field(default_factory=dict)
    """Write ends of its job pipes by kind, once it said it reads them."""


@dataclass(slots=True)
class _Counts:
    stores: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    failures: int = 0
    refusals: list[str] = field(default_factory=list)


class WorkerGroup(DeviceTransfer):
    """Sends copy jobs to one worker process per tensor-parallel rank.

    Bind it with :meth:`bind`, hand :attr:`address` to the worker processes
    (:class:`kvtier.workers.Worker`), and give it to
    :meth:`kvtier.Engine.open` as ``workers=``: the engine creates the shared
    CPU region, waits for every rank to register and attach it, and closes the
    group with itself.

    Notes
    -----
    **Registration.** A worker is refused, with a typed error it raises, when
    its rank is outside ``[0, world_size)`` (``InvalidArgumentError``), its
    layout's namespace differs from the scheduler's (``LayoutError`` naming
    the fields), or its rank is already held by a live worker
    (``BusyError``). A refused worker changes nothing: the group keeps waiting
    for a good one until the engine's ``worker_timeout``.

    **Jobs.** :meth:`store` and :meth:`load` validate on the caller's thread
    (as the in-process copier does), then send one :class:`JobSpec` to every
    rank; the completion resolves once every rank reported the job done, and
    fails with :class:`~kvtier.errors.WorkerError` (naming the rank and the
    worker's own error) if any rank failed it.

    **Worker death.** See the module docstring: jobs fail with
    :class:`~kvtier.errors.WorkerLostError`, the group refuses new ones.
    """

    def __init__(self, world_size: int, directory: str, owns_directory: bool) -> None:
        """Use :meth:`bind`."""
        self._world = world_size
        self._dir = directory
        self._owns_dir = owns_directory
        self._address = f"ipc://{os.path.join(directory, 'jobs')}"
        self._instance = os.urandom(16)
        done_pipe = os.path.join(directory, "done")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(done_pipe)  # a killed instance's, in a directory given again
        os.mkfifo(done_pipe, 0o600)
        # Read and write: the pipe never reports end-of-file when a worker goes.
        self._done_fd = os.open(done_pipe, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._done_buf = bytearray()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        try:
            # Jobs are bounded by the engine's rows: never drop or block a send.
            self._sock.setsockopt(zmq.SNDHWM, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.bind(self._address)
        except BaseException:
            self._sock.close(linger=0)
            self._ctx.term()
            os.close(self._done_fd)
            raise
        self._layout: KVLayout | None = None
        self._rows = 0
        self._peers: dict[bytes, _Peer] = {}
        self._by_rank: dict[int, _Peer] = {}
        self._jobs: dict[int, _Pending] = {}
        self._next_job = 0
        self._reader: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._welcome: Welcome | None = None
        self._all_attached: asyncio.Future[None] | None = None
        self._byes: set[int] = set()
        self._all_gone: asyncio.Future[None] | None = None
        self._broken: WorkerLostError | None = None
        self._closed = False
        self._n = _Counts()

    @classmethod
    def bind(cls, world_size: int, *, directory: str | None = None) -> WorkerGroup:
        """Bind the group's socket in a private directory.

        Parameters
        ----------
        world_size
            Worker processes (tensor-parallel ranks), one per rank.
        directory
            An existing directory for the socket and the job pipes, which only
            this user may enter; by default a fresh one (mode 0700) that
            :meth:`aclose` removes.

        Raises
        ------
        InvalidArgumentError
            For a world size outside ``[1, 1024]``, or a directory that others
            may enter.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise InvalidArgumentError(f"world_size must be an int, got {world_size!r}")
        if not 1 <= world_size <= 1024:
            raise InvalidArgumentError(f"world_size must be in [1, 1024], got {world_size}")
        owns = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="kvtier-workers-")  # mode 0700
        elif os.stat(directory).st_mode & 0o077:
            raise InvalidArgumentError(
                f"{directory} may be entered by other users: the job socket must be private "
                "(chmod 700)"
            )
        try:
            return cls(world_size, directory, owns)
        except BaseException:
            if owns:
                shutil.rmtree(directory, ignore_errors=True)
            raise

    # -- properties ---------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The ``ipc://`` endpoint the workers connect to."""
        return self._address

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self._world

    @property
    def instance(self) -> bytes:
        """16 random bytes naming this instance; the shared region carries them."""
        return self._instance

    @property
    def backend(self) -> str:
        return "workers"

    # -- registration -------------------------------------------------------------------

    async def start(
        self,
        layout: KVLayout,
        region: CPURegion,
        cpu_bytes_to_use: int,
        timeout: float,  # noqa: ASYNC109 - a deadline on registration, not on the call
    ) -> None:
        """Accept one worker per rank and wait until each has attached ``region``.

        Called by :meth:`kvtier.Engine.open`.

        Raises
        ------
        WorkerError
            When not every rank attached within ``timeout`` seconds; the
            message lists the missing ranks and the refusals seen.
        """
        shared_name = region.statistics().shared_name
        if shared_name is None:  # pragma: no cover - the engine always names it
            raise InvalidArgumentError("the workers need a shared region")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._layout = layout
        self._rows = region.rows
        self._welcome = Welcome(
            shared_name=shared_name,
            instance=self._instance.hex(),
            cpu_bytes_to_use=cpu_bytes_to_use,
            alignment=region.alignment,
            world_size=self._world,
            scheduler_pid=os.getpid(),
            pipes=self._dir,
        )
        loop.add_reader(self._done_fd, self._on_pipe)
        self._all_attached = loop.create_future()
        self._reader = asyncio.ensure_future(self._read())
        try:
            await asyncio.wait_for(asyncio.shield(self._all_attached), timeout)
        except TimeoutError:
            missing = [r for r in range(self._world) if not self._attached(r)]
            seen = "; ".join(self._n.refusals[-5:]) or "none"
            raise WorkerError(
                f"ranks {missing} of {self._world} did not register and attach the CPU region "
                f"within {timeout} s (refused: {seen})",
                missing[0] if missing else None,
            ) from None

    def _attached(self, rank: int) -> bool:
        peer = self._by_rank.get(rank)
        return peer is not None and peer.attached

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            ident, body = frames[0], frames[1:]
            try:
                msg = decode(body)
            except ProtocolError as exc:
                log.warning("ignored a message from the job socket: %s", exc)
                continue
            if isinstance(msg, JobDone):
                self._on_done(ident, msg)
            elif isinstance(msg, Hello):
                self._on_hello(ident, msg)
            elif isinstance(msg, Notice):
                self._on_notice(ident, msg)
            else:
                log.warning("ignored a %s from a worker", type(msg).__name__)

    def _refuse(self, ident: bytes, exc: KVTierError) -> None:
        self._n.refusals.append(f"{type(exc).__name__}: {exc}")
        log.warning("refused a worker: %s", exc)
        self._send(ident, Notice("refused", type(exc).__name__, str(exc)).encode())

    def _on_hello(self, ident: bytes, hello: Hello) -> None:
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
        if rank in self._by_rank or ident in self._peers:
            self._refuse(
                ident,
                BusyError(
                    f"rank {rank} is already held by the worker of pid "
                    f"{self._by_rank[rank].pid if rank in self._by_rank else '?'}"
                ),
            )
            return
        if self._closed or self._broken is not None:
            self._refuse(ident, BusyError("the worker group is closing or broken"))
            return
        peer = _Peer(rank, ident, hello.pid, None)
        self._peers[ident] = peer
        self._by_rank[rank] = peer
        self._watch(peer)
        if self._by_rank.get(rank) is peer:  # not already found dead
            self._send(ident, welcome.encode())

    def _on_notice(self, ident: bytes, note: Notice) -> None:
        peer = self._peers.get(ident)
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
            self._n.refusals.append(f"rank {peer.rank}: {note.error}: {note.message}")
            self._forget(peer)
        elif note.op == "bye" and not self._closed:
            # It stopped unasked (Worker.aclose): as good as dead to this group.
            self._lost(peer, "stopped serving")
        elif note.op == "bye":
            self._byes.add(peer.rank)
            self._forget(peer)
            self._check_all_gone()

    def _open_pipes(self, peer: _Peer) -> None:
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

    def _on_pipe(self) -> None:
        """Read every answer waiting in the ``done`` pipe."""
        while True:
            try:
                chunk = os.read(self._done_fd, 1 << 16)
            except BlockingIOError:
                break
            self._done_buf += chunk
            if len(chunk) < 1 << 16:
                break
        try:
            records = unpack_records(self._done_buf)
        except ProtocolError as exc:
            log.warning("dropped the done pipe's contents: %s", exc)
            self._done_buf.clear()
            return
        for rank, frames in records:
            peer = self._by_rank.get(rank)
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("ignored a record of the done pipe: %s", exc)
                continue
            if peer is not None and isinstance(msg, JobDone):
                self._on_done(peer.ident, msg)

    def _watch(self, peer: _Peer) -> None:
        """Learn of the worker's exit from a pidfd the loop watches (no polling)."""
        loop = self._loop
        assert loop is not None
        try:
            fd = os.pidfd_open(peer.pid)
        except ProcessLookupError:
            self._lost(peer, "exited before it was accepted")
            return
        except OSError as exc:  # pragma: no cover - a kernel without pidfd (before 5.3)
            log.warning(
                "cannot watch the worker of rank %d (%s): its death goes unseen", peer.rank, exc
            )
            return
        peer.pidfd = fd
        loop.add_reader(fd, self._lost, peer, "exited")

    def _unwatch(self, peer: _Peer) -> None:
        fd, peer.pidfd = peer.pidfd, None
        if fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    def _forget(self, peer: _Peer) -> None:
        self._unwatch(peer)
        for fd in peer.pipes.values():
            os.close(fd)
        peer.pipes.clear()
        self._peers.pop(peer.ident, None)
        if self._by_rank.get(peer.rank) is peer:
            del self._by_rank[peer.rank]

    def _lost(self, peer: _Peer, how: str) -> None:
        """Worker of ``peer`` is gone: fail its jobs; after start, the group is broken."""
        self._forget(peer)
        started = self._all_attached is not None and self._all_attached.done()
        err = WorkerLostError(
            f"the worker of rank {peer.rank} (pid {peer.pid}) {how}", peer.rank, None
        )
        if not started:
            self._n.refusals.append(str(err))
            log.warning("%s during registration; waiting for another", err)
            return
        if self._broken is None:
            self._broken = err
            log.error("%s: the worker group refuses new jobs", err)
        for job_id, p in list(self._jobs.items()):
            if peer.rank in p.waiting:
                p.waiting.discard(peer.rank)
                p.error = err
                self._maybe_finish(job_id, p)
        self._check_all_gone()

    # -- jobs ---------------------------------------------------------------------------

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        layout = self._usable()
        r = check_rows(rows, self._rows, unique=True)
        bpc = layout.blocks_per_chunk
        ids = check_block_ids(layout, device_block_ids, r.size * bpc, unique=False)
        return self._submit(JobSpec(self._new_id(), "store", r, ids, 0), r.size * bpc)

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        layout = self._usable()
        r = check_rows(rows, self._rows, unique=False)
        bpc = layout.blocks_per_chunk
        if isinstance(skip, bool) or not isinstance(skip, int | np.integer):
            raise InvalidArgumentError(f"skip must be an int, got {skip!r}")
        skip = int(skip)
        if not 0 <= skip < bpc or (skip and r.size == 0):
            raise InvalidArgumentError(f"skip must be in [0, {bpc}) with rows, got {skip}")
        n = r.size * bpc - skip
        ids = check_block_ids(layout, device_block_ids, n, unique=True)
        return self._submit(JobSpec(self._new_id(), "load", r, ids, skip), n)

    def _usable(self) -> KVLayout:
        if self._closed:
            raise ClosedError("the worker group is closed")
        if self._broken is not None:
            raise WorkerLostError(
                f"the worker group is broken: {self._broken}", self._broken.rank, None
            )
        if self._layout is None or not (
            self._all_attached is not None and self._all_attached.done()
        ):
            raise ClosedError("the worker group has not started (Engine.open starts it)")
        return self._layout

    def _new_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _submit(self, spec: JobSpec, blocks: int) -> Completion[None]:
        layout = self._layout
        assert layout is not None
        done: Completion[None] = Completion()
        if blocks == 0:
            done.set_result(None)
            return done
        store = spec.kind == "store"
        pending = _Pending(done, set(self._by_rank), store, blocks * layout.bytes_per_block)
        self._jobs[spec.job] = pending
        frames = spec.encode()
        record = pack_record(frames)
        for peer in list(self._by_rank.values()):
            fd = peer.pipes.get(spec.kind)
            if fd is not None and len(record) <= PIPE_BUF:
                try:
                    os.write(fd, record)  # whole or not at all (at most PIPE_BUF)
                    continue
                except BlockingIOError:
                    pass  # full (its worker stopped reading: dead?): the socket
            self._send(peer.ident, frames)
        return done

    def _send(self, ident: bytes, frames: list[bytes]) -> None:
        try:
            self._sock.send_multipart([ident, *frames], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # Unroutable: its connection is gone (its pidfd will say so too).
            peer = self._peers.get(ident)
            if peer is not None:
                self._lost(peer, f"cannot be reached ({exc})")

    def _on_done(self, ident: bytes, msg: JobDone) -> None:
        peer = self._peers.get(ident)
        pending = self._jobs.get(msg.job)
        if peer is None or pending is None or peer.rank not in pending.waiting:
            return
        pending.waiting.discard(peer.rank)
        if msg.error is not None and pending.error is None:
            pending.error = WorkerError(
                f"rank {peer.rank}: {pending_kind(pending)} job {msg.job} failed: "
                f"{msg.error}: {msg.message}",
                peer.rank,
                msg.error,
            )
        self._maybe_finish(msg.job, pending)

    def _maybe_finish(self, job_id: int, p: _Pending) -> None:
        if p.waiting:
            return
        del self._jobs[job_id]
        if p.error is not None:
            self._n.failures += 1
            p.done.set_exception(p.error)
        else:
            if p.store:
                self._n.stores += 1
                self._n.bytes_stored += p.nbytes
            else:
                self._n.loads += 1
                self._n.bytes_loaded += p.nbytes
            p.done.set_result(None)

    # -- statistics and closing ---------------------------------------------------------

    def statistics(self) -> TransferStatistics:
        """Counters over the group: bytes are one rank's slices, summed over ranks."""
        n = self._n
        return TransferStatistics(
            backend="workers",
            stores=n.stores,
            loads=n.loads,
            bytes_stored=n.bytes_stored * self._world,
            bytes_loaded=n.bytes_loaded * self._world,
            copies_issued=0,
            failures=n.failures,
            in_flight=len(self._jobs),
        )

    def _check_all_gone(self) -> None:
        gone = self._all_gone
        if gone is not None and not gone.done() and not self._by_rank:
            gone.set_result(None)

    async def aclose(self) -> None:
        """Wait for the jobs in flight, stop every worker, close the socket; idempotent.

        Notes
        -----
        Jobs in flight end when every rank reported them or died. The workers
        are then told to stop (each finishes its copies, closes its region and
        says goodbye) and waited for up to 10 s; a worker that never answers
        is left to notice the scheduler's exit.
        """
        if self._closed and self._reader is None:
            return
        self._closed = True
        try:
            if self._jobs:
                await asyncio.gather(
                    *(_settle(p.done) for p in list(self._jobs.values())),
                )
            if self._reader is not None and self._by_rank:
                self._all_gone = asyncio.get_running_loop().create_future()
                for peer in list(self._by_rank.values()):
                    self._send(peer.ident, Notice("stop").encode())
                self._check_all_gone()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._all_gone), _STOP_WAIT)
        finally:
            reader, self._reader = self._reader, None
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            for peer in list(self._peers.values()):
                self._forget(peer)
            if self._loop is not None:
                self._loop.remove_reader(self._done_fd)
            os.close(self._done_fd)
            self._sock.close(linger=0)
            self._ctx.term()
            if self._owns_dir:
                shutil.rmtree(self._dir, ignore_errors=True)


def pending_kind(p: _Pending) -> str:
    return "store" if p.store else "load"


async def _settle(c: Completion[None]) -> None:
    with contextlib.suppress(Exception):
        await c


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
