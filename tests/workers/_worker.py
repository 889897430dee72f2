"""A worker process of the worker tests (run as a script, not collected).

usage: _worker.py ADDRESS RANK WORLD MODE

Its KV tensor holds bytes seeded by its rank (:func:`make_kv`), so every rank's
bytes differ. MODE ``serve`` serves jobs; ``slow`` also delays reporting every
store by 60 s (so that a test can kill it in the middle of a job). A line
``check SRC DST COUNT`` on stdin prints whether blocks ``DST..`` equal blocks
``SRC..``; the last line printed says how serving ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtier.layout import KVLayout, TensorSpec
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import BlockIds, DeviceTransfer, TransferStatistics
from kvtier.workers import Worker

if TYPE_CHECKING:
    import torch

NUM_BLOCKS = 16


def make_kv(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s KV tensor: blocks 0-7 seeded by the rank, 8-15 zero."""
    import torch  # here: a scheduler process needs no torch (1.7 s to import)

    g = torch.Generator().manual_seed(1000 + rank)
    kv = torch.zeros(2, NUM_BLOCKS, 4, 64, dtype=torch.uint8)
    kv[:, :8] = torch.randint(0, 256, (2, 8, 4, 64), dtype=torch.uint8, generator=g)
    return [kv]


def layout_of(kv: list[torch.Tensor], rank: int, world: int, model: str = "m") -> KVLayout:
    return KVLayout.from_tensors(
        kv, model_id=model, block_tokens=4, num_blocks=NUM_BLOCKS, tp_rank=rank, tp_size=world
    )


def rank_layout(rank: int, world: int) -> KVLayout:
    """``layout_of(make_kv(rank), rank, world)`` without torch, for a scheduler process."""
    spec = TensorSpec("kv[0]", (2, NUM_BLOCKS, 4, 64), "uint8", 1, True)
    return KVLayout(tensors=(spec,), model_id="m", block_tokens=4, tp_rank=rank, tp_size=world)


class Held(DeviceTransfer):
    """Holds every store's report until :attr:`release` is set, or ``after`` seconds."""

    def __init__(self, inner: DeviceTransfer, after: float | None = None) -> None:
        self._inner = inner
        self._after = after
        self.release = asyncio.Event()
        self._holding: set[asyncio.Future[None]] = set()

    @property
    def backend(self) -> str:
        return self._inner.backend

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        real = self._inner.store(device_block_ids, rows)
        late: Completion[None] = Completion()

        async def hold() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), self._after)
            await real
            late.set_result(None)

        task = asyncio.ensure_future(hold())
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)
        return late

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        return self._inner.load(rows, device_block_ids, skip)

    def statistics(self) -> TransferStatistics:
        return self._inner.statistics()

    async def aclose(self) -> None:
        self.release.set()
        await self._inner.aclose()


def slow(inner: DeviceTransfer) -> DeviceTransfer:
    """Reports every store 60 s after it finished."""
    return Held(inner, after=60)


async def main() -> None:
    import torch

    address, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    kv = make_kv(rank)
    worker = await Worker.open(
        address,
        layout_of(kv, rank, world),
        kv,
        timeout=30,
        wrap_transfer=slow if mode == "slow" else None,
    )
    print(json.dumps({"rank": rank, "attached": True}), flush=True)
    serving = asyncio.ensure_future(worker.serve())

    async def commands() -> None:
        while line := await asyncio.to_thread(sys.stdin.readline):
            _, src, dst, n = line.split()
            a, b, k = int(src), int(dst), int(n)
            same = bool(torch.equal(kv[0][:, b : b + k], kv[0][:, a : a + k]))
            print(json.dumps({"rank": rank, "same": same}), flush=True)

    reader = asyncio.ensure_future(commands())
    ending = await serving
    reader.cancel()
    print(json.dumps({"rank": rank, "ending": ending}), flush=True)
    # stdin's reader thread may still block in readline: leave without joining it.
    os._exit(0)


if __name__ == "__main__":
    asyncio.run(main())
