"""A second process finds the blocks the first one stored.

The first process stores a document's KV blocks with a file tier and exits; a
new process opens the same root and loads them back, byte for byte.
Run it: ``python examples/restart_recovery.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import kvtier

TOKENS = list(range(5000, 5512))  # a shared RAG document: 32 blocks of 16 tokens


def make(root: Path) -> tuple[kvtier.KVTierConfig, kvtier.KVLayout, list[torch.Tensor]]:
    kv_caches = [torch.zeros(2, 48, 16, 2, 32, dtype=torch.float16) for _ in range(2)]
    layout = kvtier.KVLayout.from_tensors(
        kv_caches, model_id="rag-model", block_tokens=16, num_blocks=48
    )
    config = kvtier.KVTierConfig(
        cpu_bytes_to_use="1MiB",
        file_tier=kvtier.FileTierConfig(root=root, bytes_to_use="16MiB"),
    )
    return config, layout, kv_caches


def pattern(block: int) -> float:
    return float(block % 13) + 0.5


async def first(root: Path) -> None:
    config, layout, kv = make(root)
    async with await kvtier.Engine.open(config, layout, kv) as engine:
        keys = kvtier.chain_keys(TOKENS, engine.block_tokens, engine.namespace)
        for b in range(len(keys)):
            for t in kv:
                t[:, b].fill_(pattern(b))
        await engine.store(keys, list(range(len(keys))))
        await engine.flush()  # the files are complete before the process exits
    print(f"process 1 stored {len(keys)} blocks")


async def second(root: Path) -> None:
    config, layout, kv = make(root)
    async with await kvtier.Engine.open(config, layout, kv) as engine:
        keys = kvtier.chain_keys(TOKENS, engine.block_tokens, engine.namespace)
        hits = engine.lookup(keys)
        dest = list(range(16, 16 + hits))
        loaded = await engine.load(keys[:hits], dest)
        for i, b in enumerate(dest[:loaded]):
            assert all(bool((t[:, b] == pattern(i)).all()) for t in kv), f"block {i} differs"
        print(f"process 2 found {hits} blocks and loaded {loaded}, all bytes as stored")
        assert loaded == len(keys)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        root = Path(sys.argv[2])
        asyncio.run(first(root) if sys.argv[1] == "first" else second(root))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "kv"
            for phase in ("first", "second"):
                subprocess.run([sys.executable, __file__, phase, str(root)], check=True)
