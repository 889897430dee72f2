"""The in-memory tier the runtime's tests drive keeps the tier contract (no I/O)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from kvtier.testing.memory import MemoryTier
from kvtier.testing.tier import OpenTier, TierSuite
from kvtier.tiers.base import Tier


class TestMemoryTier(TierSuite):
    @pytest_asyncio.fixture
    async def open_tier(self) -> AsyncIterator[OpenTier]:
        opened: list[MemoryTier] = []

        async def _open() -> Tier:
            opened.append(MemoryTier(self.block_bytes))
            return opened[-1]

        yield _open
        for tier in opened:
            await tier.aclose()

    async def damage(self, tier: Tier, key: bytes) -> None:
        assert isinstance(tier, MemoryTier)
        tier.damage(key)
