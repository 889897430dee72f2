"""The file tier's queue depth: an explicit one is kept, ``"auto"`` is measured at open.

Real O_DIRECT files and real engines; what is asserted is what the probe
chooses from and that it never changes what the slot file holds, never how
fast anything ran (that is the benchmark's job).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import FileTierConfig
from kvtier.errors import ConfigurationError, InvalidArgumentError, TierIOError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.faults import FaultPlan, FaultyIOEngine
from kvtier.tiers.file import FileTier
from kvtier.tiers.file._opening import AUTO_DEPTH_FALLBACK
from kvtier.tiers.file._slots import data_runs, probe_range
from kvtier.transfer.io_engine import (
    DEEP_DEPTH,
    QUEUE_DEPTHS,
    choose_depth,
    measure_queue_depth,
    open_io_engine,
    probe_depths,
    probe_io_uring,
)

BLOCK = 64 * 1024
SLOT = 4096 + BLOCK


def layout() -> KVLayout:
    spec = TensorSpec(name="kv", shape=(2, 16384), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="depth", block_tokens=16)


def rows(n: int) -> list[memoryview]:
    """``n`` page-aligned rows, row ``i`` filled with ``(i + 1) % 256`` (freed with the views)."""
    buf = mmap.mmap(-1, n * BLOCK)
    for i in range(n):
        buf[i * BLOCK : (i + 1) * BLOCK] = bytes([(i + 1) % 256]) * BLOCK
    view = memoryview(buf)
    return [view[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def config(root: Path, slots: int, **kw: Any) -> FileTierConfig:
    return FileTierConfig(
        root=root,
        bytes_to_use=FileTier.budget_for(slots, BLOCK),
        direct_io="require",
        **kw,
    )


@pytest.mark.parametrize("depth", [1, 3, 4096], ids=lambda d: f"qd{d}")
async def test_an_explicit_depth_is_kept(tmp_path: Path, depth: int) -> None:
    tier = await FileTier.open(config(tmp_path, 4, queue_depth=depth), layout(), block_bytes=BLOCK)
    try:
        assert tier.statistics().queue_depth == depth
    finally:
        await tier.aclose()


@pytest.mark.parametrize("bad", [0, 4097, "8", True, "deep"], ids=repr)
def test_a_bad_depth_is_a_configuration_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigurationError, match="queue_depth"):
        config(tmp_path, 4, queue_depth=bad)


async def test_auto_on_a_tier_too_small_to_measure_takes_the_fallback(tmp_path: Path) -> None:
    tier = await FileTier.open(config(tmp_path, 4), layout(), block_bytes=BLOCK)
    try:
        assert tier.statistics().queue_depth == AUTO_DEPTH_FALLBACK
    finally:
        await tier.aclose()


async def test_auto_measures_and_keeps_the_blocks(tmp_path: Path) -> None:
    """Fresh: a write probe over never-written slots; reopened full: a read probe."""
    slots = (64 << 20) // SLOT + 8
    cfg = config(tmp_path, slots, queue_depth="auto")
    tier = await FileTier.open(cfg, layout(), block_bytes=BLOCK)
    views = rows(slots)
    keys = [i.to_bytes(16, "little") for i in range(slots)]
    try:
        stats = tier.statistics()
        assert stats.queue_depth in QUEUE_DEPTHS
        assert stats.blocks == 0  # the probe's zeros are free slots
        # Zeros written where zeros were read: the probe wrote, and changed nothing.
        fd = os.open(tier.path / "blocks.dat", os.O_RDONLY)
        try:
            assert list(data_runs(fd, slots * SLOT)) != []
        finally:
            os.close(fd)
        assert not any((tier.path / "blocks.dat").read_bytes())
        done = await tier.store(keys, views)
        assert done.stored == tuple(keys)
        await tier.aclose()
        tier = await FileTier.open(cfg, layout(), block_bytes=BLOCK)
        assert tier.statistics().queue_depth in QUEUE_DEPTHS
        assert tier.statistics().blocks == slots
        for view in views:
            view[:] = bytes(BLOCK)
        loaded = await tier.load(keys, views)
        assert loaded.loaded == tuple(keys)
        assert all(view[0] == (i + 1) % 256 for i, view in enumerate(views))
    finally:
        await tier.aclose()


@pytest.mark.parametrize(
    ("request_bytes", "deep"),
    [
        (SLOT, False),
        (256 * 1024 - 4096, False),
        (256 * 1024, True),
        (4096 + 256 * 1024, True),
        (4096 + 1024 * 1024, True),
        (2 * 1024 * 1024 - 4096, True),
        (2 * 1024 * 1024, False),
        (4096 + 8 * 1024 * 1024, False),
    ],
)
def test_probe_depths_adds_the_deep_queue_for_mid_sized_requests(
    request_bytes: int, deep: bool
) -> None:
    assert probe_depths(request_bytes) == QUEUE_DEPTHS + ((DEEP_DEPTH,) if deep else ())
    # Not for threads: a request each is a thread's system call.
    assert probe_depths(request_bytes, "threads") == QUEUE_DEPTHS


_NO_URING = probe_io_uring()


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param(
            "io_uring",
            marks=pytest.mark.skipif(_NO_URING is not None, reason=f"io_uring: {_NO_URING}"),
        ),
        "threads",
    ],
)
async def test_auto_times_the_deep_queue_for_256_kib_blocks_on_io_uring_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, engine: str
) -> None:
    """The open's probe at 256 KiB times what probe_depths names for its engine, and
    chooses among what it timed."""
    block = 256 * 1024
    slots = (64 << 20) // (4096 + block) + 8
    cfg = FileTierConfig(
        root=tmp_path,
        bytes_to_use=FileTier.budget_for(slots, block),
        direct_io="require",
        io_engine=engine,
    )
    with caplog.at_level("INFO", logger="kvtier.file_tier"):
        tier = await FileTier.open(cfg, layout(), block_bytes=block)
    try:
        depths = probe_depths(4096 + block, engine)
        assert depths == ((*QUEUE_DEPTHS, DEEP_DEPTH) if engine == "io_uring" else QUEUE_DEPTHS)
        assert tier.statistics().queue_depth in depths
        (line,) = [r.getMessage() for r in caplog.records if "GB/s by depth" in r.getMessage()]
        timed = [int(part.split(":")[0]) for part in line.split("GB/s by depth: ")[1].split(", ")]
        assert timed == list(depths)
    finally:
        await tier.aclose()


def test_probe_range_prefers_never_written_slots(tmp_path: Path) -> None:
    slots, want = 64, 16 * SLOT
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, slots * SLOT)
        assert probe_range(fd, slots, SLOT, want) == (0, slots * SLOT, True)
        assert probe_range(fd, slots, SLOT, slots * SLOT + 1) is None
        os.pwrite(fd, b"x" * (40 * SLOT), 0)  # slots 0-39 hold data, 40-63 never written
        os.fsync(fd)
        assert probe_range(fd, slots, SLOT, want) == (40 * SLOT, 24 * SLOT, True)
        assert probe_range(fd, slots, SLOT, 30 * SLOT) == (0, 40 * SLOT, False)
        os.pwrite(fd, b"y" * (24 * SLOT), 40 * SLOT)
        os.fsync(fd)
        assert probe_range(fd, slots, SLOT, want) == (0, slots * SLOT, False)
    finally:
        os.close(fd)


@pytest.mark.parametrize("write", [True, False], ids=["write", "read"])
async def test_measure_queue_depth_chooses_a_depth_it_tried(tmp_path: Path, write: bool) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    engine = await open_io_engine("auto", queue_depth=4)
    try:
        os.posix_fallocate(fd, 0, 64 * SLOT)
        probe = await measure_queue_depth(
            engine, fd, offset=SLOT, length=8 * SLOT, request_bytes=SLOT, write=write, depths=(1, 4)
        )
        assert probe.depth in (1, 4)
        assert [d for d, _ in probe.gbps] == [1, 4]
        assert all(rate > 0 for _, rate in probe.gbps)
        assert probe.write is write
    finally:
        await engine.aclose()
        os.close(fd)


async def test_measure_queue_depth_refuses_bad_arguments(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    engine = await open_io_engine("threads", queue_depth=4)
    try:
        for kw in (
            {"offset": 0, "length": SLOT - 1, "request_bytes": SLOT},
            {"offset": 1, "length": 4 * SLOT, "request_bytes": SLOT},
            {"offset": 0, "length": 4 * SLOT, "request_bytes": SLOT, "depths": (8,)},
            {"offset": 0, "length": 4 * SLOT, "request_bytes": SLOT, "depths": ()},
        ):
            with pytest.raises(InvalidArgumentError):
                await measure_queue_depth(engine, fd, write=False, **kw)
    finally:
        await engine.aclose()
        os.close(fd)


async def test_a_failing_probe_raises_the_io_error(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    plan = FaultPlan(seed=1, rates={"eio": 1.0})
    engine = FaultyIOEngine(await open_io_engine("threads", queue_depth=4), plan)
    try:
        os.posix_fallocate(fd, 0, 8 * SLOT)
        with pytest.raises(TierIOError):
            await measure_queue_depth(
                engine, fd, offset=0, length=8 * SLOT, request_bytes=SLOT, write=False, depths=(4,)
            )
        assert plan.injected["eio"] >= 1
    finally:
        await engine.aclose()
        os.close(fd)


async def test_auto_with_buffered_io_measures_nothing(tmp_path: Path) -> None:
    """The page cache would be timed: the fallback depth, and not a byte written."""
    slots = (64 << 20) // SLOT + 8
    cfg = FileTierConfig(
        root=tmp_path, bytes_to_use=FileTier.budget_for(slots, BLOCK), direct_io="off"
    )
    tier = await FileTier.open(cfg, layout(), block_bytes=BLOCK)
    try:
        assert tier.statistics().queue_depth == AUTO_DEPTH_FALLBACK
        fd = os.open(tier.path / "blocks.dat", os.O_RDONLY)
        try:
            assert list(data_runs(fd, slots * SLOT)) == []
        finally:
            os.close(fd)
    finally:
        await tier.aclose()


@pytest.mark.parametrize(
    ("rates", "chosen"),
    [
        # All within the noise: the deepest.
        ({1: [1.0, 1.1], 8: [2.0, 2.1], 32: [2.0, 1.95]}, 32),
        # One lucky round of a shallow depth (its confirmation rounds then
        # typical) does not push the deep one out, as a best-round rule would.
        ({8: [3.0, 2.0, 2.05], 32: [2.1, 2.05, 2.0]}, 32),
        # A shallow depth faster round after round wins.
        ({8: [3.0, 3.1], 32: [2.0, 2.2]}, 8),
        # Beyond the tolerance from the typically fastest: not chosen.
        ({4: [5.0, 5.0, 5.0], 16: [4.6, 4.4], 32: [4.4, 4.0]}, 16),
        # A single depth.
        ({4: [1.0]}, 4),
    ],
)
def test_choose_depth_takes_the_deepest_whose_best_round_is_near_the_typical_best(
    rates: dict[int, list[float]], chosen: int
) -> None:
    assert choose_depth(rates, 0.10) == chosen
