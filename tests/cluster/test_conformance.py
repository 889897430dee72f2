"""The tier conformance suite against the cluster tier: a real cluster and one server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from kvtier.testing.tier import OpenTier, TierSuite
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.base import Tier
from kvtier.tiers.cluster import ClusterTier

from .conftest import OpenCluster


async def flip_payload_byte(tier: Tier, key: bytes) -> None:
    """Flip one payload byte of ``key``'s value in place on the server (SETRANGE)."""
    assert isinstance(tier, ClusterTier)
    rkey = tier.key_of(key)
    value = await tier.client.get(rkey)
    assert value is not None
    at = len(value) - 7
    await tier.client.setrange(rkey, at, bytes([value[at] ^ 0xFF]))


class TestClusterTier(TierSuite):
    """On the session's three-node cluster."""

    @pytest_asyncio.fixture
    async def open_tier(
        self, valkey_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
    ) -> AsyncIterator[OpenTier]:
        async def _open() -> Tier:
            tier: ClusterTier = await open_cluster_tier(valkey_cluster)
            return tier

        yield _open

    async def damage(self, tier: Tier, key: bytes) -> None:
        await flip_payload_byte(tier, key)


class TestSingleServerTier(TierSuite):
    """On one server not in cluster mode."""

    @pytest_asyncio.fixture
    async def open_tier(
        self, valkey_single: ValkeyCluster, open_cluster_tier: OpenCluster
    ) -> AsyncIterator[OpenTier]:
        async def _open() -> Tier:
            tier: ClusterTier = await open_cluster_tier(valkey_single)
            return tier

        yield _open

    async def damage(self, tier: Tier, key: bytes) -> None:
        await flip_payload_byte(tier, key)
