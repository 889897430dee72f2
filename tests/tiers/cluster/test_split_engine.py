"""The cluster tier on the scheduler side of a split instance: whole rows, every rank's slice."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.processes import Children

from kvtier import KVLayout, KVTierConfig, chain_keys
from kvtier.engine import Engine
from kvtier.testing.valkey import ValkeyCluster
from kvtier.workers import WorkerGroup

from .conftest import config_for

WORKER = Path(__file__).resolve().parents[2] / "workers" / "_worker.py"
"""The worker process of tests/workers: blocks 0-7 seeded by its rank, ``check`` on stdin."""
WORLD = 2


def layout() -> KVLayout:
    kv = [torch.zeros(2, 16, 4, 64, dtype=torch.uint8)]  # as _worker.make_kv
    return KVLayout.from_tensors(
        kv, model_id="m", block_tokens=4, num_blocks=16, tp_rank=0, tp_size=WORLD
    )


@pytest.fixture
def children() -> Iterator[Children]:
    procs = Children()
    yield procs
    procs.kill_all()


async def line(proc: Any) -> dict[str, Any]:
    return await asyncio.wait_for(asyncio.to_thread(Children.line, proc), 30)


async def test_a_split_instance_loads_what_another_stored(
    valkey_cluster: ValkeyCluster, children: Children
) -> None:
    config = KVTierConfig(
        cpu_bytes_to_use=1 << 20, world_size=WORLD, cluster_tier=config_for(valkey_cluster)
    )
    keys: list[bytes] = []
    for instance in ("stores", "loads"):
        group = WorkerGroup.bind(WORLD)
        workers = [
            children.spawn(str(WORKER), group.address, r, WORLD, "serve") for r in range(WORLD)
        ]
        engine = await Engine.open(config, layout(), workers=group, worker_timeout=60)
        try:
            assert [(await line(p))["attached"] for p in workers] == [True] * WORLD
            keys = chain_keys(list(range(32)), engine.block_tokens, engine.namespace)[:4]
            if instance == "stores":
                assert (await engine.store(keys, [0, 1, 2, 3])).stored == 4
                await engine.flush()
                own = engine.statistics().tiers["cluster"].statistics
                assert own.stores == 4
                assert own.block_bytes >= WORLD * engine.layout.bytes_per_chunk
            else:
                assert engine.lookup(keys) == 0
                assert await engine.refresh(keys) == 4
                assert await engine.load(keys, [8, 9, 10, 11]) == 4
                for p in workers:
                    Children.tell(p, "check 0 8 4")
                # Every rank got its own slice back, through the cluster.
                assert [(await line(p))["same"] for p in workers] == [True] * WORLD
        finally:
            await engine.aclose()
        assert [(await line(p))["ending"] for p in workers] == ["stopped"] * WORLD
