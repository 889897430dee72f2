"""Thousands of mixed operations through the engine while the data plane fails.

Faults come from seeded wrappers around the real io_uring engine and the real
device copier (:mod:`kvtier.testing.faults`). After each run: every awaitable
resolved before its deadline, every error was typed, nothing is left pinned or
being written, the file tier's accounting equals the files on disk, and no
block ever loaded had bytes other than those stored for its key.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from support.slots import block_offsets

from kvtier.testing.faults import FaultPlan, FaultyDeviceTransfer, FaultyIOEngine
from kvtier.transfer.device import DeviceTransfer
from kvtier.transfer.io_engine import open_io_engine

sys.path.insert(0, str(Path(__file__).parent))
from workload import open_engine, serve, verify_everything

RUNS = [
    # (id, seed, write policy, rates)
    (
        "io-1pct",
        1,
        "write_through",
        {
            "eio": 0.01,
            "enospc": 0.01,
            "short_read": 0.01,
            "short_write": 0.01,
            "torn_write": 0.01,
            "latency": 0.01,
            "copy_fail": 0.01,
            "partial_copy": 0.01,
        },
    ),
    (
        "io-5pct-write-back",
        2,
        "write_back",
        {
            "eio": 0.05,
            "eacces": 0.02,
            "short_read": 0.03,
            "torn_write": 0.05,
            "latency": 0.05,
            "copy_fail": 0.03,
            "partial_copy": 0.03,
        },
    ),
    (
        "io-10pct",
        3,
        "write_through",
        {
            "eio": 0.1,
            "enospc": 0.05,
            "short_write": 0.05,
            "torn_write": 0.1,
            "latency": 0.05,
            "copy_fail": 0.05,
            "partial_copy": 0.05,
        },
    ),
]


@pytest.mark.parametrize(
    ("seed", "policy", "rates"), [r[1:] for r in RUNS], ids=[r[0] for r in RUNS]
)
async def test_faults_degrade_to_misses_and_never_serve_a_wrong_block(
    tmp_path: Path, seed: int, policy: str, rates: dict[str, float], report: dict[str, object]
) -> None:
    plan = FaultPlan(seed=seed, rates=rates, latency_s=0.005)
    ring = FaultyIOEngine(await open_io_engine("auto", queue_depth=8), plan)

    def wrap(inner: DeviceTransfer) -> DeviceTransfer:
        return FaultyDeviceTransfer(inner, plan)

    try:
        async with open_engine(
            tmp_path / "tier", write_policy=policy, io_engine=ring, wrap_transfer=wrap
        ) as (engine, kv):
            async with asyncio.timeout(120):
                tally = await serve(engine, kv, requests=700, seed=seed, cancel_rate=0.05)
                plan.enabled = False
                await engine.flush()
            assert tally.untyped == [], tally.untyped[:3]
            assert tally.wrong_blocks == 0
            st = engine.statistics()
            cpu, file = st.tiers["cpu"].statistics, st.tiers["file"].statistics
            assert st.front.in_flight == 0
            assert cpu.pinned == 0
            assert cpu.being_written == 0
            assert cpu.used == cpu.ready <= cpu.capacity
            (data,) = (tmp_path / "tier").glob("*/blocks.dat")
            # The slot file is exactly the budget; every resident block has a
            # valid header in it (evicted slots not yet reused may keep theirs).
            assert data.stat().st_size == file.capacity_bytes
            assert file.used_bytes == file.blocks * file.file_bytes
            assert file.blocks <= len(block_offsets(data.parent))
            async with asyncio.timeout(60):
                wrong_after = await verify_everything(engine, kv, tally.stored_keys)
            assert wrong_after == 0
            assert sum(plan.injected.values()) > 0
            ops = tally.stores + tally.loads + tally.lookups
            assert ops >= 1500
            report.update(
                operations=ops,
                cancelled=tally.cancelled,
                faults_injected=dict(plan.injected),
                typed_errors_seen=tally.errors,
                blocks_verified=tally.blocks_verified,
                wrong_blocks_served=tally.wrong_blocks + wrong_after,
                quarantined=file.quarantined,
                file_store_failures=file.store_failures,
            )
    finally:
        await ring.aclose()
