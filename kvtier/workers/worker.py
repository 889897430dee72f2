"""The worker's side of the process split: one rank's copies, run in that rank's process.

A :class:`Worker` connects to the scheduler's
:class:`~kvtier.workers.group.WorkerGroup`, registers its rank and layout,
attaches the shared CPU region with its rank, and then serves copy jobs with
the same in-process copier the single-process engine uses
(:func:`~kvtier.transfer.device.open_device_transfer`, CUDA or CPU backend),
copying only its own slice of each row.

Jobs arrive on two named pipes of the group's private directory, one per
direction, each read by a thread of the worker that runs the copy itself
(:meth:`~kvtier.transfer.device.RunsNow.run_now`) and writes the answer to
the scheduler's ``done`` pipe: the job wakes the thread that copies, as in the
in-process copier (see :mod:`kvtier.workers.group` for why). A copier that
cannot copy on the calling thread (a test's wrapper) gets its jobs from the
same pipes through the event loop. Jobs the scheduler sends on the socket
(too large for a pipe record) run through the event loop too.

It watches the scheduler's process through a pidfd: when the scheduler exits
(even by SIGKILL), :meth:`Worker.serve` finishes the copies in flight,
detaches the region and returns ``"scheduler_gone"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import zmq
import zmq.asyncio

from kvtier.errors import InvalidArgumentError, KVTierError, ProtocolError, WorkerError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import DeviceTransfer, RunsNow, open_device_transfer
from kvtier.workers.jobs import (
    PIPE_BUF,
    Hello,
    JobDone,
    JobSpec,
    Notice,
    Welcome,
    decode,
    error_from,
    pack_record,
    unpack_records,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Worker", "WorkerThread", "run_worker"]

log = logging.getLogger("kvtier.workers")

Ending = Literal["stopped", "scheduler_gone"]


class Worker:
    """One tensor-parallel rank's data plane, in that rank's process.

    Open it with :meth:`open`, then await :meth:`serve` (or call
    :func:`run_worker` from a thread without an event loop)::

        worker = await Worker.open(address, layout, kv_caches)
        how = await worker.serve()       # until the scheduler stops it or dies

    Notes
    -----
    The rank is ``layout.tp_rank``; ``layout`` is this rank's own layout
    (``tp_size`` = the world size). The KV tensors must not be freed while the
    worker serves: jobs copy into and out of them.

    *Rows pinned for a job.* The residency (which row holds which block, which
    is pinned) lives in the scheduler; across the boundary a worker can check
    its consequence, cheaply: a row that a store writes is used by no other
    job running on this rank, and a row that a load reads is not being
    stored. A job that breaks this (a scheduler that lost track of its pins)
    is refused with ``InvalidArgumentError`` before any byte moves; its rows'
    other jobs are untouched. A row freed by the scheduler only after every
    rank reported its job cannot clash, since each rank reports a job only
    once its copy is over.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        sock: zmq.asyncio.Socket,
        rank: int,
        region: CPURegion,
        transfer: DeviceTransfer,
        scheduler_pid: int,
        pipes: _Pipes | None,
    ) -> None:
        """Use :meth:`open`."""
        self._ctx = ctx
        self._sock = sock
        self._rank = rank
        self._region = region
        self._xfer = transfer
        self._scheduler_pid = scheduler_pid
        self._pipes = pipes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._rows_lock = threading.Lock()
        """Claims change on the loop and on the job threads."""
        self._task: asyncio.Task[None] | None = None
        self._writing: set[int] = set()
        """Rows that a store running here writes."""
        self._reading: Counter[int] = Counter()
        """Rows that loads running here read, with how many loads read each."""
        self._ending: Ending = "stopped"
        self._stopping = False
        """Set by aclose: the worker stops unasked and says so."""
        self._closed = False

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self._rank

    @classmethod
    async def open(
        cls,
        address: str,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        backend: Literal["auto", "cpu", "cuda"] = "auto",
        timeout: float = 60.0,  # noqa: ASYNC109 - a deadline on the answer, not the call
        wrap_transfer: Callable[[DeviceTransfer], DeviceTransfer] | None = None,
    ) -> Worker:
        """Register with the scheduler at ``address`` and attach the shared region.

        Parameters
        ----------
        address
            :attr:`WorkerGroup.address` of the scheduler.
        layout
            This rank's layout (``tp_rank``, ``tp_size`` = world size).
        kv_caches
            This rank's KV tensors, in the layout's order.
        backend
            Device copier, as for :meth:`kvtier.Engine.open`.
        timeout
            Seconds to wait for the scheduler's answer.
        wrap_transfer
            Called with the copier; the worker uses what it returns (tests).

        Raises
        ------
        LayoutError
            The scheduler holds another layout (the message names the fields).
        InvalidArgumentError
            The rank is outside the scheduler's world size.
        BusyError
            Another live worker holds this rank.
        SharedRegionError
            The shared region cannot be attached (another instance's, gone).
        WorkerError
            No answer from the scheduler within ``timeout``.
        """
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        region: CPURegion | None = None
        transfer: DeviceTransfer | None = None
        pipes: _Pipes | None = None
        rank = layout.tp_rank
        try:
            sock.connect(address)
            hello = Hello(
                rank, os.getpid(), layout.namespace.hex(), layout.describe(include_rank=True)
            )
            await sock.send_multipart(hello.encode())
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout)
            except TimeoutError:
                raise WorkerError(
                    f"rank {rank}: no answer from the scheduler at {address} within {timeout} s",
                    rank,
                ) from None
            msg = decode(frames)
            if isinstance(msg, Notice) and msg.op == "refused":
                raise error_from(msg.error, msg.message, rank)
            if not isinstance(msg, Welcome):
                raise WorkerError(f"rank {rank}: the scheduler answered {msg!r}", rank)
            try:
                region = await asyncio.to_thread(
                    CPURegion.create,
                    layout,
                    msg.cpu_bytes_to_use,
                    world_size=msg.world_size,
                    rank=rank,
                    shared_name=msg.shared_name,
                    instance=bytes.fromhex(msg.instance),
                    alignment=msg.alignment,
                )
                transfer = open_device_transfer(
                    layout, kv_caches, region.tensor_views(), backend=backend
                )
                if wrap_transfer is not None:
                    transfer = wrap_transfer(transfer)
            except KVTierError as exc:
                await sock.send_multipart(Notice("failed", type(exc).__name__, str(exc)).encode())
                raise
            if msg.pipes:
                pipes = _Pipes.make(msg.pipes, rank)
            await sock.send_multipart(Notice("attached", None, "pipes" if pipes else "").encode())
            return cls(ctx, sock, rank, region, transfer, msg.scheduler_pid, pipes)
        except BaseException:
            if pipes is not None:
                pipes.close()
            if transfer is not None:
                await transfer.aclose()
            if region is not None:
                region.close()
            sock.close(linger=0)
            ctx.term()
            raise

    async def serve(self) -> Ending:
        """Run jobs until the scheduler says stop, or exits.

        Returns
        -------
        str
            ``"stopped"`` when the scheduler closed the group, ``"scheduler_gone"``
            when its process exited. Either way the copies in flight have
            finished and the region is detached.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._read_pipes(loop)
        pidfd: int | None = None
        try:
            pidfd = os.pidfd_open(self._scheduler_pid)
        except ProcessLookupError:
            self._ending = "scheduler_gone"
        else:
            loop.add_reader(pidfd, self._scheduler_exited)
        try:
            if self._ending != "scheduler_gone":
                await self._serve()
        except asyncio.CancelledError:
            if self._ending != "scheduler_gone":
                raise
            log.warning("rank %d: the scheduler exited; detaching", self._rank)
        finally:
            if pidfd is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)
            await self._shutdown(say_bye=self._ending == "stopped" or self._stopping)
        return self._ending

    def _read_pipes(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve the job pipes: a thread each that copies, or the loop for a wrapped copier."""
        pipes = self._pipes
        if pipes is None:
            return
        for kind, fd in pipes.jobs.items():
            if isinstance(self._xfer, RunsNow):
                th = threading.Thread(
                    target=self._pipe_thread,
                    args=(fd, self._xfer),
                    name=f"kvtier-worker-{self._rank}-{kind}",
                    daemon=True,
                )
                th.start()
                self._threads.append(th)
            else:
                os.set_blocking(fd, False)
                loop.add_reader(fd, self._on_pipe, fd, bytearray())

    def _on_pipe(self, fd: int, buf: bytearray) -> None:
        with contextlib.suppress(BlockingIOError):
            buf += os.read(fd, 1 << 16)
        for msg in self._records(buf):
            if isinstance(msg, JobSpec):
                self._run(msg)

    def _records(self, buf: bytearray) -> list[JobSpec | Notice]:
        try:
            records = unpack_records(buf)
        except ProtocolError as exc:
            log.warning("rank %d: dropped a job pipe's contents: %s", self._rank, exc)
            buf.clear()
            return []
        out: list[JobSpec | Notice] = []
        for _, frames in records:
            try:
                msg = decode(frames)
            except ProtocolError as exc:
                log.warning("rank %d: ignored a job pipe record: %s", self._rank, exc)
                continue
            if isinstance(msg, JobSpec | Notice):
                out.append(msg)
        return out

    def _pipe_thread(self, fd: int, xfer: RunsNow) -> None:
        """Read jobs from one direction's pipe and copy each on this thread, until stop."""
        buf = bytearray()
        while True:
            try:
                buf += os.read(fd, 1 << 16)
            except OSError as exc:  # pragma: no cover - the fd is ours until join
                log.error("rank %d: job pipe: %s", self._rank, exc)
                return
            for msg in self._records(buf):
                if isinstance(msg, Notice):
                    if msg.op == "stop":
                        return
                    continue
                try:
                    rows = self._claim(msg)
                except InvalidArgumentError as exc:
                    self._reply_threadsafe(JobDone(msg.job, type(exc).__name__, str(exc)))
                    continue
                try:
                    xfer.run_now(msg.kind == "store", msg.rows, msg.ids, msg.skip)
                except Exception as exc:  # reported to the scheduler, typed by name
                    done = JobDone(msg.job, type(exc).__name__, str(exc))
                else:
                    done = JobDone(msg.job)
                finally:
                    # The copy is over (its memory is free): the rows may serve the next job.
                    self._release(msg, rows)
                self._reply_threadsafe(done)

    def _reply_threadsafe(self, done: JobDone) -> None:
        """Answer from a job thread: on the done pipe, else through the loop's socket."""
        pipes, loop = self._pipes, self._loop
        if pipes is not None and pipes.write_done(done, self._rank):
            return
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(self._reply, done)

    async def _stop_pipes(self) -> None:
        pipes = self._pipes
        if pipes is None:
            return
        threads, self._threads = self._threads, []
        for fd in pipes.jobs.values():
            if threads:
                # The threads read until a stop: one each, after the jobs queued.
                os.write(fd, pack_record(Notice("stop").encode()))
            elif self._loop is not None:
                self._loop.remove_reader(fd)
        for th in threads:
            await asyncio.to_thread(th.join)  # its copy in flight finishes first

    def _scheduler_exited(self) -> None:
        self._ending = "scheduler_gone"
        if self._task is not None:
            self._task.cancel()

    async def _serve(self) -> None:
        while True:
            msg = decode(await self._sock.recv_multipart(copy=True))
            if isinstance(msg, JobSpec):
                self._run(msg)
            elif isinstance(msg, Notice) and msg.op == "stop":
                return

    def _claim(self, spec: JobSpec) -> list[int]:
        """Take ``spec``'s rows for the job: a store holds them alone, loads share them.

        Raises
        ------
        InvalidArgumentError
            A row of a store is used by a job still running here, or a row of a
            load is being stored: the scheduler's pins were not kept.
        """
        rows: list[int] = spec.rows.tolist()
        store = spec.kind == "store"
        with self._rows_lock:
            clash = [r for r in rows if r in self._writing or (store and r in self._reading)]
            if clash:
                raise InvalidArgumentError(
                    f"rank {self._rank}: {spec.kind} job {spec.job} names rows {clash[:8]} that "
                    "a job still running here uses: they are not pinned for it"
                )
            if store:
                self._writing.update(rows)
            else:
                self._reading.update(rows)
        return rows

    def _release(self, spec: JobSpec, rows: list[int]) -> None:
        with self._rows_lock:
            if spec.kind == "store":
                self._writing.difference_update(rows)
            else:
                self._reading.subtract(rows)
                for r in rows:
                    if self._reading[r] <= 0:
                        del self._reading[r]

    def _run(self, spec: JobSpec) -> None:
        try:
            rows = self._claim(spec)
        except InvalidArgumentError as exc:
            self._reply(JobDone(spec.job, type(exc).__name__, str(exc)))
            return
        try:
            if spec.kind == "store":
                comp = self._xfer.store(spec.ids, spec.rows)
            else:
                comp = self._xfer.load(spec.rows, spec.ids, spec.skip)
        except Exception as exc:  # reported to the scheduler, typed by name
            self._release(spec, rows)
            self._reply(JobDone(spec.job, type(exc).__name__, str(exc)))
            return

        def finished(c: Completion[None]) -> None:
            # The copy is over (its memory is free): the rows may serve the next job.
            self._release(spec, rows)
            exc = c.exception()
            if exc is None:
                self._reply(JobDone(spec.job))
            else:
                self._reply(JobDone(spec.job, type(exc).__name__, str(exc)))

        comp.add_done_callback(finished)

    def _reply(self, done: JobDone) -> None:
        if self._closed:
            return
        if self._pipes is not None and self._pipes.write_done(done, self._rank):
            return
        # Never blocks (no high-water mark); the future is done at once.
        self._sock.send_multipart(done.encode(), flags=zmq.NOBLOCK)

    async def _shutdown(self, say_bye: bool) -> None:
        if self._closed:
            return
        try:
            await self._stop_pipes()
            await self._xfer.aclose()  # every copy is done before the rows go
        finally:
            if self._pipes is not None:
                self._pipes.close()
            self._region.close()
            if say_bye:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(Notice("bye").encode(), flags=zmq.NOBLOCK)
            self._closed = True
            # A moment for the goodbye to leave before the socket goes.
            self._sock.close(linger=1000 if say_bye else 0)
            self._ctx.term()

    async def aclose(self) -> None:
        """Stop without being told; idempotent.

        The copies in flight finish, the region is detached, and the worker
        says goodbye: the scheduler fails the jobs it had not reported and
        refuses new ones, as when a worker dies (its pidfd would say so only
        when the process exits, and a worker on a thread may outlive its
        serving).
        """
        if self._task is not None and not self._task.done():
            self._stopping = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._shutdown(say_bye=True)


