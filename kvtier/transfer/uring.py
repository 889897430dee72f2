"""io_uring bound to the asyncio event loop, without a polling thread.

The ring's completions are announced on an eventfd (``io_uring_register_eventfd``)
that the loop watches with ``loop.add_reader``; the reader callback reaps every
completion and resolves its :class:`~kvtier.transfer.completion.Completion`.
Requests are queued in Python and submitted once per loop iteration, many
entries per ``io_uring_enter``, never more than ``queue_depth`` in the kernel.

Binding pitfalls handled here (the PyPI ``liburing`` package):

* ``prep_read`` / ``prep_write`` take ``bytes``; ``Iovec`` with ``prep_readv`` /
  ``prep_writev`` reads and writes any buffer in place, which is what lets a
  CPU-region row go to disk without a copy.
* ``Iovec([...])`` takes a buffer export of every item and never releases it
  (measured with binding 2026.3.30: an ``mmap`` given to it can never be closed
  again). So ``Iovec`` objects are built once over an immutable ``bytes``
  placeholder (bytes count no exports), pooled, and their C ``iovec`` array is
  rewritten with each request's addresses (:class:`_IovecPool`). The layout
  this relies on is checked when the pool is created; the request's own
  memoryviews hold the caller's buffers (a real, released export) until the
  kernel is done.
* A negative result raises ``OSError`` when ``.res`` is read: the entry is
  marked seen in a ``finally`` or the ring would hand it back forever.
* ``Cqe[i]`` for ``i > 0`` is not masked by the ring size: entries are reaped
  one at a time through ``cqe[0]``.
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

import liburing as L  # type: ignore[import-untyped]  # no py.typed; its .pyi does not parse
import numpy as np

from kvtier.errors import ClosedError, TierIOError
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine, buffer_address

__all__ = ["UringEngine"]

_READ, _WRITE, _FSYNC = 0, 1, 2
_PLACEHOLDER = bytes(1)


class _CIovec(ctypes.Structure):
    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


# PyOZ lays an ``Iovec`` out as the object header then ``{usize len; iovec *ptr}``.
_LEN_AT = object.__basicsize__
_PTR_AT = _LEN_AT + ctypes.sizeof(ctypes.c_size_t)


_Pooled = tuple[Any, "ctypes.Array[ctypes.c_ubyte]", int]
"""A pooled ``Iovec``: the binding's object, its C array as raw bytes, its length."""


