"""io_uring bound to the asyncio event loop, without a polling thread.

The ring's completions are announced on an eventfd (``io_uring_register_eventfd``)
that the loop watches with ``loop.add_reader``; the reader callback reaps every
completion and resolves its :class:`~kvtier.transfer.completion.Completion`.
Requests are queued in Python and submitted once per loop iteration, many
entries per ``io_uring_enter``, never more than ``queue_depth`` in the kernel.

The ring is kvtier's own (:mod:`kvtier.transfer._ring`: the system calls
through ctypes, the queues through mmap), not a binding's: the PyPI
``liburing`` wheels die with SIGILL on CPUs without AVX-512 and keep a buffer
export of every ``Iovec`` item forever. Each request's ``struct iovec`` array
lives in a pooled ctypes buffer, rewritten with one ``struct.pack_into`` per
request; the request's own memoryviews hold the caller's buffers exported (so
they cannot be unmapped) until its completion is reaped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno as _errno
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ClosedError, TierIOError
from kvtier.transfer._io_base import IOEngine, Then, buffer_address, call_then
from kvtier.transfer._ring import OP_FSYNC, OP_READV, OP_WRITEV, Ring
from kvtier.transfer.completion import Completion

__all__ = ["UringEngine"]

_READ, _WRITE, _FSYNC = 0, 1, 2
_OPCODE = (OP_READV, OP_WRITEV, OP_FSYNC)


class _CIovec(ctypes.Structure):
    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


_Pooled = tuple["ctypes.Array[_CIovec]", int, int]
"""A pooled ``struct iovec[n]``: the ctypes array, its address, ``n``."""


class _IovecPool:
    """Reusable ``struct iovec`` arrays, one per request in flight, by length."""

    def __init__(self) -> None:
        self._free: dict[int, list[_Pooled]] = {}
        self._packers: dict[int, struct.Struct] = {}
        if ctypes.sizeof(_CIovec) != struct.calcsize("@PN"):
            raise RuntimeError("struct iovec is not {void *, size_t} here")

    def take(self, views: list[memoryview]) -> _Pooled:
        n = len(views)
        free = self._free.get(n)
        if free:
            item = free.pop()
        else:
            arr = (_CIovec * n)()
            item = (arr, ctypes.addressof(arr), n)
            self._packers.setdefault(n, struct.Struct("@" + "PN" * n))
        if n == 1:
            v = views[0]
            self._packers[1].pack_into(item[0], 0, buffer_address(v), v.nbytes)
        else:
            fields: list[int] = []
            for v in views:
                fields += (buffer_address(v), v.nbytes)
            # One pack_into per request instead of two ctypes attribute sets
            # per buffer: this is on every request's path.
            self._packers[n].pack_into(item[0], 0, *fields)
        return item

    def give(self, item: _Pooled) -> None:
        # The addresses left in the array are never read again: the kernel
        # only reads an array while the request that last wrote it is in
        # flight, and the next take() rewrites it first.
        self._free.setdefault(item[2], []).append(item)


_KIND = ("readv", "writev", "fsync")


@dataclass(slots=True)
class _Op:
    kind: int
    fd: int
    offset: int
    views: list[memoryview]
    completion: Completion[Any] | None
    # The pooled iovec array in the kernel's hands; ``views`` keep the caller's buffers
    # exported (they cannot be unmapped) until the completion is reaped.
    iov: _Pooled | None = field(default=None)
    then: Then | None = None
    """Called instead of resolving ``completion`` (IOEngine.submit)."""


class UringEngine(IOEngine):
    """:class:`~kvtier.transfer.io_engine.IOEngine` on one io_uring ring.

    Open it with :func:`~kvtier.transfer.io_engine.open_io_engine`; it belongs
    to the event loop running at construction and must be used from it.

    Parameters
    ----------
    queue_depth
        Most requests in the kernel at once; the ring gets that many entries
        (rounded up to a power of two) and a completion queue twice as deep,
        so completions can never overflow.
    """

    def __init__(self, *, queue_depth: int = 32) -> None:
        super().__init__(queue_depth=queue_depth)
        self._loop = asyncio.get_running_loop()
        self._iovecs = _IovecPool()
        self._ring = Ring(1 << max(1, (queue_depth - 1).bit_length()))
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
        self._ops: dict[int, _Op] = {}
        self._queue: collections.deque[_Op] = collections.deque()
        self._next_id = 1
        self._flush_scheduled = False
        self._released = False
        self._idle: asyncio.Future[None] | None = None

    # -- capabilities -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return "io_uring"

    # -- I/O ----------------------------------------------------------------------------

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        done: Completion[int] = Completion(self._loop)
        self._enqueue(_Op(_READ if read else _WRITE, fd, offset, views, done))
        return done

    def _submit_then(
        self, read: bool, fd: int, views: list[memoryview], offset: int, then: Then
    ) -> None:
        self._enqueue(_Op(_READ if read else _WRITE, fd, offset, views, None, then=then))

    def _submit_fsync(self, fd: int) -> Completion[None]:
        done: Completion[None] = Completion(self._loop)
        self._enqueue(_Op(_FSYNC, fd, 0, [], done))
        return done

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            while self._queue:
                op = self._queue.popleft()
                self._fail(op, ClosedError("the io_uring engine was closed"))
        if self._ops:
            if self._idle is None:
                self._idle = self._loop.create_future()
            # Shielded: the kernel may still write into caller memory, so the ring
            # is torn down only after _on_eventfd has reaped the last request.
            await asyncio.shield(self._idle)
        self._release()

    # -- internals ----------------------------------------------------------------------

    def _enqueue(self, op: _Op) -> None:
        self._queue.append(op)
        if not self._flush_scheduled:
            # Deferred to the end of this loop iteration so that every request
            # made in it goes to the kernel in one io_uring_enter.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        ring = self._ring
        queue = self._queue
        ops = self._ops
        prepared = 0
        room = min(ring.space(), self._depth - len(ops))
        while queue and prepared < room:
            op = queue.popleft()
            ident = self._next_id
            self._next_id += 1
            if op.kind == _FSYNC:
                ring.prep(OP_FSYNC, op.fd, 0, 0, 0, ident)
            else:
                op.iov = item = self._iovecs.take(op.views)
                ring.prep(_OPCODE[op.kind], op.fd, item[1], item[2], op.offset, ident)
            ops[ident] = op
            prepared += 1
        if not prepared:
            return
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
        self._max_in_flight = max(self._max_in_flight, len(self._ops))
        if self._ring.pending():
            # The kernel took only some entries (it may, short of memory): the
            # rest wait in the ring, and nothing else would submit them.
            self._loop.call_later(0.001, self._submit, 0)

    def _on_eventfd(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        ops = self._ops
        # The eventfd is read first: a completion posted while reaping either is
        # reaped now or signals the eventfd again.
        for ident, res in self._ring.reap():
            op = ops.pop(ident, None)
            if op is None:
                continue
            if res < 0:
                self._complete(op, 0, -res)
            else:
                self._complete(op, res, 0)
        if self._queue:
            self._flush()
        if not ops and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _complete(self, op: _Op, res: int, err: int) -> None:
        self._completed += 1
        if op.iov is not None:
            self._iovecs.give(op.iov)
            op.iov = None
        if err:
            self._failed += 1
            nbytes = sum(v.nbytes for v in op.views)
            self._fail(
                op,
                TierIOError(
                    err,
                    f"{_KIND[op.kind]} of {nbytes} bytes at offset {op.offset} "
                    f"on fd {op.fd} failed: {os.strerror(err)}",
                ),
            )
            return
        if op.kind == _READ:
            self._bytes_read += res
        elif op.kind == _WRITE:
            self._bytes_written += res
        if op.then is not None:
            op.views = []  # the buffers are the caller's again
            call_then(op.then, res, None)
        elif op.completion is not None:
            op.completion.set_result(None if op.kind == _FSYNC else res)

    @staticmethod
    def _fail(op: _Op, exc: BaseException) -> None:
        """Fail ``op`` with ``exc``: through its callback, or its completion."""
        if op.then is not None:
            op.views = []
            call_then(op.then, 0, exc)
        elif op.completion is not None:
            op.completion.set_exception(exc)

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
            self._ring.close()
            os.close(self._efd)

    def _occupancy(self) -> tuple[int, int]:
        return len(self._ops), len(self._queue)
