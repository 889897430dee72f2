"""kvtier's own io_uring ring, below the engine: wrap-around, errors, eventfd."""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import struct
from pathlib import Path

import pytest

import kvtier.transfer._ring as ring_module
from kvtier.transfer._ring import OP_NOP, OP_READV, Ring
from kvtier.transfer.io_engine import probe_io_uring

_NO_URING = probe_io_uring()
pytestmark = pytest.mark.skipif(_NO_URING is not None, reason=f"io_uring unavailable: {_NO_URING}")


def test_positions_wrap_around_the_rings_many_times() -> None:
    ring = Ring(2)
    try:
        assert ring.sq_entries == 2
        seen: list[int] = []
        for i in range(0, 1000, 2):
            assert ring.space() == 2
            ring.prep(OP_NOP, -1, 0, 0, 0, i)
            ring.prep(OP_NOP, -1, 0, 0, 0, i + 1)
            assert ring.space() == 0
            assert ring.submit() == 2
            while len(seen) < i + 2:
                ring.wait()
                seen += [tag for tag, res in ring.reap() if res == 0]
        assert seen == list(range(1000))
    finally:
        ring.close()


def test_a_failed_request_completes_with_minus_errno() -> None:
    ring = Ring(4)
    try:
        ring.prep(OP_READV, 10_000, 0, 0, 0, 5)  # no such descriptor
        ring.submit()
        ring.wait()
        assert list(ring.reap()) == [(5, -errno.EBADF)]
    finally:
        ring.close()


def test_completions_signal_the_registered_eventfd() -> None:
    ring = Ring(4)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        ring.register_eventfd(efd)
        with pytest.raises(BlockingIOError):
            os.eventfd_read(efd)
        ring.prep(OP_NOP, -1, 0, 0, 0, 9)
        ring.submit()
        ring.wait()
        assert os.eventfd_read(efd) >= 1
        assert list(ring.reap()) == [(9, 0)]
        ring.unregister_eventfd()
    finally:
        os.close(efd)
        ring.close()
    assert ring.fd == -1
    ring.close()  # twice is fine


def test_completions_waiting_says_whether_a_reap_would_find_one() -> None:
    """What the engine's handler looks at after reading the eventfd: a
    completion posted and not reaped, whatever the eventfd says."""
    ring = Ring(4)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        ring.register_eventfd(efd)
        assert not ring.completions_waiting()
        ring.prep(OP_NOP, -1, 0, 0, 0, 3)
        ring.submit()
        ring.wait()
        os.eventfd_read(efd)  # the signal cleared: the completion still waits
        assert ring.completions_waiting()
        assert list(ring.reap()) == [(3, 0)]
        assert not ring.completions_waiting()
    finally:
        os.close(efd)
        ring.close()


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


def _nop_round_trip(ring: Ring) -> None:
    ring.prep(OP_NOP, -1, 0, 0, 0, 7)
    ring.submit()
    ring.wait()
    assert list(ring.reap()) == [(7, 0)]


@pytest.mark.skipif(not _kernel_at_least(5, 19), reason="IORING_SETUP_COOP_TASKRUN is Linux 5.19")
def test_the_ring_is_cooperative_where_the_kernel_has_it() -> None:
    ring = Ring(4)
    try:
        assert ring.cooperative
        _nop_round_trip(ring)  # posted at the next entry into the kernel
    finally:
        ring.close()


def test_a_kernel_refusing_the_setup_flags_gets_a_plain_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A flag no kernel knows: refused with EINVAL, as 5.1-5.18 refuse COOP_TASKRUN.
    monkeypatch.setattr(ring_module, "SETUP_FLAGS", 1 << 31)
    ring = Ring(4)
    try:
        assert not ring.cooperative
        _nop_round_trip(ring)
    finally:
        ring.close()


_Runs = list[tuple[int, list[tuple[int, int, BaseException | None]], int, int]]


def _reap_all_runs(ring: Ring, expected: int) -> _Runs:
    runs: _Runs = []
    while sum(len(o) for _, o, _, _ in runs) < expected:
        ring.wait()
        runs += ring.reap_runs()
    return runs


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_reap_runs_groups_completions_by_batch_with_bytes_and_failures(
    native: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.transfer import _ring

    if not native:
        monkeypatch.setattr(_ring, "_native", None)
    path = tmp_path / "data"
    path.write_bytes(b"k" * 600)
    fd = os.open(path, os.O_RDONLY)
    buf = ctypes.create_string_buffer(600)
    iov = ctypes.create_string_buffer(struct.pack("@PN", ctypes.addressof(buf), 600))
    ring = Ring(8)
    try:
        requests = [
            (OP_NOP, -1, 0, 0, 1 << 32 | 0),
            (OP_READV, fd, ctypes.addressof(iov), 1, 1 << 32 | 1),
            (OP_READV, 10_000, 0, 0, 2 << 32 | 0),  # no such descriptor
            (OP_READV, fd, ctypes.addressof(iov), 1, 1 << 32 | 2),
            (OP_READV, 10_000, 0, 0, 1 << 32 | 3),
        ]
        for op, rfd, addr, n, tag in requests:
            ring.prep(op, rfd, addr, n, 0, tag)
        ring.submit()
        runs = _reap_all_runs(ring, len(requests))
    finally:
        ring.close()
        os.close(fd)
    # Runs are maximal: two in a row never belong to the same batch.
    assert all(a[0] != b[0] for a, b in itertools.pairwise(runs))
    merged: dict[int, tuple[list[tuple[int, int, BaseException | None]], int, int]] = {}
    for batch, outcomes, moved, failed in runs:
        assert moved == sum(r for _, r, _ in outcomes if r >= 0)
        assert failed == sum(1 for _, r, _ in outcomes if r < 0)
        got, m, f = merged.get(batch, ([], 0, 0))
        merged[batch] = (got + outcomes, m + moved, f + failed)
    assert {b: (sorted(o), m, f) for b, (o, m, f) in merged.items()} == {
        1: ([(0, 0, None), (1, 600, None), (2, 600, None), (3, -errno.EBADF, None)], 1200, 1),
        2: ([(0, -errno.EBADF, None)], 0, 1),
    }
