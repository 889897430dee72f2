"""Conformance suite for :class:`~kvtier.transfer.io_engine.IOEngine`.

Subclass :class:`IOEngineSuite` once per engine and set :attr:`IOEngineSuite.kind`;
pytest collects every test for it::

    class TestUring(IOEngineSuite):
        kind = "io_uring"

The tests use real files opened with ``O_DIRECT`` under pytest's ``tmp_path``
and page-aligned buffers from anonymous ``mmap``. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
import pytest_asyncio

from kvtier.errors import AlignmentError, ClosedError, InvalidArgumentError, TierIOError
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine, open_io_engine

__all__ = [
    "BatchOutcomes",
    "FaultyEngine",
    "IOEngineSuite",
    "aligned_buffer",
    "cancel_one_awaiter",
]

PAGE = mmap.PAGESIZE


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous mapping of ``nbytes`` (what a CPU region row looks like)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


async def cancel_one_awaiter(done: Completion[Any]) -> None:
    """Start a task awaiting ``done``, cancel it, and check that it was cancelled.

    The work behind ``done`` must go on: callers then check that it completes.
    """

    async def waiter() -> object:
        return await done

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class BatchOutcomes:
    """A ``submit_many`` callback that keeps every ``(index, bytes, error)`` it is given.

    Parameters
    ----------
    fail
        Raise after recording each call (a caller's bug, which the engine
        must log without stranding other requests).
    """

    def __init__(self, *, fail: bool = False) -> None:
        self.reported: dict[int, tuple[int, BaseException | None]] = {}
        self.calls = 0
        self.fail = fail
        self.changed = asyncio.Event()

    def then(self, done: list[tuple[int, int, BaseException | None]]) -> None:
        """The callback: records ``done``, asserting no request is reported twice."""
        self.calls += 1
        for i, nbytes, exc in done:
            assert i not in self.reported, "a request was reported twice"
            self.reported[i] = (nbytes, exc)
        self.changed.set()
        if self.fail:
            raise RuntimeError("a bug in a batch callback")

    async def settle(self, count: int) -> None:
        """Wait until ``count`` requests are reported (at most 30 s)."""
        async with asyncio.timeout(30):
            while len(self.reported) < count:
                self.changed.clear()
                await self.changed.wait()


def _pattern(nbytes: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (nbytes // 256)


class IOEngineSuite:
    """Checks every :class:`IOEngine` must pass; subclass and set :attr:`kind`."""

    kind: ClassVar[Literal["io_uring", "threads"]]
    """Engine under test, as :func:`open_io_engine` names it."""
    queue_depth: ClassVar[int] = 4
    """Small, so that the queue-overflow tests queue requests."""

    @pytest_asyncio.fixture
    async def engine(self) -> AsyncIterator[IOEngine]:
        eng = await open_io_engine(self.kind, queue_depth=self.queue_depth)
        try:
            yield eng
        finally:
            await eng.aclose()

    @pytest.fixture
    def direct_fd(self, tmp_path: Path) -> Iterator[int]:
        path = tmp_path / "data.bin"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            pytest.skip(f"O_DIRECT refused on {tmp_path}: {exc}")
        try:
            yield fd
        finally:
            os.close(fd)

    # -- identity -----------------------------------------------------------------------

    async def test_name_and_depth(self, engine: IOEngine) -> None:
        assert engine.name == self.kind
        assert engine.queue_depth == self.queue_depth
        assert not engine.closed

    # -- data ---------------------------------------------------------------------------

    async def test_vectored_round_trip_direct(self, engine: IOEngine, direct_fd: int) -> None:
        src = aligned_buffer(4 * PAGE)
        src[:] = _pattern(4 * PAGE, 1)
        view = memoryview(src)
        wrote = await engine.writev(direct_fd, [view[:PAGE], view[PAGE:]], PAGE)
        assert wrote == 4 * PAGE
        dst = aligned_buffer(4 * PAGE)
        dview = memoryview(dst)
        got = await engine.readv(direct_fd, [dview[: 3 * PAGE], dview[3 * PAGE :]], PAGE)
        assert got == 4 * PAGE
        assert dst[:] == src[:]
        # The hole before the written range reads back as zeros.
        got = await engine.readv(direct_fd, [dview[:PAGE]], 0)
        assert got == PAGE
        assert dst[:PAGE] == bytes(PAGE)
        del view, dview

    async def test_buffers_are_released_when_the_request_is_done(
        self, engine: IOEngine, direct_fd: int
    ) -> None:
        # A caller may unmap its memory right after the await: the engine must
        # hold no export of it by then (a worker keeping its last job did).
        for write in (True, False):
            buf = aligned_buffer(2 * PAGE)
            view = memoryview(buf)
            call = engine.writev if write else engine.readv
            assert await call(direct_fd, [view[:PAGE], view[PAGE:]], 0) == 2 * PAGE
            view.release()
            buf.close()  # BufferError while an export is alive

    async def test_short_read_at_end_of_file(self, engine: IOEngine, direct_fd: int) -> None:
        buf = aligned_buffer(4 * PAGE)
        view = memoryview(buf)
        assert await engine.writev(direct_fd, [view[:PAGE]], 0) == PAGE
        assert await engine.readv(direct_fd, [view], 0) == PAGE
        assert await engine.readv(direct_fd, [view], 8 * PAGE) == 0
        del view

    async def test_many_requests_queue_beyond_depth(self, engine: IOEngine, direct_fd: int) -> None:
        n = self.queue_depth * 8
        buf = aligned_buffer(n * PAGE)
        for i in range(n):
            buf[i * PAGE : (i + 1) * PAGE] = bytes([i & 0xFF]) * PAGE
        view = memoryview(buf)
        writes = [
            engine.writev(direct_fd, [view[i * PAGE : (i + 1) * PAGE]], i * PAGE) for i in range(n)
        ]
        assert await asyncio.gather(*writes) == [PAGE] * n
        out = aligned_buffer(n * PAGE)
        oview = memoryview(out)
        reads = [
            engine.readv(direct_fd, [oview[i * PAGE : (i + 1) * PAGE]], i * PAGE) for i in range(n)
        ]
        assert await asyncio.gather(*reads) == [PAGE] * n
        assert out[:] == buf[:]
        stats = engine.statistics()
        assert stats.submitted == stats.completed == 2 * n
        assert stats.max_in_flight <= self.queue_depth
        assert stats.in_flight == stats.queued == stats.failed == 0
        assert stats.bytes_written == stats.bytes_read == n * PAGE
        del view, oview

    async def test_buffered_fd_needs_no_alignment(self, engine: IOEngine, tmp_path: Path) -> None:
        fd = os.open(tmp_path / "buffered.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            data = bytearray(b"kvtier" * 7)
            assert await engine.writev(fd, [memoryview(data)[1:], memoryview(b"!")], 3) == 42
            out = bytearray(42)
            assert await engine.readv(fd, [memoryview(out)], 3) == 42
            assert bytes(out) == bytes(data[1:]) + b"!"
        finally:
            os.close(fd)

    async def test_fsync(self, engine: IOEngine, direct_fd: int) -> None:
        buf = aligned_buffer(PAGE)
        await engine.writev(direct_fd, [memoryview(buf)], 0)
        await engine.fsync(direct_fd)
        assert engine.statistics().failed == 0

    # -- refusals -----------------------------------------------------------------------

    async def test_unaligned_buffer_refused_before_submission(
        self, engine: IOEngine, direct_fd: int
    ) -> None:
        buf = aligned_buffer(2 * PAGE)
        view = memoryview(buf)
        before = engine.statistics().submitted
        with pytest.raises(AlignmentError) as info:
            engine.readv(direct_fd, [view[1 : PAGE + 1]], 0)
        assert info.value.alignment == 4096
        assert info.value.length == PAGE
        assert info.value.address % 4096 == 1
        with pytest.raises(AlignmentError):
            engine.writev(direct_fd, [view[:100]], 0)  # length
        with pytest.raises(AlignmentError):
            engine.writev(direct_fd, [view[:PAGE]], 512)  # offset
        with pytest.raises(AlignmentError, match="multiples of 8192"):
            engine.writev(direct_fd, [view[:PAGE]], 0, alignment=8192)
        assert engine.statistics().submitted == before
        del view

    async def test_invalid_requests(self, engine: IOEngine, direct_fd: int) -> None:
        with pytest.raises(InvalidArgumentError):
            engine.readv(direct_fd, [], 0)
        with pytest.raises(InvalidArgumentError, match="read-only"):
            engine.readv(direct_fd, [memoryview(bytes(PAGE))], 0, alignment=1)
        buf = aligned_buffer(PAGE)
        with pytest.raises(InvalidArgumentError):
            engine.readv(direct_fd, [memoryview(buf)], -PAGE)

    async def test_kernel_error_is_typed(self, engine: IOEngine, tmp_path: Path) -> None:
        fd = os.open(tmp_path / "ro.bin", os.O_RDONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(TierIOError) as info:
                await engine.writev(fd, [memoryview(b"x")], 0)
            assert info.value.errno == errno.EBADF
        finally:
            os.close(fd)
        assert engine.statistics().failed == 1

    # -- cancellation and closing -------------------------------------------------------

    async def test_cancelled_awaiter_does_not_cancel_io(
        self, engine: IOEngine, direct_fd: int
    ) -> None:
        buf = aligned_buffer(16 * PAGE)
        buf[:] = _pattern(16 * PAGE, 5)
        done = engine.writev(direct_fd, [memoryview(buf)], 0)
        await cancel_one_awaiter(done)
        assert await done == 16 * PAGE
        out = aligned_buffer(16 * PAGE)
        assert await engine.readv(direct_fd, [memoryview(out)], 0) == 16 * PAGE
        assert out[:] == buf[:]

    async def test_aclose_waits_for_in_flight_and_is_idempotent(self, direct_fd: int) -> None:
        eng = await open_io_engine(self.kind, queue_depth=1)
        buf = aligned_buffer(8 * PAGE)
        view = memoryview(buf)
        first = eng.writev(direct_fd, [view], 0)
        queued = [eng.writev(direct_fd, [view], (i + 1) * 8 * PAGE) for i in range(3)]
        await asyncio.sleep(0)  # let the first request reach the kernel
        await eng.aclose()
        assert eng.closed
        assert first.done()
        assert all(c.done() for c in queued)
        # Requests still queued when closing either ran or failed as closed.
        for c in queued:
            if c.exception() is not None:
                assert isinstance(c.exception(), ClosedError)
        await eng.aclose()
        with pytest.raises(ClosedError):
            eng.readv(direct_fd, [view], 0)
        del view
        buf.close()  # no export left: the engine released every buffer


class FaultyEngine(IOEngine):
    """Wraps a real engine and makes chosen requests fail or come up short.

    Faults are queued with :meth:`inject` and consumed by the next matching
    requests. A failure completes the request with
    :class:`~kvtier.errors.TierIOError` without submitting it; a short
    transfer submits the real request minus its last ``short_by`` bytes, so
    the kernel really does move fewer bytes.
    """

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(queue_depth=inner.queue_depth)
        self._inner = inner
        self._faults: dict[bool, list[tuple[int, int]]] = {True: [], False: []}

    def inject(self, kind: Literal["read", "write"], *, err: int = 0, short_by: int = 0) -> None:
        """Make the next ``kind`` request fail with ``err``, or transfer ``short_by`` less."""
        self._faults[kind == "read"].append((err, short_by))

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        faults = self._faults[read]
        err, short_by = faults.pop(0) if faults else (0, 0)
        if err:
            done: Completion[int] = Completion()
            done.set_exception(TierIOError(err, f"injected {os.strerror(err)}"))
            return done
        if short_by:
            views = _trim(views, short_by)
        call = self._inner.readv if read else self._inner.writev
        return call(fd, views, offset, alignment=1)

    def _submit_fsync(self, fd: int) -> Completion[None]:
        return self._inner.fsync(fd)

    def _occupancy(self) -> tuple[int, int]:
        stats = self._inner.statistics()
        return stats.in_flight, stats.queued

    async def aclose(self) -> None:
        await self._inner.aclose()


def _trim(views: list[memoryview], nbytes: int) -> list[memoryview]:
    out = list(views)
    while nbytes and out:
        last = out.pop()
        if last.nbytes > nbytes:
            out.append(last[: last.nbytes - nbytes])
            break
        nbytes -= last.nbytes
    return out
