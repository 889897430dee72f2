"""Thread-pool I/O engine: ``os.preadv`` / ``os.pwritev`` in worker threads.

For where io_uring is unavailable (seccomp profiles of container runtimes,
``kernel.io_uring_disabled``). ``queue_depth`` threads take requests in
submission order from one queue.

Built to cost little per request, the way the io_uring engine does: a batch
(one request for :meth:`~kvtier.transfer.io_engine.IOEngine.readv`, many for
:meth:`~kvtier.transfer.io_engine.IOEngine.submit_many`) is queued as
``(batch, index)`` pairs, and a parked worker is woken only while one is idle.
A worker appends each outcome to a deque and wakes the loop (one
``call_soon_threadsafe``, like io_uring's eventfd) only when no wake-up is
pending and either the queue is empty or ``queue_depth // 2`` outcomes wait;
the loop then reports each batch once per drain. While requests are queued
every worker is busy, so an outcome waits for at most that many more
completions. A loop already closed cannot break a worker.

The queue, the parked workers and the outcomes are a deque and lists whose
single operations are atomic (the GIL, or the per-object locks of a
free-threaded build): no lock is taken per request. Measured against a
``threading.Lock`` around them and a wake-up per burst, a fresh tier's 256
KiB writes at depth 32 (alternated in one process): 2.9 context switches
per request against 3.3, 0.23 CPU s/GB against 0.31, 0.86x fio's rate into
a fresh file against 0.77x.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import itertools
import os
import threading
from typing import Any

from kvtier.errors import ClosedError, TierIOError
from kvtier.transfer._io_base import IOEngine, Then, ThenMany, call_then, call_then_many
from kvtier.transfer.completion import Completion

__all__ = ["ThreadEngine"]

_READ, _WRITE, _FSYNC = 0, 1, 2
_KIND = ("readv", "writev", "fsync")
_Reported = list[tuple[int, int, BaseException | None]]


class _Batch:
    """Requests of one kind on one descriptor, reported together."""

    __slots__ = ("completion", "fd", "kind", "left", "many", "offsets", "one", "reaped", "requests")

    def __init__(
        self,
        kind: int,
        fd: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        *,
        many: ThenMany | None = None,
        one: Then | None = None,
        completion: Completion[Any] | None = None,
    ) -> None:
        self.kind = kind
        self.fd = fd
        # Held until the last request is reported: the buffers must outlive
        # the system calls, and a caller's mmap cannot be closed under them.
        self.requests = requests
        self.offsets = offsets
        self.many = many
        """Gets the outcomes (submit_many); else ``one`` (submit) or ``completion``."""
        self.one = one
        self.completion = completion
        self.left = len(requests)
        """Requests not yet reported."""
        self.reaped: _Reported = []
        """Outcomes drained and not yet reported (within one drain)."""


_PARK: Any = object()
"""What a worker takes from an empty queue."""

_Done = tuple[_Batch, int, int, BaseException | None]
"""A worker's outcome: ``(batch, index, bytes, None)`` or ``(batch, index, 0, error)``."""


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
        self._jobs: collections.deque[tuple[_Batch, int] | None] = collections.deque()
        self._parked: list[threading.Lock] = []
        """Idle workers' wake-up locks (held; released to wake one)."""
        self._threads: list[threading.Thread] = []
        # Outcomes go from the workers to the loop through _done; deque appends
        # and pops are atomic, so no lock is taken for them.
        self._done: collections.deque[_Done] = collections.deque()
        self._woken = False
        """A drain is scheduled and has not yet started taking outcomes."""
        self._burst = max(1, queue_depth // 2)
        """Outcomes that wake the loop while requests are still queued."""
        self._in_flight = 0
        """Requests queued or running, or finished and not yet drained (loop side)."""
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
        self._enqueue(_Batch(_READ if read else _WRITE, fd, [views], [offset], completion=done))
        return done

    def _submit_then(
        self, read: bool, fd: int, views: list[memoryview], offset: int, then: Then
    ) -> None:
        self._enqueue(_Batch(_READ if read else _WRITE, fd, [views], [offset], one=then))

    def _submit_many(
        self,
        read: bool,
        fd: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        then: ThenMany,
    ) -> None:
        # The requests are checked (IOEngine.submit_many); os.preadv takes any
        # buffer objects, so the caller's lists go to the workers as they are.
        self._enqueue(_Batch(_READ if read else _WRITE, fd, requests, offsets, many=then))

    def _submit_fsync(self, fd: int) -> Completion[None]:
        done: Completion[None] = Completion(self._loop)
        self._enqueue(_Batch(_FSYNC, fd, [[]], [0], completion=done))
        return done

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            # One popleft at a time: a worker may take a job meanwhile, and
            # each job must go either to it or to the dropped, never both.
            jobs = self._jobs
            dropped: list[tuple[_Batch, int]] = []
            while jobs:
                try:
                    job = jobs.popleft()
                except IndexError:
                    break
                if job is not None:
                    dropped.append(job)
            # One sentinel per worker: each exits after its current request.
            jobs.extend([None] * len(self._threads))
            parked = self._parked
            while parked:
                try:
                    wake = parked.pop()
                except IndexError:
                    break
                wake.release()
            closed = ClosedError("the thread I/O engine was closed")
            touched: list[_Batch] = []
            for batch, index in dropped:
                if not batch.reaped:
                    touched.append(batch)
                batch.reaped.append((index, 0, closed))
            self._in_flight -= len(dropped)
            for batch in touched:
                self._report(batch)
        if self._in_flight:
            if self._idle is None:
                self._idle = self._loop.create_future()
            # Shielded: a worker may still read or write caller memory.
            await asyncio.shield(self._idle)

    # -- internals ----------------------------------------------------------------------

    def _enqueue(self, batch: _Batch) -> None:
        count = batch.left
        self._submitted += count
        self._submit_calls += 1
        self._in_flight += count
        self._max_in_flight = max(self._max_in_flight, min(self._in_flight, self._depth))
        jobs = self._jobs
        if count == 1:
            jobs.append((batch, 0))
        else:
            jobs.extend(zip(itertools.repeat(batch, count), range(count), strict=True))
        # Only as many idle workers as there are new requests: a busy one
        # takes the next job itself when its request is done. The jobs are
        # queued first, so a worker parking meanwhile either finds them (see
        # _worker) or is in the list by now.
        parked = self._parked
        for _ in range(count):
            try:
                wake = parked.pop()
            except IndexError:
                break
            wake.release()
        threads = self._threads
        want = min(self._depth, self._in_flight)
        while len(threads) < want:
            t = threading.Thread(target=self._worker, name="kvtier-io", daemon=True)
            threads.append(t)
            t.start()

    def _worker(self) -> None:
        jobs, parked, done = self._jobs, self._parked, self._done
        preadv, pwritev = os.preadv, os.pwritev
        burst = self._burst
        wake = threading.Lock()
        wake.acquire()
        outcome: _Done | None = None
        while True:
            try:
                job = jobs.popleft()
            except IndexError:
                job = _PARK
            # The next job is taken before the last outcome is published: the
            # device gets it sooner, and the wake-up below knows what is left.
            if outcome is not None:
                done.append(outcome)
                outcome = None
            if not self._woken and done and (not jobs or job is None or len(done) >= burst):
                # Queued requests keep every worker busy, so an outcome left
                # here is followed by others: the burst fills, or the worker
                # that takes the last job (the queue is then empty) wakes the
                # loop. The drain clears the flag before it takes outcomes,
                # so one appended after that schedules another drain.
                self._woken = True
                # RuntimeError: the loop was closed under us, nobody is left to tell.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._drain)
            if job is _PARK:
                parked.append(wake)
                if jobs:
                    # Queued between the popleft and the append: _enqueue may
                    # not have seen this worker parked. Take it back, or
                    # consume the release _enqueue (or aclose) already made.
                    try:
                        parked.remove(wake)
                    except ValueError:
                        wake.acquire()
                    continue
                # Released by _enqueue (a job was queued) or aclose (the sentinel).
                wake.acquire()
                continue
            if job is None:
                return
            batch, index = job
            kind = batch.kind
            try:
                if kind == _READ:
                    res = preadv(batch.fd, batch.requests[index], batch.offsets[index])
                elif kind == _WRITE:
                    res = pwritev(batch.fd, batch.requests[index], batch.offsets[index])
                else:
                    os.fsync(batch.fd)
                    res = 0
            except Exception as exc:
                # An error fails its request, never the thread (later requests
                # would wait for ever, and aclose with them). Without its
                # traceback: that would hold this frame, hence its last job.
                outcome = (batch, index, 0, exc.with_traceback(None))
            else:
                outcome = (batch, index, res, None)
            del job, batch

    def _drain(self) -> None:
        """Loop side: report every outcome the workers have appended."""
        self._woken = False
        done = self._done
        count = len(done)
        if not count:
            return
        touched: list[_Batch] = []
        moved = [0, 0, 0]
        for _ in range(count):
            batch, index, res, exc = done.popleft()
            if not batch.reaped:
                touched.append(batch)
            if exc is None:
                moved[batch.kind] += res
                batch.reaped.append((index, res, None))
            else:
                batch.reaped.append((index, 0, self._error(batch, index, exc)))
        self._in_flight -= count
        self._completed += count
        self._bytes_read += moved[_READ]
        self._bytes_written += moved[_WRITE]
        for batch in touched:
            self._report(batch)
        if not self._in_flight and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _error(self, batch: _Batch, index: int, exc: BaseException) -> TierIOError:
        self._failed += 1
        nbytes = sum(v.nbytes for v in batch.requests[index])
        what = f"{_KIND[batch.kind]} of {nbytes} bytes at offset {batch.offsets[index]}"
        if isinstance(exc, OSError):
            return TierIOError(exc.errno or 0, f"{what} on fd {batch.fd} failed: {exc.strerror}")
        # Not the kernel's refusal (the request was checked): a bug, kept as the cause.
        err = TierIOError(_errno.EIO, f"{what} on fd {batch.fd} failed: internal error {exc!r}")
        err.__cause__ = exc
        return err

    def _report(self, batch: _Batch) -> None:
        """Hand ``batch.reaped`` to its caller; let go of the buffers once all is reported."""
        done, batch.reaped = batch.reaped, []
        batch.left -= len(done)
        if not batch.left:
            # Before the caller hears of it: a caller that closes its mmap
            # right after must not find an export of ours still alive.
            batch.requests = []
        if batch.many is not None:
            call_then_many(batch.many, done)
        elif batch.one is not None:
            _, nbytes, exc = done[0]
            call_then(batch.one, nbytes, exc)
        elif batch.completion is not None:
            _, nbytes, exc = done[0]
            if exc is not None:
                batch.completion.set_exception(exc)
            else:
                batch.completion.set_result(None if batch.kind == _FSYNC else nbytes)

    def _occupancy(self) -> tuple[int, int]:
        queued = 0 if self._closed else len(self._jobs)
        return self._in_flight - queued, queued
