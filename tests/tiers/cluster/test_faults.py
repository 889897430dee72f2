"""The cluster tier under faults on real servers: peers, dead nodes, foreign values, eviction."""

from __future__ import annotations

import asyncio
import errno
import signal
import subprocess
import sys
import textwrap

import pytest

from kvtier.errors import BlockNotFoundError, IntegrityError, NamespaceMismatchError, TierIOError
from kvtier.testing.tier import Rows, block_keys, pattern
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.cluster import ClusterTier

from .conftest import BLOCK, OpenCluster, StartServer, config_for


async def store_all(tier: ClusterTier, keys: list[bytes]) -> None:
    rows = Rows(len(keys), tier.block_bytes).fill(keys)
    result = await tier.store(keys, rows.rows())
    assert list(result.stored) == keys, result.failed


def check_loaded(rows: Rows, keys: list[bytes], loaded: tuple[bytes, ...]) -> None:
    """Every block reported loaded holds its own bytes: no wrong byte is ever served."""
    index = {k: i for i, k in enumerate(keys)}
    for k in loaded:
        assert bytes(rows.row(index[k])) == pattern(k, rows.block_bytes), f"{k.hex()} is wrong"


_PEER = textwrap.dedent(
    """
    import asyncio, sys
    from kvtier.testing.tier import Rows, block_keys
    from kvtier.tiers.cluster import ClusterTier, ClusterTierConfig

    async def main() -> None:
        config = ClusterTierConfig.model_validate_json(sys.argv[1])
        tier = await ClusterTier.open(config, bytes(range(16)), block_bytes={block})
        keys = block_keys(12, salt=77)
        result = await tier.store(keys, Rows(12, {block}).fill(keys).rows())
        assert len(result.stored) == 12, result.failed
        await tier.aclose()

    asyncio.run(main())
    """
)


async def test_a_second_process_loads_what_the_first_stored(
    valkey_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    config = config_for(valkey_cluster)
    peer = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _PEER.format(block=BLOCK), config.model_dump_json()],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert peer.returncode == 0, peer.stderr.decode()[-2000:]
    tier: ClusterTier = await open_cluster_tier(valkey_cluster, tenant_prefix=config.tenant_prefix)
    keys = block_keys(12, salt=77)
    assert tier.lookup(keys) == 0, "nothing is known before a refresh"
    assert await tier.refresh(keys) == 12
    rows = Rows(12, BLOCK)
    result = await tier.load(keys, rows.rows())
    assert list(result.loaded) == keys
    check_loaded(rows, keys, result.loaded)
    assert tier.statistics().exists_queries == 12


async def test_other_tenants_and_namespaces_never_hit(
    valkey_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    a: ClusterTier = await open_cluster_tier(valkey_cluster)
    keys = block_keys(4, salt=5)
    await store_all(a, keys)
    other_tenant: ClusterTier = await open_cluster_tier(valkey_cluster)
    other_ns: ClusterTier = await open_cluster_tier(
        valkey_cluster, tenant_prefix=a.key_of(b"")[:-34].decode(), namespace=b"x" * 16
    )
    for tier in (other_tenant, other_ns):
        assert await tier.refresh(keys) == 0
        result = await tier.load(keys, Rows(4, BLOCK).rows())
        assert not result.loaded
        assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())


