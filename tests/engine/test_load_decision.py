"""The chain's load-or-recompute decision through the Engine, over a file tier made slow.

Every I/O of the file tier below completes late (a ``latency`` fault on
all of them, :mod:`kvtier.testing.faults`), so a promotion costs far more
than the recompute cost the config sets: once the tier's first reads have
measured it, ``lookup`` stops the prefix at the CPU tier instead of
promising blocks that would arrive after their recompute.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from kvtier import Engine, KVLayout, KVTierConfig, chain_keys
from kvtier.config import FileTierConfig
from kvtier.testing.faults import FaultPlan, FaultyIOEngine
from kvtier.transfer.io_engine import open_io_engine

NUM_BLOCKS = 64
CPU_ROWS = 4


@asynccontextmanager
async def slow_file_engine(
    tmp_path: Path, recompute: float | None
) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    kv = [torch.zeros(2, NUM_BLOCKS, 4, 2, 16, dtype=torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, model_id="decide", block_tokens=4, num_blocks=NUM_BLOCKS)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(
        cpu_bytes_to_use=CPU_ROWS * row,
        file_tier=FileTierConfig(root=tmp_path / "tier", bytes_to_use=64 * (row + 4096) + 4096),
        recompute_s_per_block=recompute,
    )
    slow = FaultyIOEngine(
        await open_io_engine("auto", queue_depth=8),
        FaultPlan(seed=3, rates={"latency": 1.0}, latency_s=0.05),
    )
    engine = await Engine.open(config, layout, kv, io_engine=slow)
    try:
        yield engine, kv
    finally:
        await engine.aclose()
        await slow.aclose()


def keys(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


@pytest.mark.parametrize(
    ("recompute", "declines"), [(1e-5, True), (None, False)], ids=["cost-set", "no-cost"]
)
async def test_a_tier_slower_than_recompute_is_left_out_of_the_prefix(
    tmp_path: Path, recompute: float | None, declines: bool
) -> None:
    async with slow_file_engine(tmp_path, recompute) as (engine, _kv):
        old = keys(engine, 4, salt=1)
        await engine.store(old, [0, 1, 2, 3])
        await engine.flush()  # written through to the file tier
        for salt in (2, 3):  # then pushed out of the CPU tier
            await engine.store(keys(engine, 4, salt), [4, 5, 6, 7])
        await engine.flush()
        # The tier is not measured yet: its blocks are promised, and loaded.
        assert engine.lookup(old[:2]) == 2
        assert await engine.load(old[:2], [10, 11]) == 2
        chain = engine._chain.statistics()
        assert chain.tiers["file"].read_seconds_per_block is not None
        assert chain.tiers["file"].read_seconds_per_block >= 0.01  # the injected latency
        # Now measured: 50 ms a block against 10 us to recompute.
        hot = keys(engine, 4, salt=3)[:2]  # in CPU rows
        prefix = [*hot, *old[2:]]
        got = engine.lookup(prefix)
        after = engine._chain.statistics()
        if declines:
            assert got == 2  # the CPU blocks; the file's are recomputed
            assert after.loads_declined == 1
            assert after.tiers["file"].loads_declined == 1
        else:
            assert got == 4
            assert after.loads_declined == 0
        assert await engine.load(prefix[:got], list(range(20, 20 + got))) == got
