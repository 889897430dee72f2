"""Registered memory (io_uring fixed buffers): real I/O through it, its limits and refusals."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import pytest

from kvtier.testing.io_engine import PAGE, BatchOutcomes, aligned_buffer
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


@needs_uring
@needs_native
async def test_header_and_row_requests_round_trip_through_registered_memory(
    tmp_path: Path,
) -> None:
    """The file tier's shape: a header page and a row per request, both registered,
    go as two fixed-buffer entries each and are reported once, with both sizes."""
    engine = await open_io_engine("io_uring", queue_depth=4)
    fd = _direct_fd(tmp_path)
    n = 23  # past the depth, so requests wait and go in several submissions
    heads, rows = aligned_buffer(n * PAGE), aligned_buffer(n * 4 * PAGE)
    try:
        assert engine.register_memory(rows, [memoryview(rows)]) == n * 4 * PAGE
        assert engine.register_memory(heads, [memoryview(heads)]) == n * PAGE
        assert engine.statistics().registered_bytes == n * 5 * PAGE
        src = os.urandom(n * 5 * PAGE)
        hv, rv = memoryview(heads), memoryview(rows)
        for i in range(n):
            hv[i * PAGE : (i + 1) * PAGE] = src[i * 5 * PAGE : i * 5 * PAGE + PAGE]
            rv[i * 4 * PAGE : (i + 1) * 4 * PAGE] = src[i * 5 * PAGE + PAGE : (i + 1) * 5 * PAGE]
        requests = [
            [hv[i * PAGE : (i + 1) * PAGE], rv[i * 4 * PAGE : (i + 1) * 4 * PAGE]] for i in range(n)
        ]
        offsets = [i * 5 * PAGE for i in range(n)]
        wrote = await _transfer(engine, False, fd, requests, offsets)
        assert wrote == {i: (5 * PAGE, None) for i in range(n)}
        # The file holds what one vectored write per request would have written.
        assert (tmp_path / "f").read_bytes() == src
        hv[:] = b"\0" * len(hv)
        rv[:] = b"\0" * len(rv)
        read = await _transfer(engine, True, fd, requests, offsets)
        assert read == {i: (5 * PAGE, None) for i in range(n)}
        assert bytes(hv[:PAGE]) + bytes(rv[: 4 * PAGE]) == src[: 5 * PAGE]
        assert b"".join(bytes(v) for r in requests for v in r) == src
        stats = engine.statistics()
        assert stats.submitted == stats.completed == 2 * n
        assert stats.bytes_read == stats.bytes_written == n * 5 * PAGE
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
    mem = aligned_buffer(8 * PAGE)
    v = memoryview(mem)
    try:
        assert engine.register_memory(mem, [v]) == 8 * PAGE
        read = await _transfer(
            engine,
            True,
            fd,
            [[v[:PAGE], v[PAGE : 4 * PAGE]], [v[4 * PAGE : 5 * PAGE], v[5 * PAGE : 6 * PAGE]]],
            [0, 8 * PAGE],
        )
        # Request 0: 1 + 2 of 3 pages (end of file); request 1 past the end: 0.
        assert read == {0: (3 * PAGE, None), 1: (0, None)}
        ro = os.open(tmp_path / "f", os.O_RDONLY | os.O_DIRECT)
        try:
            wrote = await _transfer(engine, False, ro, [[v[:PAGE], v[PAGE : 2 * PAGE]]], [0])
        finally:
            os.close(ro)
        nbytes, exc = wrote[0]
        assert nbytes == 0
        assert isinstance(exc, OSError)
        assert exc.errno == errno.EBADF
        assert engine.statistics().failed == 1
    finally:
        await engine.aclose()
        os.close(fd)


@needs_uring
@needs_native
async def test_buffers_outside_registered_memory_and_across_its_pieces_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered memory is cut into pieces of at most MAX_FIXED_BYTES (1 GiB for the
    kernel): a buffer across two pieces, or outside, goes as a vectored request."""
    monkeypatch.setattr(uring, "MAX_FIXED_BYTES", 2 * PAGE)
    engine = await open_io_engine("io_uring", queue_depth=4)
    fd = _direct_fd(tmp_path)
    mem, other = aligned_buffer(8 * PAGE), aligned_buffer(4 * PAGE)
    v, o = memoryview(mem), memoryview(other)
    try:
        assert engine.register_memory(mem, [v]) == 8 * PAGE
        src = os.urandom(8 * PAGE)
        v[:] = src[: 8 * PAGE]
        requests = [
            [v[:PAGE]],  # one fixed entry
            [v[PAGE : 3 * PAGE]],  # across two pieces: vectored
            [v[3 * PAGE : 4 * PAGE], v[4 * PAGE : 6 * PAGE]],  # the second across pieces
            [o[:PAGE], v[6 * PAGE : 7 * PAGE]],  # one part outside
        ]
        sizes = [PAGE, 2 * PAGE, 3 * PAGE, 2 * PAGE]
        offsets = [0, PAGE, 3 * PAGE, 6 * PAGE]
        o[:PAGE] = src[6 * PAGE : 7 * PAGE]
        v[6 * PAGE : 7 * PAGE] = src[7 * PAGE : 8 * PAGE]
        wrote = await _transfer(engine, False, fd, requests, offsets)
        assert wrote == {i: (s, None) for i, s in enumerate(sizes)}
        assert (tmp_path / "f").read_bytes() == src
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
        engine.register_memory(owner, [a])
        assert engine.register_memory(owner, [b]) == 3 * PAGE
        assert engine.statistics().registered_bytes == 3 * PAGE
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
