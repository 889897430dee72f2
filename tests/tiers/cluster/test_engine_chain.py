"""The engine driving the cluster tier in its chain, on real Valkey servers.

CPU -> cluster and CPU -> file -> cluster; two engines in two processes on one
cluster; write-back; blocks that vanish or are damaged on the server; a node
SIGKILLed under engine traffic. Every block a load reports is checked byte for
byte against what was stored under its key.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier import FileTierConfig, KVLayout, KVTierConfig, TierIOError, chain_keys
from kvtier.config import ClusterTierConfig
from kvtier.engine import Engine
from kvtier.testing.valkey import ValkeyCluster

from .conftest import OpenCluster, config_for

NUM_BLOCKS = 64
ROW = 4096
"""Bytes of one block: one fp16 tensor of 16 x 2 x 64 per block."""


def make_kv() -> list[torch.Tensor]:
    return [torch.zeros(NUM_BLOCKS, 16, 2, 64, dtype=torch.float16)]


def layout_of(kv: list[torch.Tensor]) -> KVLayout:
    return KVLayout.from_tensors(kv, model_id="chain", block_tokens=4, num_blocks=NUM_BLOCKS)


def content(key: bytes) -> np.ndarray:
    """The bytes every test stores under ``key``: derived from the key alone."""
    return np.frombuffer(hashlib.shake_128(key).digest(ROW), dtype=np.uint8)


def put(kv: list[torch.Tensor], blocks: list[int], keys: list[bytes]) -> None:
    flat = kv[0].view(torch.uint8).view(NUM_BLOCKS, ROW)
    for b, k in zip(blocks, keys, strict=True):
        flat[b] = torch.from_numpy(content(k).copy())


def holds(kv: list[torch.Tensor], block: int, key: bytes) -> bool:
    flat = kv[0].view(torch.uint8).view(NUM_BLOCKS, ROW)
    return bool(np.array_equal(flat[block].numpy(), content(key)))


def keys_for(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


@asynccontextmanager
async def engine_on(
    cluster: ClusterTierConfig,
    *,
    cpu_rows: int = 8,
    file_root: Path | None = None,
    file_policy: str = "write_through",
) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    kv = make_kv()
    file_tier = None
    if file_root is not None:
        file_tier = FileTierConfig(
            root=file_root, bytes_to_use=64 * (ROW + 4096) + 4096, write_policy=file_policy
        )
    config = KVTierConfig(
        cpu_bytes_to_use=cpu_rows * ROW, file_tier=file_tier, cluster_tier=cluster
    )
    engine = await Engine.open(config, layout_of(kv), kv)
    try:
        yield engine, kv
    finally:
        await engine.aclose()


async def store_keys(engine: Engine, kv: list[torch.Tensor], keys: list[bytes]) -> None:
    blocks = list(range(len(keys)))
    put(kv, blocks, keys)
    summary = await engine.store(keys, blocks)
    assert summary.dropped == 0
    await engine.flush()


async def load_checked(engine: Engine, kv: list[torch.Tensor], keys: list[bytes]) -> int:
    """Load ``keys`` into blocks 32.. and check every block reported loaded."""
    dst = list(range(32, 32 + len(keys)))
    kv[0].view(torch.uint8)[32 : 32 + len(keys)].zero_()
    n = await engine.load(keys, dst)
    for b, k in zip(dst[:n], keys[:n], strict=True):
        assert holds(kv, b, k), f"wrong bytes served for {k.hex()}"
    return n


def lookups_add_up(engine: Engine) -> None:
    st = engine.statistics()
    hits = sum(tier.lookup_hits for tier in st.tiers.values())
    assert hits + st.lookup_misses == st.lookups


async def test_cpu_then_cluster_streams_and_loads(valkey_cluster: ValkeyCluster) -> None:
    cluster = config_for(valkey_cluster)
    async with engine_on(cluster, cpu_rows=8) as (engine, kv):
        keys = keys_for(engine, 24, salt=1)
        # More blocks than CPU rows: they stream through the rows to the cluster.
        await store_keys(engine, kv, keys)
        st = engine.statistics()
        assert list(st.tiers) == ["cpu", "cluster"]
        assert st.tiers["cluster"].written_blocks == 24
        assert st.tiers["cluster"].statistics.stores == 24
        assert engine.lookup(keys) == 24
        st = engine.statistics()
        assert st.tiers["cluster"].lookup_hits == 16  # the CPU tier kept the last 8
        assert st.tiers["cpu"].lookup_hits == 8
        lookups_add_up(engine)
        assert await load_checked(engine, kv, keys[:8]) == 8
        tier = engine.statistics().tiers["cluster"]
        assert (tier.read_blocks, tier.read_bytes, tier.read_failures) == (8, 8 * ROW, 0)
        # The tier's own record: blocks, bytes, hits, misses, verification
        # failures, round trips.
        own = tier.statistics
        assert own.round_trips > 0
        assert (own.blocks, own.hits, own.misses) == (24, 8, 0)
        assert (own.bytes_written, own.bytes_read) == (24 * ROW, 8 * ROW)
        assert own.verification_failures == 0


async def test_a_load_larger_than_the_cpu_tier_streams_from_the_cluster(
    valkey_cluster: ValkeyCluster,
) -> None:
    cluster = config_for(valkey_cluster)
    async with engine_on(cluster) as (first, kv1), engine_on(cluster) as (second, kv2):
        keys = keys_for(first, 40, salt=6)
        await store_keys(first, kv1, keys)  # 40 blocks through 8 CPU rows
        assert await second.refresh(keys) == 40
        assert second.statistics().tiers["cpu"].statistics.ready == 0
        # The second engine's 8 rows take the blocks window after window.
        assert await second.load(keys, list(range(40))) == 40
        assert all(holds(kv2, b, k) for b, k in enumerate(keys))
        st = second.statistics()
        promoted, pinned = st.tiers["cluster"].read_blocks, st.tiers["cpu"].statistics.pinned
        assert (promoted, st.front.load_shortfalls, pinned) == (40, 0, 0)


async def test_a_second_engine_loads_through_refresh(valkey_cluster: ValkeyCluster) -> None:
    cluster = config_for(valkey_cluster)
    async with engine_on(cluster) as (first, kv1), engine_on(cluster) as (second, kv2):
        keys = keys_for(first, 6, salt=2)
        await store_keys(first, kv1, keys)
        assert second.lookup(keys) == 0  # a peer's blocks: unknown until refreshed
        assert await second.refresh(keys) == 6
        assert await load_checked(second, kv2, keys) == 6
        st = second.statistics()
        assert st.tiers["cluster"].lookup_hits == 6
        assert st.tiers["cluster"].statistics.exists_queries == 6
        lookups_add_up(second)


@pytest.mark.parametrize("promote", [None, False], ids=["promote_to_file", "no_promotion"])
async def test_cpu_file_cluster_promotes_by_policy(
    valkey_cluster: ValkeyCluster, tmp_path: Path, promote: bool | None
) -> None:
    cluster = config_for(valkey_cluster, promote_to_file=promote)
    async with (
        engine_on(cluster, file_root=tmp_path / "a") as (first, kv1),
        engine_on(cluster, file_root=tmp_path / "b") as (second, kv2),
    ):
        keys = keys_for(first, 6, salt=3)
        await store_keys(first, kv1, keys)
        st = first.statistics()
        assert st.tiers["file"].statistics.blocks == 6
        assert st.tiers["cluster"].statistics.stores == 6
        assert await second.refresh(keys) == 6
        assert await load_checked(second, kv2, keys) == 6
        await second.flush()
        st = second.statistics()
        assert st.tiers["cluster"].read_blocks == 6
        file = st.tiers["file"]
        promoted = 6 if promote is None else 0
        assert (file.statistics.blocks, file.written_blocks) == (promoted, promoted)
        lookups_add_up(second)


async def test_cluster_write_back_on_eviction_and_close(valkey_cluster: ValkeyCluster) -> None:
    cluster = config_for(valkey_cluster, write_policy="write_back")
    async with engine_on(cluster, cpu_rows=4) as (first, kv1):
        keys = keys_for(first, 8, salt=4)
        await store_keys(first, kv1, keys[:4])
        st = first.statistics()
        assert st.tiers["cluster"].statistics.stores == 0
        await store_keys(first, kv1, keys[4:])
        tier = first.statistics().tiers["cluster"]
        assert tier.write_backs == 4  # the first four were evicted, written back first
        assert tier.statistics.stores == 4
    # The clean close wrote the rest.
    async with engine_on(cluster) as (second, kv2):
        assert await second.refresh(keys) == 8
        assert await load_checked(second, kv2, keys) == 8


async def test_vanished_and_damaged_blocks_are_misses(
    valkey_cluster: ValkeyCluster, open_cluster_tier: OpenCluster
) -> None:
    cluster = config_for(valkey_cluster)
    async with engine_on(cluster, cpu_rows=4) as (engine, kv):
        keys = keys_for(engine, 12, salt=5)
        await store_keys(engine, kv, keys)
        raw = await open_cluster_tier(
            valkey_cluster,
            namespace=engine.namespace,
            block_bytes=ROW,
            tenant_prefix=cluster.tenant_prefix,
        )
        await raw.client.set(raw.key_of(keys[5]), b"not a block")
        await raw.client.delete(raw.key_of(keys[2]))
        assert engine.lookup(keys) == 12  # the presence set does not know yet
        assert await load_checked(engine, kv, keys[:8]) == 2  # a miss, not an error
        st = engine.statistics()
        assert st.tiers["cluster"].statistics.vanished == 1
        assert st.front.load_shortfalls == 6
        assert engine.lookup(keys) == 2
        # 5 blocks, or 2 when the first load read keys[5] ahead (and dropped it) already.
        hits = engine.lookup(keys[3:8])
        assert await load_checked(engine, kv, keys[3 : 3 + hits]) == 2  # stops at the damaged one
        st = engine.statistics()
        assert st.tiers["cluster"].statistics.verification_failures == 1
        await engine.flush()
        assert engine.statistics().tiers["cpu"].statistics.pinned == 0


async def test_no_node_answers_at_open(tmp_path: Path) -> None:
    cluster = ClusterTierConfig(
        nodes=["127.0.0.1:1"], connect_timeout_s=0.2, timeout_s=0.2, require_at_open=True
    )
    with pytest.raises(TierIOError):
        async with engine_on(cluster, file_root=tmp_path / "t"):
            pass  # pragma: no cover


async def test_the_engine_serves_while_no_node_answers(tmp_path: Path) -> None:
    """The cache is optional: with no node answering the engine opens, and its
    cluster tier misses every block (no error, no wait) while the others serve."""
    cluster = ClusterTierConfig(nodes=["127.0.0.1:1"], connect_timeout_s=0.2, timeout_s=0.2)
    async with engine_on(cluster, cpu_rows=4, file_root=tmp_path / "t") as (engine, kv):
        keys = keys_for(engine, 12, salt=7)
        await store_keys(engine, kv, keys)
        assert await load_checked(engine, kv, keys) == 12  # from the CPU and file tiers
        tier = engine.statistics().tiers["cluster"]
        assert (tier.statistics.nodes_down, tier.statistics.outages) == (1, 1)
        assert tier.statistics.stores == 0
        assert tier.statistics.round_trips == 0  # every block refused at once, no I/O
        assert tier.statistics.refused_in_backoff > 0
        assert tier.write_failures == 12  # the chain counted each block not written


_PEER = textwrap.dedent(
    """
    import asyncio, hashlib, sys
    import numpy as np, torch
    from kvtier import Engine, KVLayout, KVTierConfig, chain_keys

    async def main() -> None:
        config = KVTierConfig.model_validate_json(sys.argv[1])
        kv = [torch.zeros(64, 16, 2, 64, dtype=torch.float16)]
        layout = KVLayout.from_tensors(kv, model_id="chain", block_tokens=4, num_blocks=64)
        async with await Engine.open(config, layout, kv) as engine:
            tokens = list(range(600_000, 600_000 + 10 * engine.block_tokens))
            keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
            flat = kv[0].view(torch.uint8).view(64, 4096)
            for b, k in enumerate(keys):
                data = np.frombuffer(hashlib.shake_128(k).digest(4096), dtype=np.uint8)
                flat[b] = torch.from_numpy(data.copy())
            await engine.store(keys, list(range(10)))
            await engine.flush()
            st = engine.statistics()
            assert st.tiers["cluster"].statistics.stores == 10, st
        print("stored")

    asyncio.run(main())
    """
)


async def test_two_engines_in_two_processes(valkey_cluster: ValkeyCluster) -> None:
    cluster = config_for(valkey_cluster)
    config = KVTierConfig(cpu_bytes_to_use=16 * ROW, cluster_tier=cluster)
    peer = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _PEER, config.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert peer.returncode == 0, peer.stdout + peer.stderr
    async with engine_on(cluster, cpu_rows=16) as (engine, kv):
        tokens = list(range(600_000, 600_000 + 10 * engine.block_tokens))
        keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
        assert await engine.refresh(keys) == 10
        assert await load_checked(engine, kv, keys) == 10  # byte for byte


STALL_S = 30.0
"""Far above what one call takes with a node dead (the client's bounds: 0.5 s a
pipeline, 0.3 s a connect): past it, the call stalled."""


async def test_node_killed_under_engine_traffic(private_cluster: ValkeyCluster) -> None:
    cluster = config_for(
        private_cluster,
        timeout_s=0.5,
        connect_timeout_s=0.3,
        backoff_initial_s=0.05,
        backoff_max_s=0.2,
    )
    served = {"before": 0, "after": 0}
    async with engine_on(cluster, cpu_rows=6) as (engine, kv):
        requests = [keys_for(engine, 4, salt=100 + s) for s in range(12)]
        for i in range(72):
            if i == 36:
                await asyncio.to_thread(private_cluster.kill, 0)
            keys = requests[(i * 5) % len(requests)]
            hits = engine.lookup(keys)
            # Each call bounded: a stall fails here, naming the call, rather than
            # as the suite's timeout with no task's stack.
            async with asyncio.timeout(STALL_S):
                n = await load_checked(engine, kv, keys[:hits])  # never an error, never wrong
            served["before" if i < 36 else "after"] += n
            if n < len(keys):
                blocks = list(range(len(keys)))
                put(kv, blocks, keys)
                async with asyncio.timeout(STALL_S):
                    await engine.store(keys, blocks)
        async with asyncio.timeout(STALL_S):
            await engine.flush()
        st = engine.statistics()
        assert st.tiers["cpu"].statistics.pinned == 0
        assert st.front.in_flight == 0
        own = st.tiers["cluster"].statistics
        faults = own.connection_errors + own.refused_in_backoff
        assert faults + own.timeouts > 0
        lookups_add_up(engine)
    assert served["before"] > 0
    assert served["after"] > 0  # the engine kept serving from what it still had
