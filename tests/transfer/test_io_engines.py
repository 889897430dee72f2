"""Both I/O engines run the same conformance suite."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

import pytest

from kvtier.errors import AlignmentError, InvalidArgumentError, TierIOError
from kvtier.testing.io_engine import PAGE, FaultyEngine, IOEngineSuite, aligned_buffer
from kvtier.transfer.io_engine import open_io_engine, probe_io_uring

_NO_URING = probe_io_uring()


@pytest.mark.skipif(_NO_URING is not None, reason=f"io_uring unavailable: {_NO_URING}")
class TestUringEngine(IOEngineSuite):
    kind = "io_uring"


class TestThreadEngine(IOEngineSuite):
    kind = "threads"


async def test_auto_picks_io_uring_where_it_works() -> None:
    eng = await open_io_engine("auto")
    try:
        assert eng.name == ("io_uring" if _NO_URING is None else "threads")
        assert eng.queue_depth == 32
    finally:
        await eng.aclose()


async def test_io_uring_by_name_fails_clearly_where_unavailable() -> None:
    if _NO_URING is None:
        pytest.skip("io_uring works here: the unavailable path cannot be reached")
    with pytest.raises(TierIOError, match="io_uring is unavailable"):
        await open_io_engine("io_uring")


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "import os, signal; os.kill(os.getpid(), signal.SIGILL)",
            "killed by SIGILL",
        ),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed by SIGSEGV"),
        ("raise SystemExit(3)", "probe process failed"),
        ("import sys; sys.stdout.write('kernel io_uring lacks X')", "kernel io_uring lacks X"),
        ("import sys; sys.stdout.write('ok')", None),
    ],
    ids=["sigill", "sigsegv", "exit-code", "reason", "ok"],
)
def test_probe_survives_a_child_that_dies(
    monkeypatch: pytest.MonkeyPatch, script: str, expected: str | None
) -> None:
    """The probe runs io_uring in a real child process: its death is a reason, not ours."""
    from kvtier.transfer import io_engine

    monkeypatch.setattr(io_engine, "_CHILD_PROBE", script)
    reason = io_engine._probe_child()
    if expected is None:
        assert reason is None
    else:
        assert reason is not None
        assert expected in reason


@pytest.mark.parametrize("depth", [0, 5000], ids=["zero", "too-deep"])
async def test_queue_depth_range(depth: int) -> None:
    with pytest.raises(InvalidArgumentError):
        await open_io_engine("threads", queue_depth=depth)


async def test_faulty_engine_injects_real_failures(tmp_path: Path) -> None:
    eng = FaultyEngine(await open_io_engine("threads", queue_depth=2))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        buf = aligned_buffer(2 * PAGE)
        eng.inject("write", err=errno.ENOSPC)
        eng.inject("write", short_by=PAGE)
        with pytest.raises(TierIOError) as info:
            await eng.writev(fd, [memoryview(buf)], 0)
        assert info.value.errno == errno.ENOSPC
        assert await eng.writev(fd, [memoryview(buf)], 0) == PAGE
        assert await eng.writev(fd, [memoryview(buf)], 0) == 2 * PAGE
        with pytest.raises(AlignmentError):
            eng.readv(fd, [memoryview(buf)[1:]], 0)
    finally:
        await eng.aclose()
        os.close(fd)


@pytest.mark.skipif(_NO_URING is not None, reason=f"io_uring unavailable: {_NO_URING}")
async def test_reads_done_while_the_loop_computes_are_delivered_after(tmp_path: Path) -> None:
    """With a cooperative ring nothing interrupts the loop's thread for a completion:
    reads that finish while it runs Python without system calls are posted, and
    their eventfd signalled, when it is back in the kernel."""
    eng = await open_io_engine("io_uring", queue_depth=8)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        data = aligned_buffer(8 * PAGE)
        data[:] = bytes(range(256)) * (8 * PAGE // 256)
        assert await eng.writev(fd, [memoryview(data)], 0) == 8 * PAGE
        rows = [aligned_buffer(PAGE) for _ in range(8)]
        reads = [eng.readv(fd, [memoryview(r)], i * PAGE) for i, r in enumerate(rows)]
        await asyncio.sleep(0)  # submitted at the end of that turn of the loop
        # 50 ms of Python without a system call (the clock is read in the vDSO).
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:
            pass
        assert await asyncio.wait_for(asyncio.gather(*reads), 10) == [PAGE] * 8
        for i, r in enumerate(rows):
            assert r[:] == data[i * PAGE : (i + 1) * PAGE]
    finally:
        await eng.aclose()
        os.close(fd)
