"""The tier conformance suite against the file tier, opened through ``FileTier.open``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

from kvtier.config import FileTierConfig
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.tier import OpenTier, TierSuite
from kvtier.tiers.base import Tier
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier

BLOCK = 8192


def test_file_tier_implements_the_contract() -> None:
    assert issubclass(FileTier, Tier)
    assert not FileTier.__abstractmethods__


def _layout() -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="m", block_tokens=16)


class TestFileTier(TierSuite):
    block_bytes = BLOCK

    @pytest_asyncio.fixture
    async def open_tier(self, tmp_path: Path) -> AsyncIterator[OpenTier]:
        opened: list[FileTier] = []

        async def _open() -> Tier:
            config = FileTierConfig(
                root=tmp_path / f"tier{len(opened)}",
                bytes_to_use=FileTier.budget_for(32, BLOCK),
                io_engine="threads",
                queue_depth=4,
            )
            tier = await FileTier.open(config, _layout(), block_bytes=BLOCK)
            opened.append(tier)
            assert isinstance(tier, Tier)
            return tier

        yield _open
        for tier in opened:
            await tier.aclose()

    async def damage(self, tier: Tier, key: bytes) -> None:
        assert isinstance(tier, FileTier)
        slot = tier.slot_of(key)
        assert slot is not None
        fd = os.open(tier.path / "blocks.dat", os.O_RDWR)
        try:
            at = slot * (HEADER_BYTES + BLOCK) + HEADER_BYTES + 7
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at)
        finally:
            os.close(fd)

    def verification_failures(self, stats: Any) -> int:
        return int(stats.quarantined)
