"""Stores on the tier's own connections (``direct_writes``) against stores through redis-py.

Both paths write the same value (header, then the row) that both load paths
read back; a SET answered with ASK during a migration is written again through
redis-py, which follows it; a full server (``noeviction``) refuses a store with
a :class:`~kvtier.errors.CapacityError` on either path.
"""

from __future__ import annotations

import pytest

from kvtier.errors import CapacityError, KVTierError
from kvtier.testing.tier import Rows, block_keys, pattern
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.block_format import HEADER_BYTES, decode_header
from kvtier.tiers.cluster import ClusterTier

from .conftest import NAMESPACE, OpenCluster, StartServer, config_for
from .test_faults import check_loaded
from .test_resharding import keys_in_one_slot, setslot

DIRECT = {"direct_writes": True, "direct_reads": True}
REDIS_PY = {"direct_writes": False, "direct_reads": False}


@pytest.mark.parametrize(
    ("writer", "reader"),
    [(DIRECT, REDIS_PY), (REDIS_PY, DIRECT)],
    ids=["direct-write-redis-py-read", "redis-py-write-direct-read"],
)
@pytest.mark.parametrize("block", [8192, (5 << 19) + 512], ids=["8KiB", "2.5MiB"])
async def test_either_path_writes_what_either_path_reads(
    valkey_cluster: ValkeyCluster,
    open_cluster_tier: OpenCluster,
    writer: dict[str, bool],
    reader: dict[str, bool],
    block: int,
) -> None:
    config = config_for(valkey_cluster)  # one tenant for both tiers
    prefix = config.tenant_prefix
    writing: ClusterTier = await open_cluster_tier(
        valkey_cluster, block_bytes=block, tenant_prefix=prefix, **writer
    )
    reading: ClusterTier = await open_cluster_tier(
        valkey_cluster, block_bytes=block, tenant_prefix=prefix, **reader
    )
    keys = block_keys(24, salt=61)
    stored = await writing.store(keys, Rows(len(keys), block).fill(keys).rows())
    assert list(stored.stored) == keys, stored.failed

    value = await writing.client.get(writing.key_of(keys[0]))
    assert len(value) == HEADER_BYTES + block
    header = decode_header(memoryview(value))
    assert (header.key, header.namespace, header.payload_bytes) == (keys[0], NAMESPACE, block)
    assert value[HEADER_BYTES:] == pattern(keys[0], block)

    rows = Rows(len(keys), block)
    loaded = await reading.load(keys, rows.rows())
    assert list(loaded.loaded) == keys, loaded.missing
    check_loaded(rows, keys, loaded.loaded)
    plans, _ = writing._client.plan([writing.key_of(k) for k in keys], HEADER_BYTES + block)
    assert writing.statistics().round_trips == len(plans), "no value was sent twice"


async def test_a_set_answered_with_ask_is_written_through_redis_py(
    private_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    cluster = private_cluster
    tier: ClusterTier = await open_cluster_tier(cluster, **DIRECT)
    slot, fresh = keys_in_one_slot(tier, cluster.ports[0], 6)
    setslot(cluster, [1], slot, "importing", cluster.node_id(0))
    setslot(cluster, [0], slot, "migrating", cluster.node_id(1))
    # The source lacks these keys: it answers the direct SETs with ASK, and
    # redis-py writes them on the target (ASKING first).
    stored = await tier.store(fresh, Rows(len(fresh), tier.block_bytes).fill(fresh).rows())
    assert list(stored.stored) == fresh, stored.failed
    assert cluster.cli(1, "cluster", "countkeysinslot", str(slot)).strip() == str(len(fresh))
    assert cluster.cli(0, "cluster", "countkeysinslot", str(slot)).strip() == "0"
    rows = Rows(len(fresh), tier.block_bytes)
    loaded = await tier.load(fresh, rows.rows())
    assert list(loaded.loaded) == fresh, loaded.missing
    check_loaded(rows, fresh, loaded.loaded)
    stats = tier.statistics()
    assert stats.redirections == 0
    assert stats.store_failures == 0


@pytest.mark.parametrize("options", [DIRECT, REDIS_PY], ids=["direct", "redis-py"])
async def test_a_full_server_refuses_stores_with_a_capacity_error(
    single_server: StartServer, open_cluster_tier: OpenCluster, options: dict[str, bool]
) -> None:
    server = single_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    block = 64 << 10
    tier: ClusterTier = await open_cluster_tier(server, block_bytes=block, **options)
    keys = block_keys(96, salt=62)  # about 6.7 MB of values into 3 MB
    stored: list[bytes] = []
    failed: dict[bytes, KVTierError] = {}
    for start in range(0, len(keys), 16):
        part = keys[start : start + 16]
        result = await tier.store(part, Rows(len(part), block).fill(part).rows())
        stored.extend(result.stored)
        failed.update(result.failed)
    assert stored, "the first blocks fit"
    assert failed, "the server is full"
    for k, err in failed.items():
        assert isinstance(err, CapacityError), f"{k.hex()}: {err!r}"
    rows = Rows(len(stored), block)
    loaded = await tier.load(stored, rows.rows())
    assert list(loaded.loaded) == stored, loaded.missing
    check_loaded(rows, stored, loaded.loaded)
    stats = tier.statistics()
    assert stats.store_failures == len(failed)
    assert stats.connection_errors == stats.timeouts == 0
