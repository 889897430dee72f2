"""The contract every I/O engine implements, and what the engines and their callers share.

:class:`IOEngine` (vectored reads and writes at file offsets, completed
asynchronously), its statistics, the buffer address helper and the alignment
check. A module of its own, below the engines (:mod:`kvtier.transfer.uring`,
:mod:`kvtier.transfer.threads`) and the factory that picks one
(:mod:`kvtier.transfer.io_engine`, where callers import these names from), so
that no module imports one that imports it back.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import fcntl
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.errors import AlignmentError, ClosedError, InvalidArgumentError
from kvtier.transfer.completion import Completion

__all__ = [
    "DEFAULT_DIRECT_ALIGNMENT",
    "IOV_MAX",
    "IOEngine",
    "IOEngineStatistics",
    "Then",
    "ThenMany",
    "buffer_address",
]

log = logging.getLogger("kvtier.io")

Then = Callable[[int, BaseException | None], None]
"""What :meth:`IOEngine.submit` calls on the loop: ``(bytes moved, None)`` or ``(0, error)``."""

ThenMany = Callable[[list[tuple[int, int, BaseException | None]]], None]
"""What :meth:`IOEngine.submit_many` calls on the loop: ``[(request index, bytes, error)]``."""

try:
    # A batch's checks in one call (see IOEngine.submit_many). The compiled
    # module is imported whole, never a name from it: grimp reads .py files
    # only (tests/test_architecture.py says more).
    from kvtier.transfer import _address

    _check_rw_c = _address.check_rw
except ImportError:  # not built
    _check_rw_c = None  # type: ignore[assignment]

DEFAULT_DIRECT_ALIGNMENT = 4096
"""Alignment checked for an O_DIRECT descriptor when the caller names none.

