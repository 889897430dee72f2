"""Thread-pool I/O engine: ``os.preadv`` / ``os.pwritev`` in worker threads.

For where io_uring is unavailable (seccomp profiles of container runtimes,
``kernel.io_uring_disabled``). ``queue_depth`` threads run requests in
submission order; results come back to the loop with
``call_soon_threadsafe``, guarded so that a completion already resolved (or
a loop already closed) cannot break the worker.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from collections.abc import Callable

from kvtier.errors import ClosedError, TierIOError
from kvtier.transfer._io_base import IOEngine
from kvtier.transfer.completion import Completion

__all__ = ["ThreadEngine"]


def _done_already() -> int:
    raise AssertionError("a thread I/O job ran twice")


class _Job:
    """One request: run in a worker, resolved on the loop."""

    __slots__ = ("call", "done", "engine", "fd", "kind", "offset", "views")

    def __init__(
        self,
        engine: ThreadEngine,
        done: Completion[int],
        call: Callable[[], int],
        kind: str,
        fd: int,
        offset: int,
        views: list[memoryview],
    ) -> None:
        self.engine = engine
        self.done = done
        self.call = call
        self.kind = kind
        self.fd = fd
        self.offset = offset
        # Held until the worker is done: the buffers must outlive the system call.
        self.views = views

    def run(self) -> None:
        try:
            res = self.call()
        except OSError as exc:
            self.engine._finished(self, 0, exc)
        else:
            self.engine._finished(self, res, None)

    def resolve(self, res: int, exc: OSError | None) -> None:
        # Let go of the caller's buffers before the caller hears of it: a worker
        # thread keeps its last job until its next one, and a caller that closes
        # its mmap after the await must not find an export still alive.
        views, self.views, self.call = self.views, [], _done_already
        if exc is None:
            self.done.set_result(res)
            return
        nbytes = sum(v.nbytes for v in views)
        self.done.set_exception(
            TierIOError(
                exc.errno or 0,
                f"{self.kind} of {nbytes} bytes at offset {self.offset} on fd {self.fd} "
                f"failed: {exc.strerror}",
            )
        )


class ThreadEngine(IOEngine):
    """:class:`~kvtier.transfer.io_engine.IOEngine` on a pool of worker threads.

    Parameters
    ----------
    queue_depth
        Worker threads, hence most requests in flight at once; further
        requests wait in a queue in submission order.
    """

    def __init__(self, *, queue_depth: int = 32) -> None:
        super().__init__(queue_depth=queue_depth)
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._jobs: collections.deque[_Job | None] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._in_flight = 0
        self._queued = 0
        self._idle: asyncio.Future[None] | None = None

    # -- capabilities -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "threads"

    # -- I/O ----------------------------------------------------------------------------

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        done: Completion[int] = Completion(self._loop)
        if read:
            call: Callable[[], int] = lambda: os.preadv(fd, views, offset)  # noqa: E731
        else:
            call = lambda: os.pwritev(fd, views, offset)  # noqa: E731
        self._start(_Job(self, done, call, "readv" if read else "writev", fd, offset, views))
        return done

    def _submit_fsync(self, fd: int) -> Completion[None]:
        done: Completion[int] = Completion(self._loop)

        def _run() -> int:
            os.fsync(fd)
            return 0

        self._start(_Job(self, done, _run, "fsync", fd, 0, []))
        out: Completion[None] = Completion(self._loop)
        done.add_done_callback(
            lambda c: out.set_exception(e) if (e := c.exception()) else out.set_result(None)
        )
        return out

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            with self._lock:
                dropped = [j for j in self._jobs if j is not None]
                self._jobs.clear()
                self._queued = 0
                self._in_flight -= len(dropped)
                # One sentinel per worker: each exits after its current request.
                self._jobs.extend([None] * len(self._threads))
                self._wake.notify_all()
            for job in dropped:
                job.done.set_exception(ClosedError("the thread I/O engine was closed"))
        with self._lock:
            busy = self._in_flight > 0
            if busy and self._idle is None:
                self._idle = self._loop.create_future()
        if busy and self._idle is not None:
            # Shielded: a worker may still read or write caller memory.
            await asyncio.shield(self._idle)

    # -- internals ----------------------------------------------------------------------

    def _start(self, job: _Job) -> None:
        with self._lock:
            self._submitted += 1
            self._submit_calls += 1
            self._in_flight += 1
            self._max_in_flight = max(self._max_in_flight, min(self._in_flight, self._depth))
            self._jobs.append(job)
            self._queued += 1
            if len(self._threads) < self._depth and len(self._threads) < self._in_flight:
                t = threading.Thread(target=self._worker, name="kvtier-io", daemon=True)
                self._threads.append(t)
                t.start()
            self._wake.notify()

    def _finished(self, job: _Job, res: int, exc: OSError | None) -> None:
        """Worker side: count the result and hand it to the loop."""
        with self._lock:
            self._in_flight -= 1
            self._completed += 1
            if exc is not None:
                self._failed += 1
            elif job.kind == "readv":
                self._bytes_read += res
            elif job.kind == "writev":
                self._bytes_written += res
            idle = self._in_flight == 0 and self._idle is not None
        try:
            self._loop.call_soon_threadsafe(job.resolve, res, exc)
            if idle:
                self._loop.call_soon_threadsafe(self._set_idle)
        except RuntimeError:
            # The loop was closed under us: nobody is left to tell.
            pass

    def _set_idle(self) -> None:
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._jobs:
                    self._wake.wait()
                job = self._jobs.popleft()
                if job is not None:
                    self._queued -= 1
            if job is None:
                return
            job.run()

    def _occupancy(self) -> tuple[int, int]:
        with self._lock:
            return self._in_flight - self._queued, self._queued
