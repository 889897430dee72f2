"""io_uring bound to the asyncio event loop, without a polling thread.

The ring's completions are announced on an eventfd (``io_uring_register_eventfd``)
that the loop watches with ``loop.add_reader``; the reader callback reaps every
completion and resolves its :class:`~kvtier.transfer.completion.Completion`.
Requests are queued in Python and submitted once per loop iteration, many
entries per ``io_uring_enter``, never more than ``queue_depth`` in the kernel.
Every request belongs to a batch (one request for :meth:`readv`, many for
:meth:`~kvtier.transfer.io_engine.IOEngine.submit_many`) whose number is in
the upper half of each entry's tag.

The ring is kvtier's own (:mod:`kvtier.transfer._ring`: the system calls
through ctypes, the queues through mmap), not a binding's: the PyPI
``liburing`` wheels die with SIGILL on CPUs without AVX-512 and keep a buffer
export of every ``Iovec`` item forever. A batch's ``struct iovec`` arrays live
in one ``bytearray``, written with its submission entries by one compiled call
per run of requests (:meth:`Ring.prep_rw`); its completions are read by one
call per reap (:meth:`Ring.reap_runs`, already in the shape the batch's
callback takes). The batch's own memoryviews hold the
caller's buffers exported (so they cannot be unmapped) until its last request
is reaped.

Memory registered with :meth:`UringEngine.register_memory` (the CPU region,
the file tier's header pages) becomes the ring's fixed buffers: a request of
one buffer inside it goes as one ``READ_FIXED`` / ``WRITE_FIXED`` entry, and a
request of two (a block's header page and its row) whose row has at least
:data:`~kvtier.transfer._ring.SPLIT_MIN` bytes as two at consecutive offsets,
reported once, when both are in. The kernel then pins no pages for it, which
is much of its CPU per request at large blocks (fio at 2 MiB: about a quarter
of the CPU per GB with ``--fixedbufs``); below 1 MiB a second entry costs more
than that saves, and the request goes vectored as before.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ClosedError, TierIOError
from kvtier.transfer._io_base import (
    IOEngine,
    Then,
    ThenMany,
    _as_bytes_view,
    buffer_address,
    call_then_many,
)
from kvtier.transfer._ring import (
    ACC_BYTES,
    FIXED_CAPABLE,
    MAX_FIXED_BUFFERS,
    MAX_FIXED_BYTES,
    OP_FSYNC,
    OP_READV,
    OP_WRITEV,
    SPLIT_MIN,
    Ring,
)
from kvtier.transfer.completion import Completion

__all__ = ["MAX_FIXED_BYTES", "SPLIT_MIN", "UringEngine"]

_READ, _WRITE, _FSYNC = 0, 1, 2
_OPCODE = (OP_READV, OP_WRITEV, OP_FSYNC)
_KIND = ("readv", "writev", "fsync")
_IOVEC_BYTES = 16
_Reported = list[tuple[int, int, BaseException | None]]

log = logging.getLogger("kvtier.io")


class _IovecPool:
    """The check :func:`~kvtier.transfer.io_engine.probe_io_uring` runs on the
    ``struct iovec`` layout: batches write iovecs as two 8-byte words each."""

    def __init__(self) -> None:
        if struct.calcsize("@PN") != _IOVEC_BYTES:
            raise RuntimeError("struct iovec is not {void *, size_t} of 8 bytes each here")


@dataclass(slots=True)
class _Batch:
    """Requests of one kind on one descriptor, reported together."""

    kind: int
    fd: int
    requests: list[list[memoryview]]
    """The caller's buffers, kept exported until the last request is reaped."""
    offsets: list[int]
    then: ThenMany | None
    """Gets the requests' outcomes (submit_many, submit), else ``completion`` does."""
    completion: Completion[Any] | None
    ident: int = 0
    left: int = 0
    """Requests not yet reported."""
    prepared: int = 0
    """Requests handed to the ring so far (they go in order)."""
    iov: bytearray | None = None
    """The ``struct iovec`` arrays, ``stride`` per request, read by the kernel."""
    stride: int = 1
    acc: bytearray | None = None
    """Where the two parts of each request sent as two fixed-buffer entries meet."""
    reaped: _Reported = field(default_factory=list)
    """Outcomes reaped and not yet reported (within one reap)."""
    moved: int = 0
    """Bytes the requests in ``reaped`` transferred."""


