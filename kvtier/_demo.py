"""A simulated asyncio serving loop over the engine: the job behind ``kvtier demo``.

Conversations share system prompts and grow turn by turn; several requests run
at once. Each request looks its prefix up, loads the hits onto the "device" (CPU
tensors standing in for the GPU), "computes" the rest by writing content derived
from each block's key, and stores everything. Every loaded block is checked
against the content its key implies, so a wrong block served would be caught.
More KV is produced than the device and CPU tiers hold, so blocks cascade to the
file tier and come back from it.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtier.config import FileTierConfig, KVTierConfig
from kvtier.engine import Engine, EngineStatistics
from kvtier.errors import CapacityError
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout

__all__ = ["DemoReport", "DemoSettings", "run_demo"]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """Shape of the simulated workload."""

    conversations: int = 48
    """Independent chats."""
    turns: int = 4
    """Requests per chat; each extends the previous one."""
    concurrency: int = 8
    """Requests in flight at once."""
    system_prompts: int = 3
    """Distinct shared system prompts."""
    system_tokens: int = 1024
    """Tokens of each system prompt."""
    layers: int = 8
    """KV tensors (one per layer, K/V-first)."""
    device_blocks: int = 2048
    """Device KV blocks (16 tokens each): room for ``concurrency`` longest requests."""
    blocks_per_chunk: int = 4
    """Device blocks per offloaded block."""
    cpu_bytes: int = 192 * 2**20
    """CPU region budget."""
    file_bytes: int = 4 * 2**30
    """File tier budget."""
    prefill_tokens_per_s: float = 8000.0
    """Assumed prefill rate of the model, for the recompute time saved."""
    seed: int = 0
    """Seed of the token streams."""
    root: Path | None = None
    """File tier root; a temporary directory when None."""


@dataclass(slots=True)
class DemoReport:
    """What the run measured."""

    requests: int = 0
    blocks_requested: int = 0
    blocks_hit: int = 0
    blocks_loaded: int = 0
    blocks_verified: int = 0
    blocks_wrong: int = 0
    blocks_computed: int = 0
    seconds: float = 0.0
    stats: EngineStatistics | None = None
    tokens_reused: int = 0
    layout_bytes_per_block: int = 0
    prefill_tokens_per_s: float = 0.0
    progress: list[int] = field(default_factory=list)


def _fill_value(key: bytes, sub: int) -> int:
    """The byte a block's content is made of: derived from its key, never stored aside."""
    return (key[0] + 31 * sub) % 251 + 1


def _fill_values(keys: list[bytes], bpc: int) -> torch.Tensor:
    """:func:`_fill_value` of every sub-block of ``keys``, in device-block order."""
    return torch.tensor(
        [_fill_value(k, sub) for k in keys for sub in range(bpc)], dtype=torch.uint8
    )


class _DeviceBlocks:
    """A free list of chunk-aligned device block runs, and the waits for them."""

    def __init__(self, num_blocks: int, bpc: int) -> None:
        self._bpc = bpc
        self._free = list(range(num_blocks // bpc))
        self._cond = asyncio.Condition()

    async def take(self, chunks: int) -> list[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) >= chunks)
            got, self._free = self._free[:chunks], self._free[chunks:]
        return [c * self._bpc + i for c in got for i in range(self._bpc)]

    async def give(self, ids: list[int]) -> None:
        async with self._cond:
            self._free.extend(b // self._bpc for b in ids[:: self._bpc])
            self._cond.notify_all()


async def run_demo(
    settings: DemoSettings, on_progress: Callable[[DemoReport, Engine], None] | None = None
) -> DemoReport:
    """Run the simulated serving loop and return what it measured.

    Raises
    ------
    CapacityError
        When the device cannot hold the longest request.
    """
    rng = random.Random(settings.seed)
    kv = [
        torch.zeros(2, settings.device_blocks, 16, 4, 64, dtype=torch.float16)
        for _ in range(settings.layers)
    ]
    layout = KVLayout.from_tensors(
        kv,
        model_id="kvtier-demo",
        block_tokens=16,
        blocks_per_chunk=settings.blocks_per_chunk,
        num_blocks=settings.device_blocks,
    )
    bpc = settings.blocks_per_chunk
    views = [t.view(torch.uint8).view(2, settings.device_blocks, -1) for t in kv]
    report = DemoReport(
        layout_bytes_per_block=layout.bytes_per_chunk,
        prefill_tokens_per_s=settings.prefill_tokens_per_s,
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        root = settings.root or Path(tmp) / "tier"
        config = KVTierConfig(
            cpu_bytes_to_use=settings.cpu_bytes,
            blocks_per_chunk=bpc,
            file_tier=FileTierConfig(root=root, bytes_to_use=settings.file_bytes),
        )
        systems = [
            [rng.randrange(32000) for _ in range(settings.system_tokens)]
            for _ in range(settings.system_prompts)
        ]
        chats = [list(rng.choice(systems)) for _ in range(settings.conversations)]
        longest = settings.system_tokens + settings.turns * 640
        needed = -(-longest // layout.offload_block_tokens) * bpc
        if needed * settings.concurrency > settings.device_blocks:
            raise CapacityError(
                f"{settings.concurrency} requests of up to {needed} device blocks need more "
                f"than the {settings.device_blocks} device blocks"
            )
        device = _DeviceBlocks(settings.device_blocks, bpc)
        sem = asyncio.Semaphore(settings.concurrency)
        started = time.perf_counter()
        async with await Engine.open(config, layout, kv) as engine:

            async def request(tokens: list[int]) -> None:
                keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
                if not keys:
                    return
                ids = await device.take(len(keys))
                try:
                    hits = engine.lookup(keys)
                    loaded = await engine.load(keys[:hits], ids[: hits * bpc]) if hits else 0
                    if loaded:
                        # One vectorized check per layer of every loaded sub-block.
                        got_ids = torch.tensor(ids[: loaded * bpc])
                        want = _fill_values(keys[:loaded], bpc).view(1, -1, 1)
                        ok = torch.ones(loaded * bpc, dtype=torch.bool)
                        for v in views:
                            ok &= (v[:, got_ids] == want).all(dim=2).all(dim=0)
                        report.blocks_verified += loaded * bpc
                        report.blocks_wrong += int((~ok).sum())
                    if loaded < len(keys):
                        # "prefill": content derived from the key, as a model would
                        # deterministically produce the same KV for the same prefix
                        new_ids = torch.tensor(ids[loaded * bpc : len(keys) * bpc])
                        values = _fill_values(keys[loaded:], bpc).view(1, -1, 1)
                        for v in views:
                            v[:, new_ids] = values.expand(2, -1, v.shape[2])
                    report.blocks_computed += len(keys) - loaded
                    await engine.store(keys, ids)
                    report.requests += 1
                    report.blocks_requested += len(keys)
                    report.blocks_hit += hits
                    report.blocks_loaded += loaded
                    report.tokens_reused += loaded * engine.block_tokens
                    if on_progress is not None:
                        on_progress(report, engine)
                finally:
                    await device.give(ids)

            async def chat(history: list[int]) -> None:
                for _turn in range(settings.turns):
                    history += [rng.randrange(32000) for _ in range(rng.randrange(64, 512))]
                    async with sem:
                        await request(list(history))
                    history += [rng.randrange(32000) for _ in range(rng.randrange(16, 128))]

            await asyncio.gather(*(chat(h) for h in chats))
            await engine.flush()
            report.stats = engine.statistics()
        report.seconds = time.perf_counter() - started
    return report
