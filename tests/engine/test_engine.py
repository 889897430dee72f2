"""End-to-end tests of the engine over the CPU backend, a real CPU region and a real file tier."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import random
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import kvtier
from kvtier import (
    BlockNotFoundError,
    ClosedError,
    ConfigurationError,
    FileTierConfig,
    InvalidArgumentError,
    KVLayout,
    KVTierConfig,
    chain_keys,
)
from kvtier.engine import Engine
from kvtier.manager import ManagerStatistics
from kvtier.testing.faults import FaultPlan, FaultyIOEngine
from kvtier.transfer import _ring
from kvtier.transfer.io_engine import IOEngine, open_io_engine

NUM_BLOCKS = 96


def make_kv(kind: str = "kv_first") -> list[torch.Tensor]:
    if kind == "kv_first":
        return [torch.zeros(2, NUM_BLOCKS, 4, 2, 64, dtype=torch.float16) for _ in range(2)]
    return [torch.zeros(NUM_BLOCKS, 4, 2, 64, dtype=torch.float32)]


def fill(kv: list[torch.Tensor], blocks: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        v = t.view(torch.uint8)
        for b in blocks:
            if v.shape[0] == 2 and t.dim() == 5:
                v[:, b] = torch.randint(0, 256, v[:, b].shape, dtype=torch.uint8, generator=g)
            else:
                v[b] = torch.randint(0, 256, v[b].shape, dtype=torch.uint8, generator=g)


def snapshot(kv: list[torch.Tensor], blocks: list[int]) -> list[torch.Tensor]:
    out = []
    for t in kv:
        v = t.view(torch.uint8)
        for b in blocks:
            out.append((v[:, b] if t.dim() == 5 else v[b]).clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(bool(torch.equal(x, y)) for x, y in zip(a, b, strict=True))


@asynccontextmanager
async def engine_for(
    tmp_path: Path,
    *,
    cpu_rows: int = 16,
    file_rows: int | None = 64,
    bpc: int = 1,
    write_policy: str = "write_through",
    policy: str = "lru",
    kind: str = "kv_first",
    io_engine: str = "auto",
    recovery: str = "foreground",
    io: IOEngine | None = None,
) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    kv = make_kv(kind)
    layout = KVLayout.from_tensors(
        kv, model_id="test", block_tokens=4, blocks_per_chunk=bpc, num_blocks=NUM_BLOCKS
    )
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    file_tier = None
    if file_rows is not None:
        file_tier = FileTierConfig(
            root=tmp_path / "tier",
            bytes_to_use=file_rows * (row + 4096) + 4096,
            write_policy=write_policy,
            io_engine=io_engine,
            recovery=recovery,
        )
    config = KVTierConfig(
        cpu_bytes_to_use=cpu_rows * row,
        blocks_per_chunk=bpc,
        eviction_policy=policy,
        file_tier=file_tier,
    )
    engine = await Engine.open(config, layout, kv, io_engine=io)
    try:
        yield engine, kv
    finally:
        await engine.aclose()


def keys_for(engine: Engine, n: int, salt: int = 0) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


def assert_quiescent(engine: Engine) -> None:
    st = engine.statistics()
    assert st.tiers["cpu"].statistics.pinned == 0
    assert st.tiers["cpu"].statistics.being_written == 0
    assert st.front.in_flight == 0
    assert st.tiers["cpu"].statistics.used <= st.tiers["cpu"].statistics.capacity


@pytest.mark.parametrize("kind", ["kv_first", "block_first"])
@pytest.mark.parametrize("bpc", [1, 3])
async def test_round_trip_through_cpu(tmp_path: Path, kind: str, bpc: int) -> None:
    async with engine_for(tmp_path, file_rows=None, bpc=bpc, kind=kind) as (engine, kv):
        keys = keys_for(engine, 4)
        src = list(range(4 * bpc))
        fill(kv, src, seed=1)
        want = snapshot(kv, src)
        summary = await engine.store(keys, src)
        assert (summary.stored, summary.present, summary.dropped) == (4, 0, 0)
        assert engine.lookup(keys) == 4
        dst = list(range(30, 30 + 4 * bpc))
        assert await engine.load(keys, dst) == 4
        assert same(snapshot(kv, dst), want)
        again = await engine.store(keys, src)
        assert (again.stored, again.present) == (0, 4)
        assert_quiescent(engine)


async def test_skip_loads_tail_of_first_chunk(tmp_path: Path) -> None:
    async with engine_for(tmp_path, file_rows=None, bpc=3) as (engine, kv):
        keys = keys_for(engine, 2)
        fill(kv, list(range(6)), seed=2)
        want = snapshot(kv, list(range(1, 6)))
        await engine.store(keys, list(range(6)))
        assert await engine.load(keys, list(range(40, 45)), skip=1) == 2
        assert same(snapshot(kv, list(range(40, 45))), want)


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_eviction_cascades_to_file_and_promotes_back(
    tmp_path: Path, write_policy: str
) -> None:
    async with engine_for(tmp_path, cpu_rows=4, write_policy=write_policy) as (engine, kv):
        batches = []
        for salt in range(6):  # 6 x 2 blocks through a 4-row CPU tier
            keys = keys_for(engine, 2, salt)
            fill(kv, [0, 1], seed=salt)
            batches.append((keys, snapshot(kv, [0, 1])))
            await engine.store(keys, [0, 1])
        await engine.flush()
        st = engine.statistics()
        assert st.tiers["cpu"].statistics.evictions >= 8
        for keys, want in batches:
            assert engine.lookup(keys) == 2, "every block is in some tier"
            assert await engine.load(keys, [10, 11]) == 2
            assert same(snapshot(kv, [10, 11]), want)
        assert engine.statistics().tiers["file"].read_blocks >= 8
        assert_quiescent(engine)


async def test_concurrent_loads_of_one_block_promote_once(tmp_path: Path) -> None:
    async with engine_for(tmp_path, cpu_rows=2) as (engine, kv):
        keys = keys_for(engine, 2)
        fill(kv, [0, 1], seed=5)
        want = snapshot(kv, [0, 1])
        await engine.store(keys, [0, 1])
        await engine.flush()
        for salt in (1, 2):  # push both out of the CPU tier
            await engine.store(keys_for(engine, 2, salt), [2, 3])
        await engine.flush()
        assert not any(engine._chain.is_ready(k) for k in keys)
        before = engine.statistics().tiers["file"].read_blocks
        results = await asyncio.gather(
            *(engine.load(keys, [10 + 2 * i, 11 + 2 * i]) for i in range(4))
        )
        assert results == [2, 2, 2, 2]
        assert engine.statistics().tiers["file"].read_blocks - before == 2
        for i in range(4):
            assert same(snapshot(kv, [10 + 2 * i, 11 + 2 * i]), want)
        assert_quiescent(engine)


async def test_load_waits_for_store_in_flight(tmp_path: Path) -> None:
    async with engine_for(tmp_path, file_rows=None) as (engine, kv):
        keys = keys_for(engine, 3)
        fill(kv, [0, 1, 2], seed=6)
        want = snapshot(kv, [0, 1, 2])
        store = asyncio.create_task(engine.store(keys, [0, 1, 2]))
        await asyncio.sleep(0)  # the store has planned; its copy is in flight
        assert engine.lookup(keys) == 3
        assert await engine.load(keys, [20, 21, 22]) == 3
        await store
        assert same(snapshot(kv, [20, 21, 22]), want)


async def test_load_of_unknown_keys_is_typed_and_changes_nothing(tmp_path: Path) -> None:
    async with engine_for(tmp_path) as (engine, _kv):
        stored = keys_for(engine, 2)
        await engine.store(stored, [0, 1])
        with pytest.raises(BlockNotFoundError):
            await engine.load([*stored, *keys_for(engine, 1, 9)], [5, 6, 7])
        await engine.flush()  # write-through pins the rows it is writing
        assert_quiescent(engine)
        assert engine.lookup(stored) == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(lambda e, k: e.store(k, [0]), "expected 2 device block ids", id="count"),
        pytest.param(lambda e, k: e.store(k, [0, 0]), "duplicate", id="dup-ids"),
        pytest.param(lambda e, k: e.store(k, [0, NUM_BLOCKS]), rf"\[0, {NUM_BLOCKS}\)", id="range"),
        pytest.param(lambda e, k: e.store(k, [-1, 2]), rf"\[0, {NUM_BLOCKS}\)", id="negative"),
        pytest.param(lambda e, k: e.store([k[0], k[0]], [0, 1]), "duplicate keys", id="dup"),
        pytest.param(lambda e, k: e.store(["a", "b"], [0, 1]), "16 bytes", id="key-type"),
        pytest.param(lambda e, k: e.store([b"short", k[1]], [0, 1]), "16 bytes", id="key-len"),
        pytest.param(lambda e, k: e.load(k, [0, 1], skip=1), "skip", id="skip"),
        pytest.param(lambda e, k: e.load(k, [0.5, 1.5]), "flat sequence of int", id="float-ids"),
    ],
)
async def test_bad_arguments(
    tmp_path: Path, call: Callable[[Engine, list[bytes]], Any], message: str
) -> None:
    async with engine_for(tmp_path, file_rows=None) as (engine, _kv):
        keys = keys_for(engine, 2)
        with pytest.raises(InvalidArgumentError, match=message):
            await call(engine, keys)
        assert_quiescent(engine)


async def test_cancellation_leaves_no_pins(tmp_path: Path) -> None:
    rng = random.Random(7)
    async with engine_for(tmp_path, cpu_rows=6) as (engine, kv):
        fill(kv, list(range(NUM_BLOCKS)), seed=8)

        async def one(i: int) -> None:
            keys = keys_for(engine, 3, rng.randrange(8))
            base = 3 * (i % 20)
            hits = engine.lookup(keys)
            if hits:
                await engine.load(keys[:hits], list(range(base, base + hits)))
            await engine.store(keys, list(range(base, base + 3)))

        for round_ in range(20):
            tasks = [asyncio.create_task(one(round_ * 10 + i)) for i in range(6)]
            await asyncio.sleep(rng.random() * 0.003)
            for t in tasks:
                if rng.random() < 0.5:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await engine.flush()
        await asyncio.sleep(0.05)
        assert_quiescent(engine)
        # the engine keeps working
        keys = keys_for(engine, 2, 99)
        await engine.store(keys, [0, 1])
        assert await engine.load(keys, [2, 3]) == 2


def damage(tmp_path: Path, keys: list[bytes] | None = None) -> int:
    """Flip a payload byte of each block on file (of ``keys`` only, if given); how many."""
    (data_file,) = (tmp_path / "tier").glob("*/blocks.dat")
    desc = json.loads((data_file.parent / "namespace.json").read_text())
    slot_bytes = desc["slot_bytes"]
    flipped = 0
    with data_file.open("r+b") as f:
        for offset in range(0, data_file.stat().st_size, slot_bytes):
            f.seek(offset)
            header = f.read(64)  # the key is at bytes 24..40 (kvtier.tiers.block_format)
            if not any(header) or (keys is not None and header[24:40] not in keys):
                continue  # a free slot, or a block left alone
            f.seek(offset + slot_bytes - 100)
            byte = f.read(1)[0]
            f.seek(offset + slot_bytes - 100)
            f.write(bytes([byte ^ 0xFF]))
            flipped += 1
    return flipped


async def test_corrupt_file_degrades_to_miss(tmp_path: Path) -> None:
    async with engine_for(tmp_path, cpu_rows=2) as (engine, kv):
        keys = keys_for(engine, 2)
        fill(kv, [0, 1], seed=3)
        await engine.store(keys, [0, 1])
        await engine.flush()
        await engine.store(keys_for(engine, 2, 1), [2, 3])  # evict from the CPU tier
        await engine.flush()
        assert damage(tmp_path) >= 2
        hits = engine.lookup(keys)
        assert hits == 2
        assert await engine.load(keys, [10, 11]) == 0
        assert engine.statistics().front.load_shortfalls >= 2
        assert engine.lookup(keys) == 0, "a block failing verification is never served again"
        assert_quiescent(engine)


async def stored_and_closed(tmp_path: Path, seed: int) -> tuple[list[bytes], list[torch.Tensor]]:
    """Store 5 blocks through an engine, close it; their keys and bytes."""
    async with engine_for(tmp_path) as (engine, kv):
        keys = keys_for(engine, 5)
        fill(kv, list(range(5)), seed=seed)
        want = snapshot(kv, list(range(5)))
        await engine.store(keys, list(range(5)))
        await engine.flush()
    return keys, want


async def test_restart_finds_blocks(tmp_path: Path) -> None:
    keys, want = await stored_and_closed(tmp_path, seed=4)
    async with engine_for(tmp_path) as (engine, kv):
        for _ in range(200):
            if engine.lookup(keys) == 5:
                break
            await asyncio.sleep(0.01)  # recovery may run in the background
        assert await engine.load(keys, list(range(20, 25))) == 5
        assert same(snapshot(kv, list(range(20, 25))), want)
        st = engine.statistics().tiers["file"].statistics
        assert st is not None
        # The loads went into the CPU region, registered with io_uring where it runs.
        uses_fixed = (
            st.io_engine == "io_uring" and _ring.FIXED_CAPABLE and st.block_bytes >= _ring.SPLIT_MIN
        )
        assert (st.registered_bytes > 0) == uses_fixed


async def test_restart_with_background_recovery(tmp_path: Path) -> None:
    keys, want = await stored_and_closed(tmp_path, seed=6)
    # Every read of the reopened tier completes 0.3 s late, so the recovery
    # is certainly still running while the blocks below are stored.
    slow = FaultyIOEngine(
        await open_io_engine("auto", queue_depth=8),
        FaultPlan(seed=1, rates={"latency": 1.0}, latency_s=0.3),
    )
    async with engine_for(tmp_path, recovery="background", io=slow) as (engine, kv):
        assert engine.statistics().tiers["file"].statistics.recovery == "running"
        assert engine.lookup(keys) == 0  # not known yet
        # Stored meanwhile: served from the CPU tier, not written through (the
        # file tier refuses stores until it knows its slots), nothing pinned.
        others = keys_for(engine, 2, 7)
        fill(kv, [10, 11], seed=8)
        await engine.store(others, [10, 11])
        await engine.flush()
        after = engine.statistics()
        assert after.tiers["file"].write_failures == 2
        assert after.tiers["cpu"].statistics.pinned == 0
        for _ in range(500):
            if engine.lookup(keys) == 5:
                break
            await asyncio.sleep(0.01)
        assert engine.statistics().tiers["file"].statistics.recovery == "complete"
        assert await engine.load(keys, list(range(20, 25))) == 5
        assert same(snapshot(kv, list(range(20, 25))), want)
    await slow.aclose()


async def test_close_is_idempotent_and_final(tmp_path: Path) -> None:
    async with engine_for(tmp_path) as (engine, _kv):
        keys = keys_for(engine, 2)
        store = asyncio.create_task(engine.store(keys, [0, 1]))
        await asyncio.gather(engine.aclose(), engine.aclose())
        await store
        await engine.aclose()
        assert engine.closed
        with pytest.raises(ClosedError):
            engine.lookup(keys)
        with pytest.raises(ClosedError):
            await engine.store(keys, [0, 1])
        with pytest.raises(ClosedError):
            await engine.load(keys, [0, 1])


async def test_config_and_layout_must_agree(tmp_path: Path) -> None:
    kv = make_kv()
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=NUM_BLOCKS)
    with pytest.raises(ConfigurationError, match="blocks_per_chunk"):
        await Engine.open(KVTierConfig(cpu_bytes_to_use=2**20, blocks_per_chunk=2), layout, kv)


async def test_budget_below_one_row(tmp_path: Path) -> None:
    kv = make_kv()
    layout = KVLayout.from_tensors(kv, model_id="m", block_tokens=4, num_blocks=NUM_BLOCKS)
    with pytest.raises(kvtier.CapacityError):
        await Engine.open(KVTierConfig(cpu_bytes_to_use=100), layout, kv)


async def test_flush_waits_for_the_copy_of_a_cancelled_load(tmp_path: Path) -> None:
    async with engine_for(tmp_path, file_rows=None) as (engine, kv):
        keys = keys_for(engine, 8)
        fill(kv, list(range(8)), seed=11)
        want = snapshot(kv, list(range(8)))
        await engine.store(keys, list(range(8)))
        task = asyncio.ensure_future(engine.load(keys, list(range(20, 28))))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.flush()
        # The copy ran to its end: the device blocks hold the stored bytes now,
        # and nothing is in flight or pinned any more.
        assert same(snapshot(kv, list(range(20, 28))), want)
        assert_quiescent(engine)


# -- stores larger than the CPU tier --------------------------------------------------


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
async def test_a_store_larger_than_the_cpu_tier_streams_through_its_rows(
    tmp_path: Path, write_policy: str
) -> None:
    n = 40
    async with engine_for(tmp_path, cpu_rows=8, write_policy=write_policy) as (engine, kv):
        keys = keys_for(engine, n)
        fill(kv, list(range(n)), seed=5)
        want = snapshot(kv, list(range(n)))
        assert await engine.store(keys, list(range(n))) == kvtier.StoreSummary(n, 0, 0)
        await engine.flush()
        st = engine.statistics()
        assert st.front.dropped == 0
        assert st.tiers["cpu"].statistics.ready == 8, "the CPU tier keeps the last blocks"
        assert engine.lookup(keys) == n
        for t in kv:
            t.zero_()
        assert await engine.load(keys, list(range(n))) == n  # streams through the rows too
        assert same(snapshot(kv, list(range(n))), want)
        assert_quiescent(engine)
    async with engine_for(tmp_path, cpu_rows=8) as (engine, _kv):
        assert engine.lookup(keys) == n, "every block reached the file tier"


async def test_concurrent_stores_larger_than_the_cpu_tier_drop_nothing(tmp_path: Path) -> None:
    async with engine_for(tmp_path, cpu_rows=8) as (engine, _kv):
        parts = [keys_for(engine, 12, salt=s) for s in range(3)]
        summaries = await asyncio.gather(
            *(engine.store(k, list(range(12 * i, 12 * i + 12))) for i, k in enumerate(parts))
        )
        assert [s.dropped for s in summaries] == [0, 0, 0]
        assert sum(s.stored for s in summaries) == 36
        await engine.flush()
        assert [engine.lookup(k) for k in parts] == [12, 12, 12]
        assert_quiescent(engine)


async def test_without_a_lower_tier_a_store_keeps_the_prefix_that_fits(tmp_path: Path) -> None:
    async with engine_for(tmp_path, cpu_rows=8, file_rows=None) as (engine, _kv):
        keys = keys_for(engine, 20)
        assert await engine.store(keys, list(range(20))) == kvtier.StoreSummary(8, 0, 12)
        assert engine.lookup(keys) == 8
        assert engine.statistics().front.dropped == 12
        # Stored again, the prefix is present and the tail still does not fit.
        assert await engine.store(keys, list(range(20))) == kvtier.StoreSummary(0, 8, 12)
        assert_quiescent(engine)


# -- loads larger than the CPU tier ---------------------------------------------------


FILE_ROWS = 128
"""File tier budget of these tests, in rows: room for every block they store."""


async def stored_on_file(
    tmp_path: Path, n: int, *, prefixes: int = 1, bpc: int = 1
) -> tuple[list[list[bytes]], list[torch.Tensor]]:
    """Store ``prefixes`` prefixes of ``n`` blocks through an engine and close it.

    Prefix ``p`` comes from device blocks ``[p * n * bpc, (p + 1) * n * bpc)``.
    The blocks are then on file only: the next engine on ``tmp_path`` starts
    with an empty CPU tier. Their keys, and the KV tensors they came from.
    """
    rows = prefixes * n
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS, bpc=bpc) as (engine, kv):
        fill(kv, list(range(rows * bpc)), seed=21)
        parts = []
        for p in range(prefixes):
            keys = keys_for(engine, n, salt=p)
            blocks = list(range(p * n * bpc, (p + 1) * n * bpc))
            assert (await engine.store(keys, blocks)).dropped == 0
            parts.append(keys)
        await engine.flush()
        return parts, [t.clone() for t in kv]


def moved(kv: list[torch.Tensor], dst: range, src: list[torch.Tensor], at: range) -> bool:
    """Whether device blocks ``dst`` of ``kv`` hold what blocks ``at`` of ``src`` held."""
    return same(snapshot(kv, list(dst)), snapshot(src, list(at)))


def assert_unpinned(engine: Engine, keys: list[bytes]) -> None:
    """Nothing pinned, being written or in flight, for the engine and each of ``keys``."""
    assert_quiescent(engine)
    assert [engine._chain.pins(k) for k in keys] == [0] * len(keys)
    assert not engine._inflight


@pytest.mark.parametrize(
    ("bpc", "n", "skip"), [(1, 40, 0), (3, 20, 2)], ids=["40-blocks", "20-chunks-skip-2"]
)
async def test_a_load_of_file_blocks_larger_than_the_cpu_tier_streams(
    tmp_path: Path, bpc: int, n: int, skip: int
) -> None:
    ([keys], old) = await stored_on_file(tmp_path, n, bpc=bpc)
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS, bpc=bpc) as (engine, kv):
        assert engine.statistics().tiers["cpu"].statistics.ready == 0, "every block is on file only"
        assert engine.lookup(keys) == n
        blocks = range(skip, n * bpc)  # the first `skip` sub-blocks are on the device
        assert await engine.load(keys, list(blocks), skip=skip) == n
        assert moved(kv, blocks, old, blocks)
        st = engine.statistics()
        assert (st.tiers["file"].read_blocks, st.front.load_shortfalls) == (n, 0)
        assert st.tiers["cpu"].statistics.ready == 8, (
            "the last blocks promoted stay in the CPU tier"
        )
        assert_unpinned(engine, keys)


@pytest.mark.parametrize("shared", [True, False], ids=["one-prefix", "two-prefixes"])
async def test_two_loads_larger_than_the_cpu_tier_at_once(tmp_path: Path, shared: bool) -> None:
    n = 40
    parts, old = await stored_on_file(tmp_path, n, prefixes=1 if shared else 2)
    first, second = (parts[0], parts[0]) if shared else parts
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS) as (engine, kv):
        got = await asyncio.gather(
            engine.load(first, list(range(n))), engine.load(second, list(range(n, 2 * n)))
        )
        assert list(got) == [n, n]
        assert moved(kv, range(n), old, range(n))
        assert moved(kv, range(n, 2 * n), old, range(n) if shared else range(n, 2 * n))
        # One prefix: the loads share their promotions (each block is read once
        # or, when the policy evicted it between the two, twice).
        assert n <= engine.statistics().tiers["file"].read_blocks <= 2 * n
        assert_unpinned(engine, [*first, *second])


async def test_a_load_and_a_store_larger_than_the_cpu_tier_at_once(tmp_path: Path) -> None:
    n = 40
    ([keys], old) = await stored_on_file(tmp_path, n)
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS) as (engine, kv):
        fresh = keys_for(engine, n, salt=5)
        fill(kv, list(range(n, 2 * n)), seed=22)
        new = [t.clone() for t in kv]
        loaded, summary = await asyncio.gather(
            engine.load(keys, list(range(n))), engine.store(fresh, list(range(n, 2 * n)))
        )
        assert loaded == n
        assert summary == kvtier.StoreSummary(n, 0, 0)
        assert moved(kv, range(n), old, range(n))
        await engine.flush()
        assert engine.lookup(fresh) == n
        assert await engine.load(fresh, list(range(n))) == n
        assert moved(kv, range(n), new, range(n, 2 * n))
        assert_unpinned(engine, [*keys, *fresh])


async def test_cancelling_a_streaming_load_releases_every_pin(tmp_path: Path) -> None:
    n = 40
    ([keys], old) = await stored_on_file(tmp_path, n)
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS) as (engine, kv):
        for cut in (1, 12, 24):  # blocks on the device before the cancellation
            start = engine.statistics().tiers["cpu"].read_blocks
            alone = asyncio.ensure_future(engine.load(keys, list(range(n))))
            beside = asyncio.ensure_future(engine.load(keys, list(range(n, 2 * n))))
            while engine.statistics().tiers["cpu"].read_blocks - start < cut:
                assert not alone.done(), "the load ended before it was cancelled"
                await asyncio.sleep(0)
            alone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await alone
            # The other load of the same blocks shared promotions with it.
            assert await beside == n
            assert moved(kv, range(n, 2 * n), old, range(n))
            await engine.flush()
            assert_unpinned(engine, keys)
        # The engine keeps working.
        assert engine.lookup(keys) == n
        assert await engine.load(keys, list(range(n))) == n
        assert moved(kv, range(n), old, range(n))
        assert_unpinned(engine, keys)


async def test_a_damaged_block_ends_a_streaming_load_where_it_is(tmp_path: Path) -> None:
    n = 40
    ([keys], old) = await stored_on_file(tmp_path, n)
    assert damage(tmp_path, [keys[25]]) == 1
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS) as (engine, kv):
        assert engine.lookup(keys) == n, "not read yet: the damage is not known"
        assert await engine.load(keys, list(range(n))) == 25
        assert moved(kv, range(25), old, range(25))
        st = engine.statistics()
        assert st.front.load_shortfalls == n - 25
        assert st.tiers["file"].statistics.quarantined == 1
        assert engine.lookup(keys) == 25
        assert_unpinned(engine, keys)


async def test_closing_under_a_streaming_load_ends_it_typed(tmp_path: Path) -> None:
    n = 40
    ([keys], _old) = await stored_on_file(tmp_path, n)
    async with engine_for(tmp_path, cpu_rows=8, file_rows=FILE_ROWS) as (engine, _kv):
        loading = asyncio.ensure_future(engine.load(keys, list(range(n))))
        while engine.statistics().tiers["cpu"].read_blocks < 8:
            assert not loading.done(), "the load ended before the close"
            await asyncio.sleep(0)
        await engine.aclose()
        # What it still had to promote cannot start any more: a typed error, no hang.
        with pytest.raises(ClosedError):
            await loading
        assert engine.statistics().tiers["cpu"].statistics.pinned == 0


# -- closing with work in flight ------------------------------------------------------


@pytest.mark.parametrize("seconds", [30.0, 0.0], ids=["in-time", "timed-out"])
async def test_aclose_writes_through_what_is_in_flight_or_counts_it(
    tmp_path: Path, seconds: float
) -> None:
    n = 12
    async with engine_for(tmp_path, cpu_rows=16) as (engine, kv):
        keys = keys_for(engine, n)
        fill(kv, list(range(n)), seed=9)
        storing = asyncio.ensure_future(engine.store(keys, list(range(n))))
        await asyncio.sleep(0)  # the copy is submitted; its write-through is not
        await engine.aclose(seconds)
        stored = (await storing).stored
        abandoned = engine.statistics().front.abandoned_at_close
    assert stored == n
    async with engine_for(tmp_path, cpu_rows=16) as (engine, _kv):
        on_file = sum(engine.lookup([k]) for k in keys)
    # Either written or counted: never dropped silently.
    assert on_file + abandoned == n
    if seconds:
        assert (on_file, abandoned) == (n, 0)


# -- statistics -------------------------------------------------------------------------


async def test_statistics_give_each_figure_one_meaning(tmp_path: Path) -> None:
    async with engine_for(tmp_path, cpu_rows=4) as (engine, _kv):
        keys = keys_for(engine, 8)
        await engine.store(keys, list(range(8)))  # streams: the CPU tier keeps the last 4
        await engine.flush()
        assert engine.lookup(keys) == 8
        assert engine.lookup(keys_for(engine, 2, salt=1)) == 0
        st = engine.statistics()
        # Lookup hits per tier: the first 4 from the file tier, the last 4 from the CPU's.
        assert (st.tiers["cpu"].lookup_hits, st.tiers["file"].lookup_hits) == (4, 4)
        assert (st.lookups, st.lookup_misses) == (10, 2)
        assert st.lookups - st.lookup_misses == (
            st.tiers["cpu"].lookup_hits + st.tiers["file"].lookup_hits
        )
        assert await engine.load(keys[:4], list(range(4))) == 4  # promoted, then copied
        st = engine.statistics()
        row = st.tiers["file"].written_bytes // st.tiers["file"].written_blocks
        assert (st.tiers["cpu"].written_blocks, st.tiers["cpu"].read_blocks) == (8, 4)
        assert (st.tiers["file"].written_blocks, st.tiers["file"].read_blocks) == (8, 4)
        assert st.tiers["cpu"].written_bytes == 8 * engine.layout.bytes_per_chunk
        assert st.tiers["cpu"].read_bytes == 4 * engine.layout.bytes_per_chunk
        assert st.tiers["file"].read_bytes == 4 * row
        assert st.front.load_shortfalls == 0


async def test_statistics_report_every_tier_by_name(tmp_path: Path) -> None:
    """One record per tier, by name, highest first: the chain's counts, their bytes
    and busy time, and the tier's own record; the whole snapshot is plain data."""
    async with engine_for(tmp_path, cpu_rows=4) as (engine, kv):
        fill(kv, [0, 1, 2], seed=7)
        await engine.store(keys_for(engine, 3), [0, 1, 2])
        await engine.flush()
        st = engine.statistics()
        file_record = engine._links[0].tier.statistics()
    assert list(st.tiers) == ["cpu", "file"]
    cpu, file = st.tiers["cpu"], st.tiers["file"]
    assert isinstance(cpu.statistics, ManagerStatistics)
    assert (cpu.statistics.used, cpu.written_blocks) == (3, 3)
    assert file.statistics == file_record
    assert (file.written_blocks, file.statistics.stores) == (3, 3)
    row = engine.layout.bytes_per_chunk
    assert (cpu.written_bytes, file.written_bytes) == (3 * row, 3 * row)
    # Each tier's busy time: the device copies (the engine's), the file writes (the runtime's).
    assert cpu.write_busy_seconds > 0
    assert file.write_busy_seconds > 0
    assert file.write_gbps == file.written_bytes / file.write_busy_seconds / 1e9
    assert (file.read_failures, file.write_failures, file.read_busy_seconds) == (0, 0, 0.0)
    record = json.loads(json.dumps(dataclasses.asdict(st), default=str))
    assert record["tiers"]["file"]["written_blocks"] == 3
    assert record["front"] == {
        "dropped": 0,
        "load_shortfalls": 0,
        "abandoned_at_close": 0,
        "in_flight": 0,
    }
    assert record["tiers"]["cpu"]["statistics"]["used"] == 3
    assert record["stores"] == 1


OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


async def test_the_documented_statistics_snippet_runs(tmp_path: Path) -> None:
    """docs/operations.md, "Reading statistics": its example, on an engine with a file tier."""
    mark = "<!-- tested: tests/engine/test_engine.py -->"
    text = OPERATIONS.read_text()
    block = re.search(re.escape(mark) + r"\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None, f"docs/operations.md has no python block after {mark!r}"
    async with engine_for(tmp_path, cpu_rows=4) as (engine, _kv):
        keys = keys_for(engine, 8)
        await engine.store(keys, list(range(8)))
        await engine.flush()
        assert engine.lookup(keys) == 8
        assert await engine.load(keys[:4], list(range(4))) == 4
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(block.group(1), {"engine": engine})
    hits, promoted, pinned = (line.split() for line in out.getvalue().splitlines())
    assert hits == ["4", "4", "0"]
    assert promoted[0] == "4"
    assert pinned == ["0", "0"]