class _IovecPool:
    """Reusable ``Iovec`` objects whose C arrays are rewritten per request.

    Raises
    ------
    RuntimeError
        When the binding's ``Iovec`` layout is not the one this relies on
        (a later binding release): the probe then reports io_uring unusable.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[_Pooled]] = {}
        self._packers: dict[int, struct.Struct] = {}
        probe = L.Iovec([_PLACEHOLDER])
        arr = (_CIovec * 1).from_address(self._array_address(probe, 1))
        want = int(np.frombuffer(_PLACEHOLDER, np.uint8).ctypes.data)
        if arr[0].iov_base != want or arr[0].iov_len != 1 or len(probe) != 1:
            raise RuntimeError("liburing.Iovec has an unknown memory layout")
        if ctypes.sizeof(_CIovec) != struct.calcsize("@PN"):
            raise RuntimeError("struct iovec is not {void *, size_t} here")

    @staticmethod
    def _array_address(iov: Any, n: int) -> int:
        if ctypes.c_size_t.from_address(id(iov) + _LEN_AT).value != n:
            raise RuntimeError("liburing.Iovec has an unknown memory layout")
        ptr = ctypes.c_void_p.from_address(id(iov) + _PTR_AT).value
        if not ptr:
            raise RuntimeError("liburing.Iovec has an unknown memory layout")
        return int(ptr)

    def _make(self, n: int) -> _Pooled:
        iov = L.Iovec([_PLACEHOLDER] * n)
        raw = (ctypes.c_ubyte * ctypes.sizeof(_CIovec * n)).from_address(
            self._array_address(iov, n)
        )
        self._packers.setdefault(n, struct.Struct("@" + "PN" * n))
        return iov, raw, n

    def take(self, views: list[memoryview]) -> _Pooled:
        n = len(views)
        free = self._free.get(n)
        item = free.pop() if free else self._make(n)
        if n == 1:
            v = views[0]
            self._packers[1].pack_into(item[1], 0, buffer_address(v), v.nbytes)
        else:
            fields: list[int] = []
            for v in views:
                fields += (buffer_address(v), v.nbytes)
            # One pack_into per request instead of two ctypes attribute sets
            # per buffer: this is on every request's path.
            self._packers[n].pack_into(item[1], 0, *fields)
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
    completion: Completion[Any]
    # The pooled Iovec in the kernel's hands; ``views`` keep the caller's buffers
    # exported (they cannot be unmapped) until the completion is reaped.
    iov: _Pooled | None = field(default=None)


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
        self._ring = L.Ring()
        entries = 1 << max(1, (queue_depth - 1).bit_length())
        L.io_uring_queue_init(entries, self._ring)
        self._cqe = L.Cqe()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            L.io_uring_register_eventfd(self._ring, self._efd)
        except BaseException:
            os.close(self._efd)
            L.io_uring_queue_exit(self._ring)
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

    def _submit_fsync(self, fd: int) -> Completion[None]:
        done: Completion[None] = Completion(self._loop)
        self._enqueue(_Op(_FSYNC, fd, 0, [], done))
        return done

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            while self._queue:
                op = self._queue.popleft()
                op.completion.set_exception(ClosedError("the io_uring engine was closed"))
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
        while queue and len(ops) < self._depth:
            sqe = L.io_uring_get_sqe(ring)
            if sqe is None:
                break
            op = queue.popleft()
            ident = self._next_id
            self._next_id += 1
            if op.kind == _FSYNC:
                L.io_uring_prep_fsync(sqe, op.fd)
            else:
                op.iov = item = self._iovecs.take(op.views)
                if op.kind == _READ:
                    L.io_uring_prep_readv(sqe, op.fd, item[0], op.offset)
                else:
                    L.io_uring_prep_writev(sqe, op.fd, item[0], op.offset)
            L.io_uring_sqe_set_data64(sqe, ident)
            ops[ident] = op
            prepared += 1
        if not prepared:
            return
        self._submit(prepared)

    def _submit(self, prepared: int) -> None:
        try:
            L.io_uring_submit(self._ring)
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

    def _on_eventfd(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        ring = self._ring
        cqe = self._cqe
        ops = self._ops
        reaped = 0
        while L.io_uring_cq_ready(ring):
            L.io_uring_peek_cqe(ring, cqe)
            entry = cqe[0]
            if entry is None:
                break
            err = 0
            res = 0
            try:
                ident = entry.user_data
                try:
                    res = entry.res or 0
                except OSError as exc:
                    err = exc.errno or _errno.EIO
            finally:
                L.io_uring_cqe_seen(ring, entry)
            reaped += 1
            op = ops.pop(ident, None)
            if op is None:
                continue
            self._complete(op, res, err)
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
            op.completion.set_exception(
                TierIOError(
                    err,
                    f"{_KIND[op.kind]} of {nbytes} bytes at offset {op.offset} "
                    f"on fd {op.fd} failed: {os.strerror(err)}",
                )
            )
            return
        if op.kind == _READ:
            self._bytes_read += res
            op.completion.set_result(res)
        elif op.kind == _WRITE:
            self._bytes_written += res
            op.completion.set_result(res)
        else:
            op.completion.set_result(None)

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        # RuntimeError: the loop is already closed, nothing watches the fd any more.
        with contextlib.suppress(RuntimeError):
            self._loop.remove_reader(self._efd)
        try:
            L.io_uring_unregister_eventfd(self._ring)
        finally:
            L.io_uring_queue_exit(self._ring)
            os.close(self._efd)

    def _occupancy(self) -> tuple[int, int]:
        return len(self._ops), len(self._queue)