def run_worker(
    address: str,
    layout: KVLayout,
    kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    backend: Literal["auto", "cpu", "cuda"] = "auto",
    timeout: float = 60.0,
) -> Ending:
    """Open a :class:`Worker` and serve until stopped: blocking, with its own event loop.

    For a worker process whose main thread runs the model: call it from a
    thread of its own. Raises what :meth:`Worker.open` raises.
    """

    async def main() -> Ending:
        worker = await Worker.open(address, layout, kv_caches, backend=backend, timeout=timeout)
        return await worker.serve()

    return asyncio.run(main())


class WorkerThread:
    """A :class:`Worker` serving on a thread of its own, with its own event loop.

    For a worker process whose main thread is busy running the model (vLLM's
    worker, a training-style loop)::

        handle = WorkerThread.start(address, layout, kv_caches)  # returns once attached
        ...                                                      # the model runs
        handle.stop()                                            # or: handle.join()

    Notes
    -----
    Copies run on the thread's copier while the main thread works: the KV
    tensors are shared memory between the two, as they are with the
    in-process engine. The thread is a daemon: a process that exits without
    :meth:`stop` leaves the scheduler to see its exit.
    """

    def __init__(self) -> None:
        """Use :meth:`start`."""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: Worker | None = None
        self._error: BaseException | None = None
        self._ending: Ending | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        address: str,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        backend: Literal["auto", "cpu", "cuda"] = "auto",
        timeout: float = 60.0,
    ) -> WorkerThread:
        """Start the thread and wait until the worker registered and attached the region.

        Raises
        ------
        KVTierError
            What :meth:`Worker.open` raises; the thread has ended then.
        """
        self = cls()

        async def main() -> None:
            try:
                worker = await Worker.open(
                    address, layout, kv_caches, backend=backend, timeout=timeout
                )
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self._loop, self._worker = asyncio.get_running_loop(), worker
            self._ready.set()
            try:
                self._ending = await worker.serve()
            except asyncio.CancelledError:  # stop() closed it
                self._ending = "stopped"

        self._thread = threading.Thread(
            target=asyncio.run, args=(main(),), name=f"kvtier-worker-{layout.tp_rank}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    @property
    def alive(self) -> bool:
        """Whether the worker still serves."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> Ending | None:
        """Wait until serving ends (the scheduler stopped it or exited).

        Returns how it ended, or None if ``timeout`` passed first.
        """
        assert self._thread is not None
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._ending

    def stop(self, timeout: float | None = None) -> Ending | None:
        """Close the worker from any thread (the scheduler sees it exit), then :meth:`join`.

        Idempotent; the copies in flight finish first.
        """
        loop, worker = self._loop, self._worker
        if loop is not None and worker is not None and self.alive:
            with contextlib.suppress(RuntimeError):  # its loop has just closed
                asyncio.run_coroutine_threadsafe(worker.aclose(), loop)
        return self.join(timeout)


class _Pipes:
    """A worker's ends of the group's pipes: its two job pipes, the shared done pipe."""

    def __init__(self, jobs: dict[str, int], done: int) -> None:
        self.jobs = jobs
        """Read ends (opened read-write: never end-of-file) by kind."""
        self.done = done
        """Write end of the scheduler's done pipe, non-blocking."""

    @classmethod
    def make(cls, directory: str, rank: int) -> _Pipes | None:
        """Make and open this rank's job pipes; None (jobs on the socket) if that fails."""
        jobs: dict[str, int] = {}
        try:
            # Read-write, though only written: never SIGPIPE if the scheduler dies
            # (a model process may restore its default); its pidfd tells that.
            done = os.open(
                os.path.join(directory, "done"),
                os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
            )
        except OSError as exc:
            log.warning("rank %d: no done pipe (%s): jobs take the socket", rank, exc)
            return None
        try:
            for kind in ("store", "load"):
                path = os.path.join(directory, f"{rank}.{kind}")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a refused or dead worker's of this rank
                os.mkfifo(path, 0o600)
                jobs[kind] = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("rank %d: no job pipes (%s): jobs take the socket", rank, exc)
            for fd in (done, *jobs.values()):
                os.close(fd)
            return None
        return cls(jobs, done)

    def write_done(self, done: JobDone, rank: int) -> bool:
        """Write an answer in one record; False if it must take the socket instead."""
        record = pack_record(done.encode(), rank)
        if len(record) > PIPE_BUF:
            return False
        try:
            os.write(self.done, record)  # whole or not at all, among every writer
        except BlockingIOError:
            return False  # full: the scheduler stopped reading (gone? its pidfd says)
        return True

    def close(self) -> None:
        for fd in (self.done, *self.jobs.values()):
            os.close(fd)
        self.jobs.clear()
