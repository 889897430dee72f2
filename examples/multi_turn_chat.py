"""Prefix reuse across the turns of a chat.

Each turn re-sends the whole conversation; kvtier hands back the KV of everything
the previous turns already computed, so only the new tokens need a prefill.
Run it: ``python examples/multi_turn_chat.py``.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path

import torch

import kvtier


async def main(root: Path) -> None:
    rng = random.Random(1)
    kv_caches = [torch.zeros(128, 16, 2, 4, 32, dtype=torch.bfloat16) for _ in range(2)]
    layout = kvtier.KVLayout.from_tensors(
        kv_caches, model_id="chat-model", block_tokens=16, blocks_per_chunk=2
    )
    config = kvtier.KVTierConfig(
        cpu_bytes_to_use="4MiB",
        blocks_per_chunk=2,
        file_tier=kvtier.FileTierConfig(root=root, bytes_to_use="32MiB"),
    )
    async with await kvtier.Engine.open(config, layout, kv_caches) as engine:
        history = [rng.randrange(32000) for _ in range(300)]  # system prompt + question
        for turn in range(1, 5):
            keys = kvtier.chain_keys(history, engine.block_tokens, engine.namespace)
            device_blocks = list(range(len(keys) * 2))
            hits = engine.lookup(keys)
            loaded = await engine.load(keys[:hits], device_blocks[: hits * 2])
            reused = loaded * engine.block_tokens
            print(
                f"turn {turn}: {len(history)} tokens, {reused} reused from kvtier, "
                f"{len(history) - reused} to prefill"
            )
            if turn > 1:
                assert reused > 0
            await engine.store(keys, device_blocks)
            # the model answers, the user replies: the conversation grows
            history += [rng.randrange(32000) for _ in range(rng.randrange(50, 150))]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp) / "kv"))
