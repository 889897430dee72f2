"""Opening a file tier with ``recovery="background"``: open at once, blocks known later."""

from __future__ import annotations

import asyncio
import mmap
from pathlib import Path

import pytest

from kvtier.config import FileTierConfig, RecoveryMode
from kvtier.errors import BlockNotFoundError, BusyError, ClosedError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import aligned_buffer
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier

BLOCK = 4096
BLOCKS = 600


def layout() -> KVLayout:
    spec = TensorSpec(name="kv", shape=(2, 1024), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="bg", block_tokens=16)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [salt.to_bytes(2, "little") + i.to_bytes(14, "little") for i in range(n)]


def rows(n: int, seed: int) -> tuple[mmap.mmap, list[memoryview]]:
    buf = aligned_buffer(n * BLOCK)
    for i in range(n):
        buf[i * BLOCK : (i + 1) * BLOCK] = bytes([(seed + i) & 0xFF]) * BLOCK
    view = memoryview(buf)
    return buf, [view[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def config(root: Path, recovery: RecoveryMode) -> FileTierConfig:
    return FileTierConfig(
        root=root,
        bytes_to_use=2 * BLOCKS * (HEADER_BYTES + BLOCK),
        queue_depth=4,
        recovery=recovery,
    )


async def open_tier(root: Path, recovery: RecoveryMode) -> FileTier:
    return await FileTier.open(config(root, recovery), layout(), block_bytes=BLOCK)


async def filled_root(root: Path) -> list[bytes]:
    tier = await open_tier(root, "foreground")
    ks = keys(BLOCKS)
    _, views = rows(BLOCKS, seed=5)
    result = await tier.store(ks, views)
    assert result.stored == tuple(ks)
    await tier.aclose()
    return ks


async def test_background_recovery_knows_nothing_until_done(tmp_path: Path) -> None:
    ks = await filled_root(tmp_path / "root")
    tier = await open_tier(tmp_path / "root", "background")
    try:
        # open returned before the scan ran: nothing is known, nothing can be lost.
        assert tier.recovering
        assert tier.statistics().recovery == "running"
        assert tier.lookup(ks) == 0
        _, views = rows(2, seed=9)
        loaded = await tier.load(ks[:2], views)
        assert loaded.loaded == ()
        assert all(isinstance(e, BlockNotFoundError) for e in loaded.missing.values())
        new = keys(2, salt=1)
        refused = await tier.store(new, views)
        assert refused.stored == ()
        assert set(refused.failed) == set(new)
        assert all(isinstance(e, BusyError) for e in refused.failed.values())
        tier.remove(ks[:1])  # nothing known yet: a no-op, the block survives
        await tier.wait_recovered()
        stats = tier.statistics()
        assert not tier.recovering
        assert stats.recovery == "complete"
        assert stats.recovered_blocks == BLOCKS
        assert tier.lookup(ks) == BLOCKS
        buf, views = rows(BLOCKS, seed=0)
        assert (await tier.load(ks, views)).loaded == tuple(ks)
        _, want = rows(BLOCKS, seed=5)
        assert buf[:] == b"".join(bytes(v) for v in want)
        # Stores are taken again.
        _, two = rows(2, seed=7)
        assert (await tier.store(new, two)).stored == tuple(new)
        await tier.wait_recovered()  # done: returns at once
    finally:
        await tier.aclose()


async def test_aclose_during_background_recovery_loses_nothing(tmp_path: Path) -> None:
    ks = await filled_root(tmp_path / "root")
    tier = await open_tier(tmp_path / "root", "background")
    await asyncio.sleep(0)  # let the scan start
    await asyncio.wait_for(tier.aclose(), 30)
    with pytest.raises(ClosedError):
        tier.store(ks[:1], rows(1, 0)[1])
    # The slot file is as it was: a foreground open finds every block.
    again = await FileTier.open(
        config(tmp_path / "root", "foreground"), layout(), block_bytes=BLOCK
    )
    try:
        assert again.statistics().recovered_blocks == BLOCKS
        assert again.lookup(ks) == BLOCKS
    finally:
        await again.aclose()


async def test_foreground_recovery_is_complete_at_open(tmp_path: Path) -> None:
    ks = await filled_root(tmp_path / "root")
    tier = await open_tier(tmp_path / "root", "foreground")
    try:
        assert not tier.recovering
        assert tier.statistics().recovery == "complete"
        assert tier.lookup(ks) == BLOCKS
        await tier.wait_recovered()
    finally:
        await tier.aclose()
