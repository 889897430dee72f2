"""Registered memory (io_uring fixed buffers): real I/O through it, its limits and refusals."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from kvtier.config import FileTierConfig
from kvtier.errors import IntegrityError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import PAGE, BatchOutcomes, aligned_buffer
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier
from kvtier.transfer import _ring, uring
from kvtier.transfer.io_engine import IOEngine, open_io_engine, probe_io_uring

_NO_URING = probe_io_uring()
needs_uring = pytest.mark.skipif(_NO_URING is not None, reason=f"io_uring: {_NO_URING}")
needs_native = pytest.mark.skipif(
    not _ring.FIXED_CAPABLE, reason="kvtier.transfer._address (the compiled helper) is not built"
)


def _direct_fd(tmp_path: Path) -> int:
    try:
        return os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        pytest.skip(f"O_DIRECT refused on {tmp_path}: {exc}")


async def _transfer(
    engine: IOEngine, read: bool, fd: int, requests: list[list[memoryview]], offsets: list[int]
) -> dict[int, tuple[int, BaseException | None]]:
    done = BatchOutcomes()
    engine.submit_many(read, fd, requests, offsets, done.then, alignment=PAGE)
    await done.settle(len(requests))
    return done.reported


ROW = _ring.SPLIT_MIN
"""The least row a two-buffer request is split for (smaller ones go vectored)."""


@needs_uring
@needs_native
async def test_header_and_row_requests_round_trip_through_registered_memory(
    tmp_path: Path,
) -> None:
    """The file tier's shape: a header page and a row per request, both registered,
    go as two fixed-buffer entries each and are reported once, with both sizes."""
    engine = await open_io_engine("io_uring", queue_depth=4)
    fd = _direct_fd(tmp_path)
    n, each = 9, PAGE + ROW  # past the depth: requests wait, several submissions
    heads, rows = aligned_buffer(n * PAGE), aligned_buffer(n * ROW)
    try:
        assert engine.register_memory(rows, [memoryview(rows)]) == n * ROW
        assert engine.register_memory(heads, [memoryview(heads)]) == n * PAGE
        assert engine.statistics().registered_bytes == n * each
        src = os.urandom(n * each)
        hv, rv = memoryview(heads), memoryview(rows)
        requests = [[hv[i * PAGE : (i + 1) * PAGE], rv[i * ROW : (i + 1) * ROW]] for i in range(n)]
        for i, (h, r) in enumerate(requests):
            h[:] = src[i * each : i * each + PAGE]
            r[:] = src[i * each + PAGE : (i + 1) * each]
        offsets = [i * each for i in range(n)]
        wrote = await _transfer(engine, False, fd, requests, offsets)
        assert wrote == {i: (each, None) for i in range(n)}
        # The file holds what one vectored write per request would have written.
        assert (tmp_path / "f").read_bytes() == src
        hv[:] = b"\0" * len(hv)
        rv[:] = b"\0" * len(rv)
        read = await _transfer(engine, True, fd, requests, offsets)
        assert read == {i: (each, None) for i in range(n)}
        assert b"".join(bytes(v) for r in requests for v in r) == src
        stats = engine.statistics()
        assert stats.submitted == stats.completed == stats.fixed_requests == 2 * n
        assert stats.bytes_read == stats.bytes_written == n * each
        assert stats.in_flight == 0
        assert stats.max_in_flight <= 4
    finally:
        await engine.aclose()
        os.close(fd)


@needs_uring
@needs_native
async def test_split_requests_report_what_one_vectored_request_would(tmp_path: Path) -> None:
    """A short second part gives a short count; a failed first part fails the request."""
    engine = await open_io_engine("io_uring", queue_depth=8)
    fd = _direct_fd(tmp_path)
    os.pwrite(fd, aligned_buffer(3 * PAGE), 0)  # the file ends after 3 pages
    mem = aligned_buffer(2 * (PAGE + ROW))
    v = memoryview(mem)
    a, b = [v[:PAGE], v[PAGE : PAGE + ROW]], [v[PAGE + ROW : 2 * PAGE + ROW], v[2 * PAGE + ROW :]]
    try:
        assert engine.register_memory(mem, [v]) == 2 * (PAGE + ROW)
        read = await _transfer(engine, True, fd, [a, b], [0, 8 * ROW])
        # Request 0: 1 + 2 pages (the end of the file); request 1, past the end: 0.
        assert read == {0: (3 * PAGE, None), 1: (0, None)}
        ro = os.open(tmp_path / "f", os.O_RDONLY | os.O_DIRECT)
        try:
            wrote = await _transfer(engine, False, ro, [a], [0])
        finally:
            os.close(ro)
        nbytes, exc = wrote[0]
        assert nbytes == 0
        assert isinstance(exc, OSError)
        assert exc.errno == errno.EBADF
        stats = engine.statistics()
        assert stats.failed == 1
        assert stats.fixed_requests == 3
    finally:
        await engine.aclose()
        os.close(fd)


@needs_uring
@needs_native
async def test_what_goes_with_fixed_buffers_and_what_goes_vectored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered memory is cut into pieces of at most MAX_FIXED_BYTES (1 GiB for the
    kernel): a buffer across two pieces, or outside, or a two-buffer request with a
    row under SPLIT_MIN, goes vectored; all of them move the same bytes (no two of
    the buffers below overlap)."""
    u = ROW
    monkeypatch.setattr(uring, "MAX_FIXED_BYTES", 2 * u)
    engine = await open_io_engine("io_uring", queue_depth=4)
    fd = _direct_fd(tmp_path)
    mem, other = aligned_buffer(8 * u), aligned_buffer(PAGE)
    v, o = memoryview(mem), memoryview(other)
    try:
        assert engine.register_memory(mem, [v]) == 8 * u
        requests = [
            [v[:PAGE]],  # one buffer in a piece: fixed
            [v[u : 3 * u]],  # across two pieces: vectored
            [v[3 * u : 3 * u + PAGE], v[3 * u + PAGE : 4 * u + PAGE]],  # row across pieces
            [o[:PAGE], v[6 * u : 7 * u]],  # header outside: vectored
            [v[4 * u + PAGE : 4 * u + 2 * PAGE], v[4 * u + 2 * PAGE : 5 * u + 2 * PAGE]],  # fixed
            [v[7 * u : 7 * u + PAGE], v[7 * u + PAGE : 7 * u + 3 * PAGE]],  # small row: vectored
        ]
        sizes = [sum(b.nbytes for b in r) for r in requests]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        src = os.urandom(sum(sizes))
        for r, at in zip(requests, offsets, strict=True):
            for b in r:
                b[:] = src[at : at + b.nbytes]
                at += b.nbytes
        wrote = await _transfer(engine, False, fd, requests, offsets)
        assert wrote == {i: (n, None) for i, n in enumerate(sizes)}
        assert (tmp_path / "f").read_bytes() == src
        assert engine.statistics().fixed_requests == 2
    finally:
        await engine.aclose()
        os.close(fd)


