"""Both I/O engines run the same conformance suite."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.testing.io_engine import IOEngineSuite
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


@pytest.mark.parametrize("depth", [0, 5000], ids=["zero", "too-deep"])
async def test_queue_depth_range(depth: int) -> None:
    with pytest.raises(InvalidArgumentError):
        await open_io_engine("threads", queue_depth=depth)
