"""The cluster tier while slots move between nodes: ASK during a migration, MOVED after.

A slot half migrated by hand (``CLUSTER SETSLOT IMPORTING/MIGRATING`` and
``MIGRATE`` of some of its keys), and a ``valkey-cli --cluster reshard`` of
thousands of slots run while the tier stores and loads. Every block a load
reports holds its own bytes; a block that does not load failed with a typed
:class:`~kvtier.errors.TierIOError` (its transfer hit a redirect the client
did not follow), never with wrong bytes, and never as absent while it is on
the cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from redis.crc import key_slot

from kvtier.errors import TierIOError
from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.base import LoadResult
from kvtier.tiers.cluster import ClusterTier
from kvtier.tiers.cluster._client import PartsConnection

from .conftest import BLOCK, OpenCluster
from .test_faults import check_loaded, store_all


def slot_of(tier: ClusterTier, key: bytes) -> int:
    return int(key_slot(tier.key_of(key)))


def keys_in_one_slot(tier: ClusterTier, port: int, n: int) -> tuple[int, list[bytes]]:
    """A slot served by the node on ``port`` and ``n`` block keys that hash to it."""
    by_slot: dict[int, list[bytes]] = {}
    for salt in range(8):
        for k in block_keys(1 << 16, salt=100 + salt):
            by_slot.setdefault(slot_of(tier, k), []).append(k)
    for slot, keys in by_slot.items():
        if len(keys) >= n and tier.client.get_node_from_key(tier.key_of(keys[0])).port == port:
            return slot, keys[:n]
    raise AssertionError(f"no slot of port {port} with {n} keys")


async def load_checked(tier: ClusterTier, keys: list[bytes]) -> LoadResult:
    """Load ``keys``: every loaded block holds its bytes; every other one a typed I/O failure."""
    rows = Rows(len(keys), BLOCK)
    result = await tier.load(keys, rows.rows())
    check_loaded(rows, keys, result.loaded)
    for k, err in result.missing.items():
        assert isinstance(err, TierIOError), f"{k.hex()}: {err!r} while it is on the cluster"
    return result


def setslot(cluster: ValkeyCluster, nodes: Iterable[int], slot: int, *args: str) -> None:
    for i in nodes:
        out = cluster.cli(i, "cluster", "setslot", str(slot), *args)
        assert out.strip() == "OK", f"node {i}: {out!r}"


async def test_a_half_migrated_slot_redirects_with_ask_then_moved(
    private_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    cluster = private_cluster
    tier: ClusterTier = await open_cluster_tier(cluster)
    slot, in_slot = keys_in_one_slot(tier, cluster.ports[0], 12)
    old, fresh = in_slot[:8], in_slot[8:]
    others = block_keys(24, salt=3)
    await store_all(tier, old + others)
    src, dst = cluster.node_id(0), cluster.node_id(1)
    setslot(cluster, [1], slot, "importing", src)
    setslot(cluster, [0], slot, "migrating", dst)
    moved = [tier.key_of(k).decode() for k in old[:4]]
    out = cluster.cli(
        0, "migrate", "127.0.0.1", str(cluster.ports[1]), "", "0", "5000", "keys", *moved
    )
    assert out.strip() == "OK", out
    assert cluster.cli(1, "cluster", "countkeysinslot", str(slot)).strip() == "4"

    # Mid-migration: half the slot's keys answer ASK from the source.
    during = await load_checked(tier, old + others)
    assert set(others) <= set(during.loaded), "keys of other slots are not disturbed"
    # A new key of the migrating slot goes to the target (ASK for a key the source lacks).
    stored = await tier.store(fresh, Rows(len(fresh), BLOCK).fill(fresh).rows())
    for k, err in stored.failed.items():
        assert isinstance(err, TierIOError), f"{k.hex()}: {err!r}"

    # The migration completes; the slot now belongs to node 1: MOVED.
    out = cluster.cli(0, "migrate", "127.0.0.1", str(cluster.ports[1]), "", "0", "5000", "keys",
                      *[tier.key_of(k).decode() for k in old[4:]])  # fmt: skip
    assert out.strip() in ("OK", "NOKEY"), out
    setslot(cluster, [0, 1, 2], slot, "node", dst)
    after = await load_checked(tier, old + list(stored.stored) + others)
    if after.missing:  # a redirect left over from the move is one transfer's failure
        after = await load_checked(tier, old + list(stored.stored) + others)
    assert not after.missing, after.missing
    assert tier.client.get_node_from_key(tier.key_of(old[0])).port == cluster.ports[1]
    # Values go out as Parts (header, then the row): every node the client
    # learned of, at open or from a redirect, packs them.
    assert all(n.connection_class is PartsConnection for n in tier.client.get_nodes())
    stats = tier.statistics()
    assert stats.verification_failures == 0
    assert stats.connection_errors == 0
    print(f"during: {len(during.loaded)} loaded, {len(during.missing)} failed; {stats}")


async def test_reshard_while_storing_and_loading(
    private_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    cluster = private_cluster
    tier: ClusterTier = await open_cluster_tier(cluster)
    keys = block_keys(512, salt=11)
    await store_all(tier, keys)
    on_src = [
        k for k in keys if tier.client.get_node_from_key(tier.key_of(k)).port == cluster.ports[0]
    ]
    assert on_src
    live = list(keys)
    started, resharded = asyncio.Event(), asyncio.Event()
    rounds_during = 0
    failures = 0

    async def traffic() -> None:
        nonlocal rounds_during, failures
        r = 0
        while not resharded.is_set():
            started.set()
            fresh = block_keys(16, salt=(40 + r) % 256)
            r += 1
            out = await tier.store(fresh, Rows(16, BLOCK).fill(fresh).rows())
            for k, err in out.failed.items():
                assert isinstance(err, TierIOError), f"{k.hex()}: {err!r}"
            live.extend(k for k in out.stored if k not in live)
            result = await load_checked(tier, live)
            failures += len(result.missing)
            rounds_during += 1

    running = asyncio.create_task(traffic())
    await started.wait()
    await asyncio.to_thread(cluster.reshard, 0, 1, 3000)
    resharded.set()
    await asyncio.wait_for(running, 120)
    assert rounds_during >= 1
    # Everything stored is served from its new node (a MOVED left over may fail
    # the first round's transfers; the second must not).
    final = await load_checked(tier, live)
    if final.missing:
        final = await load_checked(tier, live)
    assert set(final.loaded) == set(live)
    moved = [
        k for k in on_src if tier.client.get_node_from_key(tier.key_of(k)).port == cluster.ports[1]
    ]
    assert moved, "the reshard moved some of the stored blocks"
    stats = tier.statistics()
    assert stats.verification_failures == 0
    # redis-py closed every connection on each 5th MOVED by default, failing
    # the pipelines in flight to the other nodes: 10 000 to 30 000 block loads
    # per run here before the tier set reinitialize_steps=0.
    assert stats.connection_errors == 0
    print(f"rounds during the reshard: {rounds_during}, failed block loads: {failures}; {stats}")
