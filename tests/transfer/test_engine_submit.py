"""IOEngine.submit: a request whose outcome goes to a callback, on both engines, real I/O."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from kvtier.errors import ClosedError, TierIOError
from kvtier.testing.io_engine import PAGE, aligned_buffer
from kvtier.transfer._io_base import Then
from kvtier.transfer.io_engine import IOEngine, open_io_engine, probe_io_uring

_NO_URING = probe_io_uring()

ENGINES = [
    pytest.param(
        "io_uring", marks=pytest.mark.skipif(_NO_URING is not None, reason=f"{_NO_URING}")
    ),
    "threads",
]


class Outcomes(dict[int, tuple[int, BaseException | None]]):
    """What each request's callback was given, by request number."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def record(self, i: int) -> Then:
        def then(nbytes: int, exc: BaseException | None) -> None:
            assert i not in self, "a callback ran twice"
            self[i] = (nbytes, exc)
            self.changed.set()

        return then

    async def settle(self, count: int) -> None:
        async with asyncio.timeout(30):
            while len(self) < count:
                self.changed.clear()
                await self.changed.wait()


@pytest.mark.parametrize("kind", ENGINES)
async def test_submit_writes_and_reads_through_callbacks(kind: str, tmp_path: Path) -> None:
    engine: IOEngine = await open_io_engine(kind, queue_depth=4)  # type: ignore[arg-type]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    src, dst = memoryview(aligned_buffer(8 * PAGE)), memoryview(aligned_buffer(8 * PAGE))
    try:
        src[:] = os.urandom(8 * PAGE)
        wrote = Outcomes()
        for i in range(8):  # more than the depth: the rest queue
            piece = src[i * PAGE : (i + 1) * PAGE]
            engine.submit(False, fd, [piece], i * PAGE, wrote.record(i))
        await wrote.settle(8)
        assert wrote == {i: (PAGE, None) for i in range(8)}
        read = Outcomes()
        halves = [dst[: 3 * PAGE], dst[3 * PAGE :]]
        engine.submit(True, fd, halves, 0, read.record(0))
        # Past the end of the file: a short read is a count, not an error.
        engine.submit(True, fd, [memoryview(aligned_buffer(PAGE))], 8 * PAGE, read.record(1))
        await read.settle(2)
        assert read == {0: (8 * PAGE, None), 1: (0, None)}
        assert bytes(dst) == bytes(src)
        assert engine.statistics().bytes_written == 8 * PAGE
    finally:
        await engine.aclose()
        os.close(fd)


@pytest.mark.parametrize("kind", ENGINES)
async def test_a_failed_request_and_a_failing_callback(kind: str, tmp_path: Path) -> None:
    engine: IOEngine = await open_io_engine(kind, queue_depth=4)  # type: ignore[arg-type]
    fd = os.open(tmp_path / "f", os.O_RDONLY | os.O_CREAT, 0o600)
    buf = memoryview(aligned_buffer(2 * PAGE))
    outcomes = Outcomes()

    def broken(nbytes: int, exc: BaseException | None) -> None:
        outcomes[0] = (nbytes, exc)
        outcomes.changed.set()
        raise RuntimeError("a bug in a callback")

    try:
        # A write to a read-only descriptor fails with EBADF in the kernel (or the thread).
        engine.submit(False, fd, [buf[:PAGE]], 0, broken)
        engine.submit(False, fd, [buf[PAGE:]], PAGE, outcomes.record(1))
        await outcomes.settle(2)
        for i in (0, 1):
            nbytes, exc = outcomes[i]
            assert nbytes == 0
            assert isinstance(exc, TierIOError)
            assert exc.errno == errno.EBADF
        # The failing callback broke nothing: the engine serves the next request.
        engine.submit(True, fd, [buf[:PAGE]], 0, outcomes.record(2))
        await outcomes.settle(3)
        assert outcomes[2] == (0, None)
    finally:
        await engine.aclose()
        os.close(fd)
    with pytest.raises(ClosedError):
        engine.submit(True, fd, [buf[:PAGE]], 0, outcomes.record(3))