@needs_uring
@needs_native
async def test_registered_memory_cannot_be_unmapped_until_unregistered() -> None:
    engine = await open_io_engine("io_uring", queue_depth=4)
    region = mmap.mmap(-1, 16 * PAGE)
    owner = object()
    try:
        assert engine.register_memory(owner, [region]) == 16 * PAGE
        with pytest.raises(BufferError):
            region.close()
        engine.unregister_memory(owner)
        engine.unregister_memory(owner)  # twice is fine
        assert engine.statistics().registered_bytes == 0
        region.close()
        # Replacing an owner's buffers: only the last call's count.
        a, b = aligned_buffer(2 * PAGE), aligned_buffer(3 * PAGE)
        mine = memoryview(a)
        engine.register_memory(owner, [mine])
        assert engine.register_memory(owner, [b]) == 3 * PAGE
        assert engine.statistics().registered_bytes == 3 * PAGE
        assert mine[0] == 0  # the caller's view is still the caller's
        mine.release()
        a.close()  # replaced, so no longer held
    finally:
        await engine.aclose()
    # Closing the engine releases what it held.
    assert engine.statistics().registered_bytes == 0


@needs_uring
@needs_native
async def test_memory_the_kernel_will_not_pin_is_refused_and_io_goes_on(tmp_path: Path) -> None:
    """A shared mapping of a file on a disk filesystem cannot be pinned for long
    (FOLL_LONGTERM): registering it gives 0, and what was registered stays."""
    engine = await open_io_engine("io_uring", queue_depth=4)
    fd = _direct_fd(tmp_path)
    backing = tmp_path / "mapped"
    backing.write_bytes(b"\0" * 4 * PAGE)
    kept = aligned_buffer(2 * PAGE)
    bfd = os.open(backing, os.O_RDWR)
    try:
        mapped = mmap.mmap(bfd, 4 * PAGE)
    finally:
        os.close(bfd)
    try:
        assert engine.register_memory(kept, [kept]) == 2 * PAGE
        assert engine.register_memory(mapped, [mapped]) == 0
        assert engine.statistics().registered_bytes == 2 * PAGE
        mapped.close()  # refused, so not held
        v = memoryview(kept)
        v[:] = os.urandom(2 * PAGE)
        wrote = await _transfer(engine, False, fd, [[v[:PAGE], v[PAGE:]]], [0])
        assert wrote == {0: (2 * PAGE, None)}
        assert (tmp_path / "f").read_bytes() == bytes(v)
    finally:
        await engine.aclose()
        os.close(fd)