class UringEngine(IOEngine):
    """:class:`~kvtier.transfer.io_engine.IOEngine` on one io_uring ring.

    Open it with :func:`~kvtier.transfer.io_engine.open_io_engine`; it belongs
    to the event loop running at construction and must be used from it.

    Parameters
    ----------
    queue_depth
        Most requests in the kernel at once; the ring gets twice as many
        entries (rounded up to a power of two: a request may take two, see
        :meth:`register_memory`) and a completion queue twice as deep again,
        so completions can never overflow.
    """

    def __init__(self, *, queue_depth: int = 32) -> None:
        super().__init__(queue_depth=queue_depth)
        self._loop = asyncio.get_running_loop()
        self._ring = Ring(2 << max(1, (queue_depth - 1).bit_length()))
        try:
            self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except BaseException:
            self._ring.close()
            raise
        try:
            self._ring.register_eventfd(self._efd)
        except BaseException:
            os.close(self._efd)
            self._ring.close()
            raise
        self._loop.add_reader(self._efd, self._on_eventfd)
        self._batches: dict[int, _Batch] = {}
        self._queue: collections.deque[_Batch] = collections.deque()
        self._in_flight = 0
        self._queued = 0
        self._next_id = 1
        self._flush_scheduled = False
        self._reaping = False
        """True while completions are handed out: _on_eventfd flushes what they queue."""
        self._released = False
        self._idle: asyncio.Future[None] | None = None
        # Registered memory: each owner's exports and (address, length) spans,
        # the lookup prep_rw takes, and the accumulators of split batches.
        self._owners: dict[int, tuple[object, list[memoryview], list[tuple[int, int]]]] = {}
        self._fixed = 0
        self._table: bytes | None = None
        self._split: dict[int, bytearray] = {}

    # -- capabilities -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "io_uring"

    # -- I/O ----------------------------------------------------------------------------

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        done: Completion[int] = Completion(self._loop)
        self._enqueue(_Batch(_READ if read else _WRITE, fd, [views], [offset], None, done))
        return done

    def _submit_then(
        self, read: bool, fd: int, views: list[memoryview], offset: int, then: Then
    ) -> None:
        def one(done: _Reported) -> None:
            _, nbytes, exc = done[0]
            then(nbytes, exc)

        self._enqueue(_Batch(_READ if read else _WRITE, fd, [views], [offset], one, None))

    def _submit_many(
        self,
        read: bool,
        fd: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        then: ThenMany,
    ) -> None:
        self._enqueue(_Batch(_READ if read else _WRITE, fd, requests, offsets, then, None))

    def _submit_fsync(self, fd: int) -> Completion[None]:
        done: Completion[None] = Completion(self._loop)
        self._enqueue(_Batch(_FSYNC, fd, [[]], [0], None, done))
        return done

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            closed = ClosedError("the io_uring engine was closed")
            while self._queue:
                batch = self._queue.popleft()
                self._queued -= len(batch.requests) - batch.prepared
                batch.reaped = [(i, 0, closed) for i in range(batch.prepared, len(batch.requests))]
                self._report(batch)
        if self._in_flight:
            if self._idle is None:
                self._idle = self._loop.create_future()
            # Shielded: the kernel may still write into caller memory, so the ring
            # is torn down only after _on_eventfd has reaped the last request.
            await asyncio.shield(self._idle)
        self._release()

    # -- registered memory --------------------------------------------------------------

    def register_memory(self, owner: object, buffers: Sequence[object]) -> int:
        self._check_open()
        if not FIXED_CAPABLE:
            return 0  # fixed buffers need the compiled helper's prep_rw
        # Views of our own (never the caller's objects), released when unregistered.
        views = [_as_bytes_view(memoryview(b)) for b in buffers]  # type: ignore[arg-type]
        spans: list[tuple[int, int]] = []
        for v in views:
            addr = buffer_address(v)
            for start in range(0, v.nbytes, MAX_FIXED_BYTES):
                spans.append((addr + start, min(MAX_FIXED_BYTES, v.nbytes - start)))
        previous = self._owners.pop(id(owner), None)
        if spans:
            self._owners[id(owner)] = (owner, views, spans)
        if self._reregister():
            if previous is not None:
                for v in previous[1]:
                    v.release()
            return sum(n for _, n in spans)
        # Refused (the memlock limit, memory the kernel will not pin): this
        # owner's I/O goes as before, the others' stays registered.
        self._owners.pop(id(owner), None)
        if previous is not None:
            self._owners[id(owner)] = previous
        if not self._reregister():
            self._owners.clear()
            self._reregister()
        for v in views:
            v.release()
        return 0

    def unregister_memory(self, owner: object) -> None:
        entry = self._owners.pop(id(owner), None)
        if entry is None or self._released:
            return
        if not self._reregister():
            self._owners.clear()
            self._reregister()
        for v in entry[1]:
            v.release()

    def _reregister(self) -> bool:
        """Hand the kernel every owner's spans as the ring's fixed buffers; False if refused."""
        spans = [span for _, _, owned in self._owners.values() for span in owned]
        if self._ring.pending():
            # Entries the kernel has not taken yet name buffers by index: they
            # must go in under the table they were written for.
            with contextlib.suppress(OSError):
                self._ring.submit()
        self._table = None
        try:
            if self._ring.pending() or len(spans) > MAX_FIXED_BUFFERS:
                raise OSError(_errno.EBUSY, "entries still waiting, or too many buffers")
            self._ring.register_buffers(spans)
        except OSError as exc:
            log.info(
                "io_uring: %d buffers not registered (%s); I/O pins pages per request",
                len(spans),
                exc,
            )
            with contextlib.suppress(OSError):
                self._ring.unregister_buffers()
            return False
        self._table = Ring.fixed_table(spans) if spans else None
        return True

    def _fixed_requests(self) -> int:
        return self._fixed

    def _registered_bytes(self) -> int:
        if self._table is None:
            return 0
        return sum(n for _, _, owned in self._owners.values() for _, n in owned)

    # -- internals ----------------------------------------------------------------------

    def _enqueue(self, batch: _Batch) -> None:
        # Batch numbers fill the upper 32 bits of a tag; one still in flight
        # after four billion others would be a leak long noticed.
        ident = self._next_id
        self._next_id = ident % 0xFFFFFFFF + 1
        batch.ident = ident
        batch.left = len(batch.requests)
        batch.stride = max(map(len, batch.requests))
        self._batches[ident] = batch
        self._queue.append(batch)
        self._queued += batch.left
        if not self._flush_scheduled and not self._reaping:
            # Deferred to the end of this loop iteration so that every request
            # made in it goes to the kernel in one io_uring_enter. (Requests
            # made by the callbacks of a reap go in at its end, without another
            # turn of the loop.)
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        ring = self._ring
        queue = self._queue
        # Two entries per request: one with two buffers in registered memory
        # takes a fixed-buffer entry for each.
        room = min(ring.space() // 2, self._depth - self._in_flight)
        prepared = 0
        while queue and room > 0:
            batch = queue[0]
            count = min(room, len(batch.requests) - batch.prepared)
            if batch.kind == _FSYNC:
                ring.prep(OP_FSYNC, batch.fd, 0, 0, 0, batch.ident << 32)
            else:
                if batch.iov is None:
                    batch.iov = bytearray(len(batch.requests) * batch.stride * _IOVEC_BYTES)
                if self._table is not None and batch.stride == 2 and batch.acc is None:
                    batch.acc = bytearray(ACC_BYTES * len(batch.requests))
                    self._split[batch.ident] = batch.acc
                try:
                    self._fixed += ring.prep_rw(
                        _OPCODE[batch.kind],
                        batch.fd,
                        batch.iov,
                        batch.stride,
                        batch.requests,
                        batch.offsets,
                        batch.prepared,
                        count,
                        batch.ident,
                        self._table,
                        batch.acc,
                    )
                except Exception as exc:
                    # Checked at submission, so a bug: fail the batch's unprepared
                    # requests rather than leave them queued for ever.
                    queue.popleft()
                    self._queued -= len(batch.requests) - batch.prepared
                    err = TierIOError(_errno.EIO, f"internal error preparing a request: {exc!r}")
                    batch.reaped = [(i, 0, err) for i in range(batch.prepared, len(batch.requests))]
                    self._failed += len(batch.reaped)
                    self._report(batch)
                    continue
            batch.prepared += count
            room -= count
            prepared += count
            if batch.prepared == len(batch.requests):
                queue.popleft()
        if not prepared:
            return
        self._in_flight += prepared
        self._queued -= prepared
        self._submit(prepared)

    def _submit(self, prepared: int) -> None:
        if self._released:
            return  # a retry scheduled before the ring was torn down
        try:
            self._ring.submit()
        except OSError as exc:
            # The entries stay in the submission ring (nothing was consumed);
            # EAGAIN / EBUSY clear as the kernel frees resources, so retry shortly.
            self._loop.call_later(0.001, self._submit, prepared)
            if exc.errno not in (_errno.EAGAIN, _errno.EBUSY, _errno.EINTR):
                raise
            return
        self._submitted += prepared
        self._submit_calls += 1
        self._max_in_flight = max(self._max_in_flight, self._in_flight)
        if self._ring.pending():
            # The kernel took only some entries (it may, short of memory): the
            # rest wait in the ring, and nothing else would submit them.
            self._loop.call_later(0.001, self._submit, 0)

    def _on_eventfd(self) -> None:
        ring, split = self._ring, self._split or None
        runs = ring.reap_runs(split)
        # Reaped until the eventfd is read with nothing left to reap. On the
        # cooperative ring a completion is posted, and the eventfd signalled,
        # by task work that runs as this thread leaves a system call: reading
        # the eventfd posts what completed since the reap and signals the
        # eventfd again, just after clearing it. Read once before reaping (as
        # before), that left a signal for completions already reaped: about
        # 40% of the wake-ups of 256 KiB loads at depth 64 found nothing (36
        # blocks per wake-up on average, 64 now). A completion posted after the
        # last look signals the eventfd anew, so none waits unreaped; the loop
        # ends, as nothing is submitted in it.
        while True:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._efd)
            if not ring.completions_waiting():
                break
            runs += ring.reap_runs(split)
        batches = self._batches
        touched: list[_Batch] = []
        count = 0
        for ident, outcomes, moved, failed in runs:
            count += len(outcomes)
            batch = batches.get(ident)
            if batch is None:
                continue
            if failed:
                outcomes = [
                    (i, res, None) if res >= 0 else (i, 0, self._error(batch, i, -res))
                    for i, res, _ in outcomes
                ]
            if batch.reaped:
                batch.reaped.extend(outcomes)
            else:
                touched.append(batch)
                batch.reaped = outcomes
            batch.moved += moved
        self._in_flight -= count
        self._completed += count
        if self._queue:
            # Requests waiting for ring room go in before the callers run: a
            # caller's work on what was reaped (a tier verifying 32 blocks of
            # 2 MiB takes ~2 ms) then overlaps the device's next requests
            # instead of leaving it idle.
            self._flush()
        self._reaping = True
        try:
            for batch in touched:
                if batch.kind == _READ:
                    self._bytes_read += batch.moved
                elif batch.kind == _WRITE:
                    self._bytes_written += batch.moved
                batch.moved = 0
                self._report(batch)
        finally:
            self._reaping = False
            if self._queue:
                self._flush()
        if not self._in_flight and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _error(self, batch: _Batch, index: int, err: int) -> TierIOError:
        self._failed += 1
        nbytes = sum(v.nbytes for v in batch.requests[index])
        return TierIOError(
            err,
            f"{_KIND[batch.kind]} of {nbytes} bytes at offset {batch.offsets[index]} "
            f"on fd {batch.fd} failed: {os.strerror(err)}",
        )

    def _report(self, batch: _Batch) -> None:
        """Hand ``batch.reaped`` to its caller; forget the batch once all is reported."""
        done, batch.reaped = batch.reaped, []
        batch.left -= len(done)
        if not batch.left:
            del self._batches[batch.ident]
            if batch.acc is not None:
                del self._split[batch.ident]
                batch.acc = None
            # The buffers are the caller's again.
            batch.requests = []
            batch.iov = None
        if batch.then is not None:
            call_then_many(batch.then, done)
        elif batch.completion is not None:
            _, res, exc = done[0]
            if exc is not None:
                batch.completion.set_exception(exc)
            else:
                batch.completion.set_result(None if batch.kind == _FSYNC else res)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        # RuntimeError: the loop is already closed, nothing watches the fd any more.
        with contextlib.suppress(RuntimeError):
            self._loop.remove_reader(self._efd)
        try:
            self._ring.unregister_eventfd()
        finally:
            self._ring.close()  # (which drops the registered buffers)
            os.close(self._efd)
            for _, views, _ in self._owners.values():
                for v in views:
                    v.release()
            self._owners.clear()
            self._table = None

    def _occupancy(self) -> tuple[int, int]:
        return self._in_flight, self._queued
