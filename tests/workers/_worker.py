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
import json
import os
import sys
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.layout import KVLayout
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import BlockIds, DeviceTransfer, TransferStatistics
from kvtier.workers import Worker

NUM_BLOCKS = 16


def make_kv(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s KV tensor: blocks 0-7 seeded by the rank, 8-15 zero."""
    g = torch.Generator().manual_seed(1000 + rank)
    kv = torch.zeros(2, NUM_BLOCKS, 4, 64, dtype=torch.uint8)
    kv[:, :8] = torch.randint(0, 256, (2, 8, 4, 64), dtype=torch.uint8, generator=g)
    return [kv]


def layout_of(kv: list[torch.Tensor], rank: int, world: int) -> KVLayout:
    return KVLayout.from_tensors(
        kv, model_id="m", block_tokens=4, num_blocks=NUM_BLOCKS, tp_rank=rank, tp_size=world
    )


class Slow(DeviceTransfer):
    """Reports every store 60 s after it finished."""

    def __init__(self, inner: DeviceTransfer) -> None:
        self._inner = inner

    @property
    def backend(self) -> str:
        return self._inner.backend

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        real = self._inner.store(device_block_ids, rows)
        late: Completion[None] = Completion()
        loop = asyncio.get_running_loop()
        real.add_done_callback(lambda _c: loop.call_later(60, late.set_result, None))
        return late

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        return self._inner.load(rows, device_block_ids, skip)

    def statistics(self) -> TransferStatistics:
        return self._inner.statistics()

    async def aclose(self) -> None:
        await self._inner.aclose()


async def main() -> None:
    address, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    kv = make_kv(rank)
    worker = await Worker.open(
        address,
        layout_of(kv, rank, world),
        kv,
        timeout=30,
        wrap_transfer=Slow if mode == "slow" else None,
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