async def test_the_thread_pool_registers_nothing() -> None:
    engine = await open_io_engine("threads", queue_depth=2)
    try:
        assert engine.register_memory(engine, [aligned_buffer(PAGE)]) == 0
        assert engine.statistics().registered_bytes == 0
        engine.unregister_memory(engine)
    finally:
        await engine.aclose()


@needs_uring
@needs_native
async def test_a_file_tier_of_large_blocks_moves_them_from_registered_memory(
    tmp_path: Path,
) -> None:
    """Blocks of SPLIT_MIN bytes: each header and row go as fixed-buffer entries,
    the blocks round-trip, and a flipped byte on disk is still caught."""
    layout = KVLayout(
        tensors=(
            TensorSpec(name="kv", shape=(4, 64), dtype="float16", itemsize=2, kv_first=False),
        ),
        model_id="m",
        block_tokens=16,
    )
    engine = await open_io_engine("io_uring", queue_depth=4)
    config = FileTierConfig(
        root=tmp_path / "tier",
        bytes_to_use=FileTier.budget_for(8, ROW),
        io_engine="io_uring",
        direct_io="require",
    )
    tier = await FileTier.open(config, layout, block_bytes=ROW, io_engine=engine)
    src, dst = aligned_buffer(6 * ROW), aligned_buffer(6 * ROW)
    src[:] = os.urandom(6 * ROW)
    rows = [memoryview(src)[i * ROW : (i + 1) * ROW] for i in range(6)]
    back = [memoryview(dst)[i * ROW : (i + 1) * ROW] for i in range(6)]
    keys = [bytes([i]) * 16 for i in range(6)]
    try:
        registered = tier.register_memory([src, dst])
        assert registered > 12 * ROW
        assert tier.statistics().registered_bytes == registered
        assert (await tier.store(keys, rows)).stored == tuple(keys)
        assert engine.statistics().fixed_requests == 6
        slot_file = tier.path / "blocks.dat"
        slot = tier.slot_of(keys[4])
        assert slot is not None
        at = slot * (HEADER_BYTES + ROW) + HEADER_BYTES + 12345
        fd = os.open(slot_file, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)
        finally:
            os.close(fd)
        result = await tier.load(keys, back)
        assert result.loaded == tuple(k for k in keys if k != keys[4])
        assert isinstance(result.missing[keys[4]], IntegrityError)
        for i in (0, 1, 2, 3, 5):
            assert bytes(back[i]) == bytes(rows[i])
        assert engine.statistics().fixed_requests == 12
    finally:
        await tier.aclose()
        await engine.aclose()
