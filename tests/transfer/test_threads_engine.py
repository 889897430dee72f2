"""The thread engine's own machinery: outcomes coalesced per drain, errors, closing, real I/O.

What every engine must do is checked by the conformance suite
(``tests/transfer/test_io_engines.py``) and the submit / submit_many tests; these
look at what only the thread pool has: workers that go on taking queued
requests while the loop is busy, outcomes handed back in bursts, and
threads that exit on close.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import time
from pathlib import Path

import pytest

from kvtier.errors import ClosedError, TierIOError
from kvtier.testing.io_engine import PAGE, BatchOutcomes, aligned_buffer
from kvtier.transfer._io_base import Then
from kvtier.transfer.completion import Completion
from kvtier.transfer.threads import ThreadEngine


def _direct_fd(tmp_path: Path, name: str = "f") -> int:
    try:
        return os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: {exc}")


def _hold_loop_until_finished(engine: ThreadEngine, count: int) -> None:
    """Block the loop thread until the workers have finished ``count`` requests.

    A busy serving loop does this: the workers go on taking queued requests
    without it, and their outcomes wait for its next turn. Polls the
    engine's outcome queue (white box: what the loop has not drained yet).
    """
    deadline = time.monotonic() + 30
    while len(engine._done) < count:
        assert time.monotonic() < deadline, "the workers did not finish"
        time.sleep(0.001)  # blocking the loop is the point


async def _engine(depth: int) -> ThreadEngine:
    return ThreadEngine(queue_depth=depth)


async def test_outcomes_finished_together_are_reported_in_one_call(tmp_path: Path) -> None:
    engine = await _engine(8)
    fd = _direct_fd(tmp_path)
    n = 64  # eight times the depth: the workers take the queued ones themselves
    mem = aligned_buffer(n * PAGE)
    mem[:] = os.urandom(n * PAGE)
    src = memoryview(mem)
    try:
        requests = [[src[i * PAGE : (i + 1) * PAGE]] for i in range(n)]
        wrote = BatchOutcomes()
        engine.submit_many(
            False, fd, requests, [i * PAGE for i in range(n)], wrote.then, alignment=PAGE
        )
        _hold_loop_until_finished(engine, n)
        await wrote.settle(n)
        # One wake-up of the loop, one drain, one call: not one per request.
        assert wrote.calls == 1
        assert wrote.reported == {i: (PAGE, None) for i in range(n)}

        # Reads through completions, coalesced the same way, each with its own bytes.
        out = aligned_buffer(n * PAGE)
        dst = memoryview(out)
        reads: list[Completion[int]] = [
            engine.readv(fd, [dst[i * PAGE : (i + 1) * PAGE]], i * PAGE) for i in range(n)
        ]
        _hold_loop_until_finished(engine, n)
        assert await asyncio.gather(*reads) == [PAGE] * n
        assert out[:] == mem[:]
        stats = engine.statistics()
        assert stats.submitted == stats.completed == 2 * n
        assert stats.bytes_written == stats.bytes_read == n * PAGE
        assert stats.in_flight == stats.queued == stats.failed == 0
        assert stats.max_in_flight <= 8
        assert len(engine._threads) <= 8
        # Nothing of the caller's is still exported once all is reported.
        del requests, reads
        dst.release()
        src.release()
        out.close()
        mem.close()  # BufferError while an export is alive
    finally:
        await engine.aclose()
        os.close(fd)


async def test_failed_and_short_requests_are_counts_and_typed_errors(tmp_path: Path) -> None:
    engine = await _engine(4)
    fd = _direct_fd(tmp_path)
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT, 0o600)
    buf = memoryview(aligned_buffer(8 * PAGE))
    try:
        # Three pages in the file; reads of two pages each, past its end.
        wrote = BatchOutcomes()
        engine.submit_many(False, fd, [[buf[: 3 * PAGE]]], [0], wrote.then, alignment=PAGE)
        await wrote.settle(1)
        read = BatchOutcomes()
        pieces = [[buf[i * 2 * PAGE : (i + 1) * 2 * PAGE]] for i in range(4)]
        engine.submit_many(
            True, fd, pieces, [i * 2 * PAGE for i in range(4)], read.then, alignment=PAGE
        )
        await read.settle(4)
        assert read.reported == {0: (2 * PAGE, None), 1: (PAGE, None), 2: (0, None), 3: (0, None)}
        assert engine.statistics().bytes_read == 3 * PAGE

        # Writes to a read-only descriptor: EBADF each, with what failed in the text.
        failed = BatchOutcomes()
        engine.submit_many(
            False,
            ro,
            [[buf[:PAGE]], [buf[PAGE : 3 * PAGE]]],
            [0, 4 * PAGE],
            failed.then,
            alignment=1,
        )
        await failed.settle(2)
        for i, (nbytes, exc) in failed.reported.items():
            assert nbytes == 0
            assert isinstance(exc, TierIOError)
            assert exc.errno == errno.EBADF
            size, offset = ((PAGE, 0), (2 * PAGE, 4 * PAGE))[i]
            assert f"writev of {size} bytes at offset {offset} on fd {ro} failed" in str(exc)
        assert engine.statistics().failed == 2

        # A request Python itself refuses (an offset past off_t) fails alone, as
        # an internal error: the worker thread survives it and serves the next.
        with pytest.raises(TierIOError) as info:
            await engine.writev(ro, [buf[:PAGE]], 1 << 64, alignment=1)
        assert info.value.errno == errno.EIO
        assert isinstance(info.value.__cause__, OverflowError)
        assert await engine.readv(fd, [buf[:PAGE]], 0) == PAGE
        await engine.fsync(fd)
        with pytest.raises(TierIOError) as info:
            await engine.fsync(1 << 20)  # above any descriptor in use
        assert info.value.errno == errno.EBADF
    finally:
        await engine.aclose()
        os.close(fd)
        os.close(ro)


async def test_closing_with_requests_queued_and_in_flight(tmp_path: Path) -> None:
    engine = await _engine(2)
    fd = _direct_fd(tmp_path)
    mem = aligned_buffer(64 * 16 * PAGE)
    view = memoryview(mem)
    requests = [[view[i * 16 * PAGE : (i + 1) * 16 * PAGE]] for i in range(64)]
    batch = BatchOutcomes()
    engine.submit_many(
        False, fd, requests, [i * 16 * PAGE for i in range(64)], batch.then, alignment=PAGE
    )
    single = [engine.writev(fd, [view[:PAGE]], i * PAGE) for i in range(8)]
    await asyncio.sleep(0)
    await engine.aclose()
    # Every request was reported once, before aclose returned: it ran, or
    # failed as closed; nothing ran after the close began.
    assert len(batch.reported) == 64
    assert all(c.done() for c in single)
    outcomes = list(batch.reported.values())
    outcomes += [(0, c.exception()) if c.exception() else (c.result(), None) for c in single]
    ran = [o for o in outcomes if o[1] is None]
    assert all(nbytes in (16 * PAGE, PAGE) for nbytes, _ in ran)
    closed = [exc for _, exc in outcomes if exc is not None]
    assert closed, "with 72 requests on 2 threads, some were still queued"
    assert all(isinstance(exc, ClosedError) for exc in closed)
    stats = engine.statistics()
    assert stats.in_flight == stats.queued == 0
    assert stats.completed == len(ran)
    # The workers exit; none holds the caller's memory any more.
    for t in engine._threads:
        await asyncio.to_thread(t.join, 30)
        assert not t.is_alive()
    del requests, single, outcomes, ran
    view.release()
    mem.close()
    os.close(fd)
    with pytest.raises(ClosedError):
        engine.readv(fd, [memoryview(aligned_buffer(PAGE))], 0)


async def test_a_raising_callback_strands_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await _engine(4)
    fd = _direct_fd(tmp_path)
    buf = memoryview(aligned_buffer(32 * PAGE))
    try:
        broken = BatchOutcomes(fail=True)
        with caplog.at_level(logging.ERROR, logger="kvtier.io"):
            engine.submit_many(
                False,
                fd,
                [[buf[i * PAGE : (i + 1) * PAGE]] for i in range(32)],
                [i * PAGE for i in range(32)],
                broken.then,
                alignment=PAGE,
            )
            outcomes: dict[int, int] = {}

            def one(i: int) -> Then:
                def then(nbytes: int, exc: BaseException | None) -> None:
                    outcomes[i] = nbytes
                    raise RuntimeError("a bug in a callback")

                return then

            for i in range(4):
                engine.submit(True, fd, [buf[i * PAGE : (i + 1) * PAGE]], i * PAGE, one(i))
            # Finished together, drained together: each raising callback is
            # logged and the others in the same drain still run.
            _hold_loop_until_finished(engine, 36)
            await broken.settle(32)
            await asyncio.sleep(0)
        assert broken.reported == {i: (PAGE, None) for i in range(32)}
        assert outcomes == dict.fromkeys(range(4), PAGE)
        failures = [r for r in caplog.records if "callback failed" in r.getMessage()]
        assert len(failures) == broken.calls + 4
        # And the engine goes on.
        assert await engine.readv(fd, [buf[:PAGE]], 0) == PAGE
    finally:
        await engine.aclose()
        os.close(fd)


@pytest.mark.parametrize("depth", [1, 2, 3, 8], ids=lambda d: f"depth{d}")
async def test_every_outcome_arrives_whatever_the_mix(tmp_path: Path, depth: int) -> None:
    # An outcome left unannounced while requests are queued must still be
    # reported: by the burst, or by the worker that takes the last job. Mixed
    # batch sizes, lone requests and fsyncs, each round awaited with a
    # deadline, so that a lost wake-up fails here instead of hanging.
    engine = await _engine(depth)
    fd = _direct_fd(tmp_path)
    buf = memoryview(aligned_buffer(32 * PAGE))
    rng = random.Random(depth)
    try:
        for _ in range(60):
            size = rng.randint(1, 24)
            batch = BatchOutcomes()
            engine.submit_many(
                rng.random() < 0.5,
                fd,
                [[buf[(i % 32) * PAGE : (i % 32 + 1) * PAGE]] for i in range(size)],
                [i * PAGE for i in range(size)],
                batch.then,
                alignment=PAGE,
            )
            lone = [
                engine.writev(fd, [buf[:PAGE]], (size + i) * PAGE) for i in range(rng.randint(0, 3))
            ]
            synced = engine.fsync(fd) if rng.random() < 0.3 else None
            await batch.settle(size)
            async with asyncio.timeout(30):
                assert await asyncio.gather(*lone) == [PAGE] * len(lone)
                if synced is not None:
                    await synced
            assert len(batch.reported) == size
            assert all(exc is None for _, exc in batch.reported.values())
        stats = engine.statistics()
        assert stats.submitted == stats.completed
        assert stats.in_flight == stats.queued == stats.failed == 0
    finally:
        await engine.aclose()
        os.close(fd)
