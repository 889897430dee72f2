"""Small copies on the CPU backend run on the event loop's thread; large ones do not.

The engine copies a request of at most ``INLINE_COPY_BYTES`` on the loop's
thread (``run_now``) and hands larger ones to the copier's threads, which
start with the first such request. Either way a call is one point where other
tasks run and a cancellation lands, and the bytes and the pins come out the
same.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch

from kvtier import KVLayout, KVTierConfig, chain_keys
from kvtier.engine import INLINE_COPY_BYTES, Engine

BLOCKS = 64
PAGE = 4096


def copier_threads() -> int:
    return sum(t.name.startswith("kvtier-cpu-") for t in threading.enumerate())


@asynccontextmanager
async def small_engine() -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    """No tier below the CPU region; 16 KiB blocks, so that 17 blocks cross the threshold."""
    kv = [torch.zeros(2, BLOCKS, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, model_id="inline", block_tokens=16, num_blocks=BLOCKS)
    row = -(-layout.bytes_per_chunk // PAGE) * PAGE
    async with await Engine.open(
        KVTierConfig(cpu_bytes_to_use=BLOCKS * row), layout, kv, backend="cpu"
    ) as engine:
        yield engine, kv


def keys_of(engine: Engine, n: int, salt: int) -> list[bytes]:
    tokens = [salt * 1_000_000 + i for i in range(n * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


def random_fill(kv: list[torch.Tensor], blocks: range, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for t in kv:
        t[:, blocks.start : blocks.stop] = torch.randn(
            t[:, blocks.start : blocks.stop].shape, generator=g
        ).to(t.dtype)
    return [t[:, blocks.start : blocks.stop].clone() for t in kv]


def holds(kv: list[torch.Tensor], blocks: range, want: list[torch.Tensor]) -> bool:
    got = [t[:, blocks.start : blocks.stop] for t in kv]
    return all(bool(torch.equal(a, b)) for a, b in zip(got, want, strict=True))


async def test_small_copies_stay_on_the_loop_and_large_ones_go_to_the_copier() -> None:
    async with small_engine() as (engine, kv):
        per_block = engine.layout.bytes_per_chunk
        small = INLINE_COPY_BYTES // per_block
        assert small + 1 <= BLOCKS // 2
        before = copier_threads()
        want = random_fill(kv, range(small), seed=1)
        keys = keys_of(engine, small, salt=1)
        assert (await engine.store(keys, range(small))).stored == small
        assert await engine.load(keys, range(32, 32 + small)) == small
        assert holds(kv, range(32, 32 + small), want)
        assert copier_threads() == before, "a small request started the copier's threads"

        large = small + 1
        want = random_fill(kv, range(large), seed=2)
        keys = keys_of(engine, large, salt=2)
        assert (await engine.store(keys, range(large))).stored == large
        assert await engine.load(keys, range(32, 32 + large)) == large
        assert holds(kv, range(32, 32 + large), want)
        assert copier_threads() > before, "a large request did not reach the copier's threads"
        st = engine.statistics()
        cpu = st.tiers["cpu"].statistics
        assert (cpu.pinned, cpu.being_written, st.front.in_flight) == (0, 0, 0)


SIZES = pytest.mark.parametrize(
    ("blocks", "inline"), [(2, True), (20, False)], ids=["on-the-loop", "on-the-thread"]
)


@SIZES
async def test_a_store_cancelled_after_its_first_step_publishes_nothing(
    blocks: int, inline: bool
) -> None:
    async with small_engine() as (engine, _kv):
        assert (blocks * engine.layout.bytes_per_chunk <= INLINE_COPY_BYTES) == inline
        keys = keys_of(engine, blocks, salt=3)
        task = asyncio.ensure_future(engine.store(keys, range(blocks)))
        await asyncio.sleep(0)  # the store has planned and copied (or handed over) its blocks
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.flush()
        assert engine.lookup(keys) == 0
        st = engine.statistics()
        cpu = st.tiers["cpu"].statistics
        assert (cpu.ready, cpu.being_written, st.front.in_flight) == (0, 0, 0)


@SIZES
async def test_each_call_lets_other_tasks_run(blocks: int, inline: bool) -> None:
    async with small_engine() as (engine, _kv):
        assert (blocks * engine.layout.bytes_per_chunk <= INLINE_COPY_BYTES) == inline
        turns = 0
        stop = asyncio.Event()

        async def beside() -> None:
            nonlocal turns
            while not stop.is_set():
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(beside())
        await asyncio.sleep(0)
        for i in range(5):
            keys = keys_of(engine, blocks, salt=10 + i)
            start = turns
            await engine.store(keys, range(blocks))
            assert turns > start, "a store ran without letting other tasks run"
            start = turns
            assert await engine.load(keys, range(32, 32 + blocks)) == blocks
            assert turns > start, "a load ran without letting other tasks run"
        stop.set()
        await other
