"""The tier conformance suite against the cluster tier: a real cluster and one server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from kvtier.testing.tier import OpenTier, TierSuite
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


class _OnServers(TierSuite):
    """The suite on the servers of fixture :attr:`servers`, tiers opened with :attr:`options`."""

    servers: ClassVar[str] = "valkey_cluster"
    options: ClassVar[dict[str, Any]] = {}

    @pytest_asyncio.fixture
    async def open_tier(
        self, request: pytest.FixtureRequest, open_cluster_tier: OpenCluster
    ) -> AsyncIterator[OpenTier]:
        servers = request.getfixturevalue(self.servers)

        async def _open() -> Tier:
            tier: ClusterTier = await open_cluster_tier(servers, **self.options)
            return tier

        yield _open

    async def damage(self, tier: Tier, key: bytes) -> None:
        await flip_payload_byte(tier, key)


class TestClusterTier(_OnServers):
    """On the session's three-node cluster (the tier's own connections: stores
    sent from the rows, loads received straight into them)."""


class TestClusterTierThroughRedisPy(_OnServers):
    """On the session's cluster, every value written and every reply read by redis-py."""

    options: ClassVar[dict[str, Any]] = {"direct_reads": False, "direct_writes": False}


class TestSingleServerTier(_OnServers):
    """On one server not in cluster mode."""

    servers: ClassVar[str] = "valkey_single"
