"""One scheduler and two tensor-parallel workers, each in its own process.

The scheduler (this process) runs the engine: lookup, store, load, the CPU
region mapped whole. Each worker process owns its rank's KV tensor (CPU
tensors here, GPU tensors in a real serving engine) and copies its own slice
of every row. Run it as ``python examples/tensor_parallel.py``.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from kvtier import Engine, KVLayout, KVTierConfig, Worker, WorkerGroup, chain_keys

WORLD = 2
NUM_BLOCKS = 32


def rank_kv(rank: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """Rank ``rank``'s KV cache: its half of the heads, bytes of its own."""
    kv = torch.zeros(
        2, NUM_BLOCKS, 16, 4, 64, dtype=torch.float16
    )  # (K/V, blocks, tokens, heads, dim)
    kv[:, :4] = torch.randn(2, 4, 16, 4, 64, generator=torch.Generator().manual_seed(rank))
    layout = KVLayout.from_tensors(
        [kv], model_id="demo", block_tokens=16, num_blocks=NUM_BLOCKS, tp_rank=rank, tp_size=WORLD
    )
    return layout, [kv]


async def worker(address: str, rank: int) -> int:
    layout, kv = rank_kv(rank)
    how = await (await Worker.open(address, layout, kv)).serve()
    # The scheduler stored blocks 0-3 and loaded them back into 8-11.
    same = torch.equal(kv[0][:, 8:12], kv[0][:, 0:4])
    print(f"  rank {rank}: serving {how}; blocks 8-11 equal blocks 0-3: {same}")
    return 0 if same else 1


async def scheduler() -> int:
    group = WorkerGroup.bind(WORLD)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", group.address, str(r)
        )
        for r in range(WORLD)
    ]
    try:
        layout, _ = rank_kv(0)  # any rank's layout: the scheduler holds no tensors
        config = KVTierConfig(cpu_bytes_to_use="64MiB", world_size=WORLD)
        async with await Engine.open(config, layout, workers=group) as engine:
            tokens = list(range(64))
            keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
            print(
                f"stored {(await engine.store(keys, [0, 1, 2, 3])).stored} blocks on {WORLD} ranks"
            )
            hits = engine.lookup(keys)
            print(f"lookup: {hits} blocks; loaded {await engine.load(keys[:hits], [8, 9, 10, 11])}")
        codes = [await asyncio.wait_for(p.wait(), 60) for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    print("every rank got its own bytes back" if codes == [0] * WORLD else f"failed: {codes}")
    return max(codes)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(asyncio.run(worker(sys.argv[2], int(sys.argv[3]))))
    sys.exit(asyncio.run(scheduler()))
