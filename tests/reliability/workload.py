"""A serving-loop workload for the reliability suite, with a reference of every block.

Each block's bytes are derived from its key (BLAKE2b of key, sub-block, tensor),
so any block loaded onto the "device" can be checked without keeping copies:
a wrong block served is caught at once. Requests share prefixes (a few system
prompts, growing conversations), run concurrently on a pool of device blocks,
and may be cancelled at random points.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier import (
    FileTierConfig,
    KVLayout,
    KVTierConfig,
    KVTierError,
    chain_keys,
)
from kvtier.engine import Engine

NUM_BLOCKS = 96
BPC = 2
ROW = 8192  # bytes of one offloaded block: 2 tensors x 2 sub-blocks x 2 halves x 1 KiB


def make_kv() -> list[torch.Tensor]:
    """Two K/V-first fp16 tensors: 1 KiB per half per device block."""
    return [torch.zeros(2, NUM_BLOCKS, 4, 128, dtype=torch.float16) for _ in range(2)]


def make_layout(
    kv: list[torch.Tensor], model: str = "reliability", groups: tuple[int, ...] | None = None
) -> KVLayout:
    return KVLayout.from_tensors(
        kv,
        model_id=model,
        block_tokens=4,
        blocks_per_chunk=BPC,
        num_blocks=NUM_BLOCKS,
        groups=groups,
    )


def pattern(key: bytes, sub: int, tensor: int, nbytes: int) -> torch.Tensor:
    """The bytes one device block (both halves) of ``tensor`` holds for ``key``."""
    seed = hashlib.blake2b(key + bytes([sub, tensor]), digest_size=64).digest()
    reps = -(-nbytes // len(seed))
    return torch.frombuffer(bytearray(seed * reps)[:nbytes], dtype=torch.uint8)


def write_blocks(kv: list[torch.Tensor], keys: list[bytes], ids: list[int]) -> None:
    """Put each key's bytes into its device blocks (``BPC`` ids per key)."""
    for t_index, t in enumerate(kv):
        v = t.view(torch.uint8)
        per = v[:, 0].numel()
        for i, key in enumerate(keys):
            for sub in range(BPC):
                v[:, ids[i * BPC + sub]] = pattern(key, sub, t_index, per).view(v[:, 0].shape)


def wrong_blocks(kv: list[torch.Tensor], keys: list[bytes], ids: list[int], skip: int) -> int:
    """How many of the device blocks loaded for ``keys`` (after ``skip``) are wrong."""
    bad = 0
    for t_index, t in enumerate(kv):
        v = t.view(torch.uint8)
        per = v[:, 0].numel()
        pos = 0
        for i, key in enumerate(keys):
            for sub in range(skip if i == 0 else 0, BPC):
                want = pattern(key, sub, t_index, per).view(v[:, 0].shape)
                bad += not bool(torch.equal(v[:, ids[pos]], want))
                pos += 1
    return bad


@dataclass
class Tally:
    """What a workload did and saw."""

    stores: int = 0
    loads: int = 0
    lookups: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    untyped: list[BaseException] = field(default_factory=list)
    blocks_verified: int = 0
    wrong_blocks: int = 0
    stored_keys: set[bytes] = field(default_factory=set)

    def error(self, exc: BaseException) -> None:
        if isinstance(exc, KVTierError):
            name = type(exc).__name__
            self.errors[name] = self.errors.get(name, 0) + 1
        else:
            self.untyped.append(exc)


