"""Embed kvtier in an asyncio serving loop.

Each request looks up its prefix, loads what kvtier holds onto the device, computes
the rest (here: fills the blocks with a pattern) and stores its blocks back. Run
it: ``python examples/serving_loop.py``.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch

import kvtier


async def main(root: Path) -> None:
    # The serving engine's KV cache: 4 layers, K/V-first, 64 blocks of 16 tokens.
    kv_caches = [torch.zeros(2, 64, 16, 4, 32, dtype=torch.float16) for _ in range(4)]
    layout = kvtier.KVLayout.from_tensors(
        kv_caches, model_id="example-model", block_tokens=16, num_blocks=64
    )
    config = kvtier.KVTierConfig(
        cpu_bytes_to_use="8MiB",
        file_tier=kvtier.FileTierConfig(root=root, bytes_to_use="64MiB"),
    )
    async with await kvtier.Engine.open(config, layout, kv_caches) as engine:

        async def serve(tokens: list[int], device_blocks: list[int]) -> int:
            keys = kvtier.chain_keys(tokens, engine.block_tokens, engine.namespace)
            hits = engine.lookup(keys)  # never blocks, never does I/O
            loaded = await engine.load(keys[:hits], device_blocks[:hits])
            for b in device_blocks[loaded : len(keys)]:  # "prefill" the misses
                for t in kv_caches:
                    t[:, b].fill_(float(b % 7))
            await engine.store(keys, device_blocks[: len(keys)])
            return loaded

        prompt = list(range(200))  # 12 full blocks of 16 tokens
        first = await serve(prompt, list(range(0, 12)))
        # A second request sharing the prompt, on other device blocks, runs
        # concurrently with an unrelated one.
        second, other = await asyncio.gather(
            serve(prompt + [7] * 40, list(range(20, 35))),
            serve(list(range(1000, 1100)), list(range(40, 46))),
        )
        await engine.flush()  # wait for write-through to the file tier
        print(f"first request loaded {first} blocks, second {second}, unrelated {other}")
        assert (first, second, other) == (0, 12, 0)
        cpu = engine.statistics().tiers["cpu"]
        print(f"CPU tier: {cpu.statistics.used}/{cpu.statistics.capacity} rows used")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp) / "kv"))