4096 covers every logical block size Linux filesystems use for direct I/O
(512 or 4096); asking more than the device needs refuses nothing a caller
that follows the CPU region's page alignment would pass.
"""

IOV_MAX = 1024
"""Most buffers one vectored request may carry (Linux ``UIO_MAXIOV``)."""


@dataclass(frozen=True, slots=True)
class IOEngineStatistics:
    """Counters of one I/O engine since it was opened."""

    name: str
    """``"io_uring"`` or ``"threads"``."""
    queue_depth: int
    """Most requests in the kernel (or in worker threads) at once."""
    submitted: int
    """Requests handed to the kernel or to a worker thread."""
    completed: int
    """Requests finished, successfully or not."""
    failed: int
    """Requests that finished with an error."""
    in_flight: int
    """Requests handed over and not finished."""
    queued: int
    """Requests waiting for room under ``queue_depth``."""
    max_in_flight: int
    """Highest ``in_flight`` seen; never above ``queue_depth``."""
    submit_calls: int
    """System calls (io_uring) or pool hand-offs (threads) that submitted them."""
    bytes_read: int
    """Bytes reported read by completed reads."""
    bytes_written: int
    """Bytes reported written by completed writes."""
    registered_bytes: int = 0
    """Memory registered with the kernel for transfers that pin no pages per
    request (:meth:`IOEngine.register_memory`); 0 when none is."""
    fixed_requests: int = 0
    """Requests that went from registered memory (io_uring fixed buffers)."""


def _buffer_address_py(buf: memoryview) -> int:
    """:func:`buffer_address` without the compiled helper."""
    if not buf.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    # ctypes refuses read-only exports; numpy reads the address without copying.
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


try:
    # One buffer export in C: 0.05 us against 0.9 (ctypes) or 3.9 (NumPy, read-only).
    from kvtier.transfer import _address

    _buffer_address_c = _address.address
except ImportError:  # not built (no C compiler at install)
    _buffer_address_c = None  # type: ignore[assignment]


def buffer_address(buf: memoryview) -> int:
    """Start address of a contiguous buffer (read-only ones included)."""
    if _buffer_address_c is not None:
        return _buffer_address_c(buf)
    return _buffer_address_py(buf)


def _as_bytes_view(buf: memoryview) -> memoryview:
    if buf.ndim == 1 and buf.format in ("B", "b", "c") and buf.c_contiguous:
        return buf
    if not buf.c_contiguous:
        raise InvalidArgumentError("I/O buffers must be C-contiguous")
    return buf.cast("B")


class IOEngine(abc.ABC):
    """Vectored reads and writes at file offsets, completed asynchronously.

    Requests are accepted at any rate; at most :attr:`queue_depth` are in the
    kernel (or in worker threads) at once and the rest wait in submission
    order. Every method that starts I/O returns a
    :class:`~kvtier.transfer.completion.Completion` straight away.

    Notes
    -----
    **Alignment.** For a descriptor opened with ``O_DIRECT``, every buffer's
    address and length and the file offset must be multiples of the device's
    logical block size. A request that breaks this raises
    :class:`~kvtier.errors.AlignmentError` (with the address, length and
    alignment) before anything is submitted, never a bare ``EINVAL`` from the
    kernel. Pass ``alignment=`` to state the rule; with ``alignment=None`` the
    engine reads the descriptor's flags and checks
    :data:`DEFAULT_DIRECT_ALIGNMENT` when ``O_DIRECT`` is set.

    **Buffers and cancellation.** The kernel (or a worker thread) reads or
    writes the buffers until the completion is done. The engine keeps a
    reference to them (an exported buffer, so an ``mmap`` cannot be closed
    under it) until then. Cancelling a task that awaits a completion does not
    cancel the I/O: the caller must not reuse or release the buffers before
    :meth:`Completion.done` is true; release them from
    :meth:`Completion.add_done_callback`.

    **Errors.** A failed request resolves its completion with
    :class:`~kvtier.errors.TierIOError` carrying the errno (the path is not
    known here; the file tier re-raises with it). A short transfer is not an
    error at this level: the completion's result is the byte count, as with
    ``preadv(2)``.
    """

    # -- capabilities -------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """``"io_uring"`` or ``"threads"``."""

    @property
    def queue_depth(self) -> int:
        """Most requests in flight at once; more are queued, not refused."""
        return self._depth

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""
        return self._closed

    def __init__(self, *, queue_depth: int) -> None:
        self._depth = queue_depth
        self._closed = False
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._max_in_flight = 0
        self._submit_calls = 0
        self._bytes_read = 0
        self._bytes_written = 0

    def statistics(self) -> IOEngineStatistics:
        """Counters since the engine was opened."""
        in_flight, queued = self._occupancy()
        return IOEngineStatistics(
            name=self.name,
            queue_depth=self._depth,
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            in_flight=in_flight,
            queued=queued,
            max_in_flight=self._max_in_flight,
            submit_calls=self._submit_calls,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            registered_bytes=self._registered_bytes(),
            fixed_requests=self._fixed_requests(),
        )

    def _registered_bytes(self) -> int:
        return 0

    def _fixed_requests(self) -> int:
        return 0

    # -- registered memory --------------------------------------------------------------

    def register_memory(self, owner: object, buffers: Sequence[object]) -> int:
        """Register ``buffers`` with the kernel for transfers that pin no pages per request.

        A request whose buffers all lie in registered memory skips the kernel's
        per-request page pinning (io_uring's fixed buffers): at 2 MiB per
        request fio reads with about a quarter of the CPU. Buffers are grouped
        by ``owner``; a later call for the same owner replaces its buffers.

        Parameters
        ----------
        owner
            Who registers (compared by identity), for :meth:`unregister_memory`.
        buffers
            C-contiguous buffers (a CPU region, page-aligned header pages);
            each stays exported, so it cannot be unmapped, until unregistered.

        Returns
        -------
        int
            Bytes registered for ``owner``: 0 where the engine has no such
            transfers (the thread pool), or the kernel refused (``RLIMIT_MEMLOCK``
            too low, memory it will not pin); the I/O then goes as before.
        """
        self._check_open()
        return 0

    def unregister_memory(self, owner: object) -> None:
        """Drop ``owner``'s registered buffers (a no-op when it has none).

        Requests in flight keep the pages they use until they finish.
        """
        return None

    @abc.abstractmethod
    def _occupancy(self) -> tuple[int, int]:
        """Requests ``(in flight, queued)`` now."""

    # -- I/O ----------------------------------------------------------------------------

    def readv(
        self,
        fd: int,
        buffers: Sequence[memoryview],
        offset: int,
        *,
        alignment: int | None = None,
    ) -> Completion[int]:
        """Read from ``fd`` at ``offset`` into ``buffers``, filling them in order.

        Parameters
        ----------
        fd
            An open file descriptor, readable.
        buffers
            Writable, C-contiguous buffers (at most :data:`IOV_MAX`).
        offset
            File offset in bytes.
        alignment
            Alignment to enforce (see Notes of :class:`IOEngine`); ``None``
            detects ``O_DIRECT``; ``1`` checks nothing.

        Returns
        -------
        Completion[int]
            Resolves to the bytes read (fewer than requested at end of file).

        Raises
        ------
        AlignmentError
            Before submission, for a buffer or offset breaking the alignment.
        InvalidArgumentError
            For no buffers, too many, or a read-only one.
        ClosedError
            When the engine is closed.
        """
        self._check_open()
        views = self._prepare(fd, buffers, offset, alignment, for_read=True)
        return self._submit_rw(True, fd, views, offset)

    def writev(
        self,
        fd: int,
        buffers: Sequence[memoryview],
        offset: int,
        *,
        alignment: int | None = None,
    ) -> Completion[int]:
        """Write ``buffers`` back to back to ``fd`` at ``offset``.

        Parameters and errors are those of :meth:`readv` (read-only buffers are
        allowed). The completion resolves to the bytes written; a count below
        the total is a short write that the caller must treat as a failure
        or continue.
        """
        self._check_open()
        views = self._prepare(fd, buffers, offset, alignment, for_read=False)
        return self._submit_rw(False, fd, views, offset)

    @abc.abstractmethod
    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        """Queue one validated vectored read or write."""

    def submit(
        self,
        read: bool,
        fd: int,
        buffers: Sequence[memoryview],
        offset: int,
        then: Then,
        *,
        alignment: int | None = None,
    ) -> None:
        """:meth:`readv` (``read``) or :meth:`writev` that calls ``then`` instead of a Completion.

        Parameters
        ----------
        read, fd, buffers, offset, alignment
            The request, as :meth:`readv` and :meth:`writev` take it.
        then
            Called once on the loop when the request is done: ``then(bytes, None)``
            (a short transfer included), or ``then(0, error)`` with the
            :class:`~kvtier.errors.TierIOError` (or
            :class:`~kvtier.errors.ClosedError`) a completion would carry.

        Raises
        ------
        AlignmentError, InvalidArgumentError, ClosedError
            As :meth:`readv`, before anything is submitted (``then`` is not called).

        Notes
        -----
        For callers that move many blocks: the io_uring engine calls ``then``
        straight from its reaping loop, without the future, the callback
        handle and the loop iteration that each completion costs (a
        measurable part of the CPU per block at 64 KiB). An exception raised
        by ``then`` is logged and does not stop the other requests' callbacks.
        Buffers stay exported until ``then`` is called, as with a completion.
        """
        self._check_open()
        views = self._prepare(fd, buffers, offset, alignment, for_read=read)
        self._submit_then(read, fd, views, offset, then)

    def _submit_then(
        self, read: bool, fd: int, views: list[memoryview], offset: int, then: Then
    ) -> None:
        """Queue one validated request whose outcome goes to ``then`` (via a completion here)."""
        done = self._submit_rw(read, fd, views, offset)
        done.add_done_callback(
            lambda c: call_then(then, c.result() if c.exception() is None else 0, c.exception())
        )

    def submit_many(
        self,
        read: bool,
        fd: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        then: ThenMany,
        *,
        alignment: int,
    ) -> None:
        """Many :meth:`submit` requests on one descriptor, reported together.

        Parameters
        ----------
        read, fd, alignment
            As :meth:`submit` (``alignment`` is required here: no descriptor
            flags are read per batch).
        requests
            One list of buffers per request; the engine keeps the lists (and so
            the buffers exported) until each request is reported. The caller
            must not change them meanwhile.
        offsets
            The file offset of each request.
        then
            Called on the loop, one or more times, with ``(index, bytes, error)``
            of requests done since the last call (``index`` into ``requests``):
            ``(index, bytes moved, None)`` or ``(index, 0, error)``, the error a
            :class:`~kvtier.errors.TierIOError` or
            :class:`~kvtier.errors.ClosedError`. Every request is reported once.

        Raises
        ------
        AlignmentError, InvalidArgumentError, ClosedError
            As :meth:`readv`, for any request, before any is submitted.

        Notes
        -----
        For callers that move many blocks at once: the io_uring engine checks
        the batch, writes its submission entries and reads its completions in
        one compiled call each, and calls ``then`` once per batch per reap,
        instead of a few microseconds of Python per request. The other engines
        submit each request on its own (a fault-injecting wrapper sees every
        one).
        """
        self._check_open()
        if len(offsets) != len(requests):
            raise InvalidArgumentError(f"{len(requests)} requests but {len(offsets)} offsets")
        if not requests:
            return
        bad = _check_rw_c(requests, offsets, alignment, read) if _check_rw_c is not None else 0
        if bad >= 0:
            # The failing request (or, without the compiled check, every one)
            # raises its own error; a batch the C check refused that passes
            # here would be a bug, so it is refused all the same.
            for views, offset in zip(requests[bad:], offsets[bad:], strict=True):
                self._prepare(fd, views, offset, alignment, for_read=read)
            if _check_rw_c is not None:
                raise InvalidArgumentError(f"request {bad} of the batch is malformed")
        self._submit_many(read, fd, requests, offsets, then)

    def _submit_many(
        self,
        read: bool,
        fd: int,
        requests: list[list[memoryview]],
        offsets: list[int],
        then: ThenMany,
    ) -> None:
        """Queue checked requests; here one :meth:`_submit_then` each (io_uring overrides).

        The outcomes that arrive in one loop iteration go to ``then`` together
        at its end: one call for the requests a thread pool finished meanwhile,
        not one each.
        """
        loop = asyncio.get_running_loop()
        ready: list[tuple[int, int, BaseException | None]] = []

        def report() -> None:
            done = ready[:]
            ready.clear()
            call_then_many(then, done)

        def one(i: int, nbytes: int, exc: BaseException | None) -> None:
            if not ready:
                loop.call_soon(report)
            ready.append((i, nbytes, exc))

        for i, (views, offset) in enumerate(zip(requests, offsets, strict=True)):
            views = [
                _as_bytes_view(v if isinstance(v, memoryview) else memoryview(v)) for v in views
            ]
            self._submit_then(read, fd, views, offset, functools.partial(one, i))

    @abc.abstractmethod
    def _submit_fsync(self, fd: int) -> Completion[None]:
        """Queue one fsync."""

    def fsync(self, fd: int) -> Completion[None]:
        """Flush ``fd``'s data and metadata to stable storage (``fsync(2)``)."""
        self._check_open()
        return self._submit_fsync(fd)

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop accepting requests and release the engine; idempotent.

        Notes
        -----
        Requests still waiting for room under the queue depth fail with
        :class:`~kvtier.errors.ClosedError`; requests already in the kernel or
        in a thread are waited for (they touch caller memory, which must not
        be released under them). Cancelling the caller of ``aclose`` does not
        interrupt that wait's effect: the engine still closes once they finish.
        """

    # -- shared helpers -----------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"the {self.name} I/O engine is closed")

    @staticmethod
    def check_aligned(buffers: Sequence[memoryview], offset: int, alignment: int) -> None:
        """Raise :class:`~kvtier.errors.AlignmentError` unless every buffer is aligned.

        Parameters
        ----------
        buffers
            The buffers of one request.
        offset
            The file offset of the request.
        alignment
            Required alignment of each buffer's address and length and of the
            offset; ``<= 1`` checks nothing.
        """
        if alignment <= 1:
            return
        mask = alignment - 1
        if offset & mask:
            # The offset is reported as a zero-length "buffer" at that address.
            raise AlignmentError(offset, 0, alignment)
        for buf in buffers:
            addr = buffer_address(buf)
            if addr & mask or buf.nbytes & mask:
                raise AlignmentError(addr, buf.nbytes, alignment)

    @staticmethod
    def _prepare(
        fd: int,
        buffers: Sequence[memoryview],
        offset: int,
        alignment: int | None,
        *,
        for_read: bool,
    ) -> list[memoryview]:
        """Validate a request; the list of 1-D byte views to submit."""
        if not buffers:
            raise InvalidArgumentError("an I/O request needs at least one buffer")
        if len(buffers) > IOV_MAX:
            raise InvalidArgumentError(f"{len(buffers)} buffers exceed IOV_MAX ({IOV_MAX})")
        if offset < 0:
            raise InvalidArgumentError(f"offset must be >= 0, got {offset}")
        views = [_as_bytes_view(b if isinstance(b, memoryview) else memoryview(b)) for b in buffers]
        if for_read:
            for v in views:
                if v.readonly:
                    raise InvalidArgumentError("cannot read into a read-only buffer")
        if alignment is None:
            try:
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            except OSError:
                # A bad descriptor fails in the request itself, with its errno.
                flags = 0
            alignment = DEFAULT_DIRECT_ALIGNMENT if flags & os.O_DIRECT else 1
        IOEngine.check_aligned(views, offset, alignment)
        return views


def call_then(then: Then, res: int, exc: BaseException | None) -> None:
    """Run a :meth:`IOEngine.submit` callback; its error is logged, never raised into the engine."""
    try:
        then(res, exc)
    except Exception:
        # Raised into the reaping loop it would strand the completions reaped
        # after it (their blocks in flight for ever, aclose waiting on them).
        log.exception("an I/O completion callback failed")


def call_then_many(then: ThenMany, done: list[tuple[int, int, BaseException | None]]) -> None:
    """Run a :meth:`IOEngine.submit_many` callback; its error is logged, never raised."""
    try:
        then(done)
    except Exception:
        log.exception("an I/O completion callback failed")