class DevicePool:
    """Device block ids handed to one request at a time."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n))
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) >= n)
            out, self._free = self._free[:n], self._free[n:]
            return out

    async def give(self, ids: list[int]) -> None:
        async with self._cond:
            self._free += ids
            self._cond.notify_all()


@asynccontextmanager
async def open_engine(
    root: Path | None,
    *,
    cpu_rows: int = 24,
    file_rows: int = 160,
    write_policy: str = "write_through",
    groups: tuple[int, ...] | None = None,
    **open_kwargs: Any,
) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    kv = make_kv()
    layout = make_layout(kv, groups=groups)
    file_tier = None
    if root is not None:
        file_tier = FileTierConfig(
            root=root,
            bytes_to_use=file_rows * (ROW + 4096),
            write_policy=write_policy,
            queue_depth=8,
        )
    config = KVTierConfig(
        cpu_bytes_to_use=cpu_rows * ROW, blocks_per_chunk=BPC, file_tier=file_tier
    )
    engine = await Engine.open(config, layout, kv, **open_kwargs)
    try:
        yield engine, kv
    finally:
        await engine.aclose()


async def serve(
    engine: Engine,
    kv: list[torch.Tensor],
    *,
    requests: int,
    seed: int,
    concurrency: int = 6,
    cancel_rate: float = 0.05,
    deadline_s: float = 20.0,
) -> Tally:
    """Run ``requests`` lookup/load/store requests; every awaitable has a deadline."""
    rng = random.Random(seed)
    tally = Tally()
    pool = DevicePool(NUM_BLOCKS)
    prompts = [[rng.randrange(50_000) for _ in range(8 * engine.block_tokens)] for _ in range(4)]
    chats: list[list[int]] = []
    sem = asyncio.Semaphore(concurrency)

    def next_tokens() -> list[int]:
        if chats and rng.random() < 0.6:
            chat = rng.choice(chats)
        else:
            chat = list(rng.choice(prompts))
            chats.append(chat)
        chat += [rng.randrange(50_000) for _ in range(rng.randint(1, 4) * engine.block_tokens)]
        return list(chat[: 14 * engine.block_tokens])

    held: list[list[int]] = []

    async def janitor() -> None:
        # A cancelled load may still be writing its device blocks: hand them out
        # again only once no copy is in flight (a serving engine must do the same).
        while True:
            await asyncio.sleep(0.002)
            if held and engine.statistics().front.in_flight == 0:
                for ids in held:
                    await pool.give(ids)
                held.clear()

    async def one(tokens: list[int]) -> None:
        keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
        ids = await pool.take(len(keys) * BPC)
        clean = False
        try:
            async with asyncio.timeout(deadline_s):
                tally.lookups += 1
                hits = engine.lookup(keys)
                skip = rng.randrange(BPC) if hits and rng.random() < 0.3 else 0
                loaded = 0
                if hits:
                    tally.loads += 1
                    want = ids[: hits * BPC - skip]
                    try:
                        loaded = await engine.load(keys[:hits], want, skip=skip)
                    except KVTierError as exc:
                        tally.error(exc)  # the device blocks are garbage; recompute all
                        loaded = 0
                    else:
                        used = ids[: loaded * BPC - skip] if loaded else []
                        tally.wrong_blocks += wrong_blocks(kv, keys[:loaded], used, skip)
                        tally.blocks_verified += len(used)
                # "Compute" the rest (and the whole first block when skipping).
                write_blocks(kv, keys, ids)
                tally.stores += 1
                try:
                    await engine.store(keys, ids)
                    tally.stored_keys.update(keys)
                except KVTierError as exc:
                    tally.error(exc)
            clean = True
        finally:
            if clean:
                await pool.give(ids)
            else:
                held.append(ids)

    async def guarded(tokens: list[int]) -> None:
        async with sem:
            task = asyncio.ensure_future(one(tokens))
            if rng.random() < cancel_rate:
                await asyncio.sleep(rng.uniform(0, 0.004))
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                tally.cancelled += 1
            except TimeoutError as exc:
                tally.untyped.append(exc)  # a hang: fail the run
            except BaseException as exc:  # recorded: the test fails on it
                tally.error(exc)

    cleaner = asyncio.ensure_future(janitor())
    try:
        await asyncio.gather(*(guarded(next_tokens()) for _ in range(requests)))
    finally:
        cleaner.cancel()
    return tally


async def verify_everything(engine: Engine, kv: list[torch.Tensor], keys: set[bytes]) -> int:
    """Load every key the engine still finds, one at a time; return wrong blocks."""
    wrong = 0
    ids = list(range(BPC))
    for key in sorted(keys):
        if engine.lookup([key]) == 1 and await engine.load([key], ids) == 1:
            wrong += wrong_blocks(kv, [key], ids, 0)
    return wrong
