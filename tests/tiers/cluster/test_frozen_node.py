"""The cluster tier opens and serves with a node frozen (SIGSTOP), and recovers it.

A hung server (SIGSTOPped: the kernel still accepts connections on its port,
nothing answers) used to fail the tier's open with ``ETIMEDOUT``, and with it
the start of the serving instance (issue 41). Now the open probes every node
within ``connect_timeout_s``; a node that does not answer is down (one
WARNING, its blocks misses without I/O, a background probe with backoff);
``require_at_open`` keeps the fail-fast open. Every frozen server is
continued (SIGCONT) and stopped by its pid at teardown.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Iterator

import pytest

from kvtier.chain import TierReport
from kvtier.errors import TierIOError
from kvtier.metrics import OWN_FIGURES, tier_samples
from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.cluster import ClusterTier

from .conftest import BLOCK, NAMESPACE, OpenCluster, StartServer, config_for
from .test_faults import check_loaded

_LOG = "kvtier.cluster_tier"


@pytest.fixture
def thawed(private_cluster: ValkeyCluster) -> Iterator[ValkeyCluster]:
    """The private cluster, every frozen server continued at teardown, failed or not."""
    try:
        yield private_cluster
    finally:
        private_cluster.thaw()


def warnings_naming(caplog: pytest.LogCaptureFixture, name: str) -> int:
    return sum(
        1
        for r in caplog.records
        if r.name == _LOG and r.levelno == logging.WARNING and name in r.getMessage()
    )


async def until_stored(tier: ClusterTier, keys: list[bytes], within_s: float = 30.0) -> None:
    """Store ``keys`` again and again until every one is written (a node coming back)."""
    deadline = time.monotonic() + within_s
    while True:
        result = await tier.store(keys, Rows(len(keys), BLOCK).fill(keys).rows())
        if not result.failed:
            return
        assert time.monotonic() < deadline, result.failed
        await asyncio.sleep(0.1)


async def test_a_frozen_node_neither_stops_the_open_nor_fails_the_others(
    thawed: ValkeyCluster, open_cluster_tier: OpenCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = thawed
    port = cluster.ports[0]
    name = f"127.0.0.1:{port}"
    cluster.freeze(0)
    # The configuration of the issue (default timeouts), shorter waits between probes.
    t0 = time.monotonic()
    tier: ClusterTier = await open_cluster_tier(cluster, backoff_max_s=0.2)
    took = time.monotonic() - t0
    config = config_for(cluster)
    assert took < 2 * config.connect_timeout_s + config.timeout_s, f"the open took {took:.1f} s"
    stats = tier.statistics()
    assert (stats.nodes, stats.nodes_down, stats.outages, stats.recoveries) == (3, 1, 1, 0)
    assert warnings_naming(caplog, name) == 1

    keys = block_keys(48, salt=41)
    frozen = {k for k in keys if tier.client.get_node_from_key(tier.key_of(k)).port == port}
    assert 0 < len(frozen) < len(keys)
    t0 = time.monotonic()
    stored = await tier.store(keys, Rows(len(keys), BLOCK).fill(keys).rows())
    assert set(stored.stored) == set(keys) - frozen
    assert set(stored.failed) == frozen
    rows = Rows(len(keys), BLOCK)
    result = await tier.load(keys, rows.rows())
    assert await tier.refresh(keys) >= 0  # a hint: the frozen node's keys stay unknown
    assert time.monotonic() - t0 < config.timeout_s, "nothing waited on the frozen node"
    check_loaded(rows, keys, result.loaded)
    assert set(result.loaded) == set(keys) - frozen
    assert set(result.missing) == frozen, "the frozen node's blocks are misses"
    for err in (*stored.failed.values(), *result.missing.values()):
        assert isinstance(err, TierIOError), err
        assert err.errno == errno.ECONNREFUSED
        assert name in str(err)
    stats = tier.statistics()
    assert stats.refused_in_backoff >= 2 * len(frozen)
    assert stats.timeouts == 0, "no pipeline went to the frozen node"
    assert (stats.outages, stats.nodes_down) == (1, 1)
    assert warnings_naming(caplog, name) == 1, "one WARNING per outage, not per block"
    figures = stats.metric_figures()
    assert set(figures) <= set(OWN_FIGURES)
    assert (figures["node_outages_total"], figures["nodes_down"]) == (1, 1)
    # ... and as the samples both fronts export, labelled by tier.
    exported = tier_samples("cluster", TierReport(stats), row_bytes=BLOCK)
    assert exported[("kvtier_node_outages_total", ("cluster",))] == 1
    assert exported[("kvtier_nodes_down", ("cluster",))] == 1

    cluster.thaw(0)
    await asyncio.to_thread(cluster.wait_ok)
    await until_stored(tier, sorted(frozen))
    stats = tier.statistics()
    assert stats.recoveries >= 1
    assert stats.nodes_down == 0
    rows = Rows(len(keys), BLOCK)
    result = await tier.load(keys, rows.rows())
    assert set(result.loaded) == set(keys), "the node serves again"
    check_loaded(rows, keys, result.loaded)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_require_at_open_fails_fast_and_leaves_nothing(thawed: ValkeyCluster) -> None:
    cluster = thawed
    cluster.freeze(1)
    config = config_for(cluster, require_at_open=True, connect_timeout_s=0.5)
    fds = _fds()
    t0 = time.monotonic()
    with pytest.raises(TierIOError) as info:
        await ClusterTier.open(config, NAMESPACE, block_bytes=BLOCK)
    took = time.monotonic() - t0
    assert info.value.errno == errno.ETIMEDOUT, info.value
    assert f"127.0.0.1:{cluster.ports[1]}" in str(info.value)
    assert took < 2 * config.connect_timeout_s + config.timeout_s, f"it took {took:.1f} s"
    await asyncio.sleep(0.1)  # closed transports go on the next loop turns
    assert not [t for t in asyncio.all_tasks() if "kvtier-cluster" in t.get_name()]
    assert _fds() <= fds, "a connection of the failed open is still open"


async def test_every_node_frozen_opens_with_every_block_a_miss(
    thawed: ValkeyCluster, open_cluster_tier: OpenCluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = thawed
    for i in range(3):
        cluster.freeze(i)
    t0 = time.monotonic()
    tier: ClusterTier = await open_cluster_tier(cluster, connect_timeout_s=0.5, backoff_max_s=0.2)
    assert time.monotonic() - t0 < 2.0
    stats = tier.statistics()
    assert (stats.nodes, stats.nodes_down, stats.outages) == (0, 3, 1)
    assert sum(r.levelno == logging.WARNING for r in caplog.records if r.name == _LOG) == 1
    keys = block_keys(12, salt=42)
    stored = await tier.store(keys, Rows(12, BLOCK).fill(keys).rows())
    assert set(stored.failed) == set(keys)
    result = await tier.load(keys, Rows(12, BLOCK).rows())
    assert set(result.missing) == set(keys)
    assert all(isinstance(e, TierIOError) for e in result.missing.values())
    assert tier.statistics().round_trips == 0

    cluster.thaw()
    await asyncio.to_thread(cluster.wait_ok)
    await until_stored(tier, keys)
    stats = tier.statistics()
    assert stats.nodes == 3
    assert stats.nodes_down == 0
    assert stats.recoveries >= 1
    rows = Rows(12, BLOCK)
    result = await tier.load(keys, rows.rows())
    assert list(result.loaded) == keys
    check_loaded(rows, keys, result.loaded)


async def test_a_frozen_single_server(single_server: StartServer) -> None:
    server = single_server()
    server.freeze(0)
    try:
        tier = await ClusterTier.open(
            config_for(server, connect_timeout_s=0.5, backoff_max_s=0.2),
            NAMESPACE,
            block_bytes=BLOCK,
        )
        assert tier.statistics().nodes_down == 1
    finally:
        server.thaw()
    try:
        keys = block_keys(4, salt=43)
        await until_stored(tier, keys)
        stats = tier.statistics()
        assert (stats.outages, stats.recoveries, stats.nodes_down) == (1, 1, 0)
    finally:
        await tier.aclose()
