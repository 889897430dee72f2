"""The chain's scenarios (:class:`kvtier.testing.chain.ChainSuite`) through the Engine.

The same scenarios run through the vLLM front in
``tests_vllm/test_vllm_chain_suite.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvtier import Engine, KVTierConfig, chain_keys
from kvtier.config import FileTierConfig
from kvtier.layout import KVLayout
from kvtier.testing.chain import BLOCK_BYTES, ChainSuite, Front, payload
from kvtier.tiers.file import FileTier

DEVICE_BLOCKS = 64


class EngineFront(Front):
    """Blocks on a CPU "device" tensor of one block-first KV tensor of 4 KiB blocks."""

    def __init__(self, engine: Engine, kv: torch.Tensor) -> None:
        self.engine = engine
        self.kv = kv
        self._keys = chain_keys(list(range(64 * 16)), engine.block_tokens, engine.namespace)

    def key(self, name: int) -> bytes:
        return self._keys[name]

    async def store(self, names: Sequence[int]) -> None:
        ids = list(range(len(names)))
        for i, n in zip(ids, names, strict=True):
            self.kv[i] = torch.frombuffer(bytearray(payload(n)), dtype=torch.uint8)
        await self.engine.store([self.key(n) for n in names], ids)
        await self.engine.flush()  # written through

    async def serve(self, names: Sequence[int]) -> list[bytes]:
        keys = [self.key(n) for n in names]
        hits = self.engine.lookup(keys)
        ids = list(range(DEVICE_BLOCKS - hits, DEVICE_BLOCKS))
        self.kv[ids] = 0
        got = await self.engine.load(keys[:hits], ids) if hits else 0
        return [bytes(self.kv[i].numpy()) for i in ids[:got]]

    async def aclose(self) -> None:
        await self.engine.aclose()


class TestEngineFront(ChainSuite):
    async def open_front(self, root: Path, cpu_rows: int) -> Front:
        kv = torch.zeros(DEVICE_BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        layout = KVLayout.from_tensors([kv], model_id="chain-suite", block_tokens=16)
        config = KVTierConfig(
            cpu_bytes_to_use=cpu_rows * BLOCK_BYTES,
            file_tier=FileTierConfig(
                root=root, bytes_to_use=FileTier.budget_for(64, BLOCK_BYTES), queue_depth=4
            ),
        )
        return EngineFront(await Engine.open(config, layout, [kv]), kv)
