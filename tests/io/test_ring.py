"""kvtier's own io_uring ring, below the engine: wrap-around, errors, eventfd."""

from __future__ import annotations

import errno
import os

import pytest

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