@pytest.mark.parametrize(
    "spoil", ["foreign", "truncated", "oversized", "other-namespace", "other-key"]
)
async def test_spoiled_values_are_counted_misses(
    valkey_cluster: ValkeyCluster, open_cluster_tier: OpenCluster, spoil: str
) -> None:
    tier: ClusterTier = await open_cluster_tier(valkey_cluster)
    keys = block_keys(3, salt=6)
    await store_all(tier, keys)
    rkey = tier.key_of(keys[1])
    value = await tier.client.get(rkey)
    if spoil == "foreign":
        await tier.client.set(rkey, b"some other client's value")
    elif spoil == "truncated":
        await tier.client.set(rkey, value[: HEADER_BYTES + BLOCK // 2])
    elif spoil == "oversized":  # longer than the reader's scratch and discard buffers
        await tier.client.set(rkey, value + bytes(200_000))
    elif spoil == "other-namespace":
        ns_tier: ClusterTier = await open_cluster_tier(
            valkey_cluster, namespace=b"y" * 16, tenant_prefix="spoil"
        )
        await store_all(ns_tier, [keys[1]])
        await tier.client.set(rkey, await ns_tier.client.get(ns_tier.key_of(keys[1])))
    else:
        await tier.client.set(rkey, await tier.client.get(tier.key_of(keys[0])))
    rows = Rows(3, BLOCK)
    result = await tier.load(keys, rows.rows())
    assert set(result.loaded) == {keys[0], keys[2]}
    check_loaded(rows, keys, result.loaded)
    err = result.missing[keys[1]]
    want = NamespaceMismatchError if spoil == "other-namespace" else IntegrityError
    assert isinstance(err, want), err
    stats = tier.statistics()
    assert stats.verification_failures == 1
    assert not tier.is_ready(keys[1])
    # A store puts the right value back (the key was forgotten).
    await store_all(tier, [keys[1]])
    again = await tier.load([keys[1]], Rows(1, BLOCK).rows())
    assert again.loaded == (keys[1],)


async def test_server_eviction_degrades_to_misses(
    single_server: StartServer, open_cluster_tier: OpenCluster
) -> None:
    server = single_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    block = 64 << 10
    tier: ClusterTier = await open_cluster_tier(server, block_bytes=block)
    keys = block_keys(160, salt=8)  # about 11 MB of values into 4 MB
    for start in range(0, len(keys), 16):
        part = keys[start : start + 16]
        stored = await tier.store(part, Rows(16, block).fill(part).rows())
        assert not stored.failed
    assert tier.lookup(keys) == len(keys), "the presence set is a hint: it still says all"
    rows = Rows(len(keys), block)
    result = await tier.load(keys, rows.rows())
    assert result.loaded
    assert result.missing
    assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
    check_loaded(rows, keys, result.loaded)
    stats = tier.statistics()
    assert stats.vanished == len(result.missing)
    assert stats.verification_failures == 0
    assert tier.lookup(keys) < len(keys), "vanished blocks are forgotten"


async def test_sigkill_of_a_node_during_stores_and_loads(
    private_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    tier: ClusterTier = await open_cluster_tier(
        private_cluster, timeout_s=0.5, connect_timeout_s=0.3, backoff_max_s=0.2
    )
    keys = block_keys(48, salt=9)
    await store_all(tier, keys)
    dead_port = private_cluster.ports[0]
    on_dead = {k for k in keys if tier.client.get_node_from_key(tier.key_of(k)).port == dead_port}
    assert on_dead
    assert len(on_dead) < len(keys)

    started = asyncio.Event()

    async def traffic(rounds: int, salt: int) -> list[int]:
        hits = []
        for r in range(rounds):
            started.set()
            fresh = block_keys(8, salt=salt + r)
            await tier.store(fresh, Rows(8, BLOCK).fill(fresh).rows())  # outcomes checked below
            rows = Rows(len(keys), BLOCK)
            result = await tier.load(keys, rows.rows())
            check_loaded(rows, keys, result.loaded)
            for k, err in result.missing.items():
                assert k in on_dead, f"{k.hex()} of a live node was missed: {err!r}"
                assert isinstance(err, (TierIOError, BlockNotFoundError)), err
            hits.append(len(result.loaded))
        return hits

    running = asyncio.create_task(traffic(12, 100))
    await started.wait()  # the kill lands in the middle of the first round's transfers
    private_cluster.kill(0)
    hits = await asyncio.wait_for(running, 60)
    assert hits[-1] == len(keys) - len(on_dead), "the live nodes' blocks keep loading"
    stats = tier.statistics()
    assert stats.connection_errors + stats.timeouts + stats.refused_in_backoff > 0
    assert stats.load_failures > 0
    # The tier keeps serving: a new round after the kill still hits the live nodes.
    final = await traffic(1, 200)
    assert final == [len(keys) - len(on_dead)]


async def test_a_load_timed_out_writes_nothing_into_its_rows_afterwards(
    private_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    """A node frozen (SIGSTOP) mid-load: its blocks time out, and when it wakes up
    and sends its replies, not a byte of them lands in the rows the load gave back."""
    block = 256 << 10
    tier: ClusterTier = await open_cluster_tier(
        private_cluster, block_bytes=block, timeout_s=0.5, backoff_max_s=0.2
    )
    keys = block_keys(24, salt=12)
    stored = await tier.store(keys, Rows(24, block).fill(keys).rows())
    assert list(stored.stored) == keys
    port = private_cluster.ports[0]
    frozen = {k for k in keys if tier.client.get_node_from_key(tier.key_of(k)).port == port}
    assert frozen
    proc = private_cluster.procs[0]
    assert proc is not None
    rows = Rows(24, block)
    rows.map.write(b"\xa5" * (24 * block))
    proc.send_signal(signal.SIGSTOP)
    try:
        result = await tier.load(keys, rows.rows())
    finally:
        proc.send_signal(signal.SIGCONT)
    check_loaded(rows, keys, result.loaded)
    assert set(result.missing) == frozen
    for err in result.missing.values():
        assert isinstance(err, TierIOError), err
        assert err.errno == errno.ETIMEDOUT, err
    await asyncio.sleep(0.5)  # the node answers now, to a connection the tier aborted
    for i, k in enumerate(keys):
        if k in frozen:
            assert bytes(rows.row(i)) == b"\xa5" * block, f"{k.hex()}'s row was written"
    again = await tier.load(sorted(frozen), Rows(len(frozen), block).rows())
    assert len(again.loaded) == len(frozen), "the node serves again after its backoff"
