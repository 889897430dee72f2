"""Scheduler and workers in separate processes against the in-process engine.

Run from the repository root (the machines are shared: take the lock)::

    flock /tmp/kvtier-bench.lock .venv/bin/python benchmarks/processes.py
    .venv/bin/python benchmarks/processes.py --quick       # fewer bytes and repeats
    .venv/bin/python benchmarks/processes.py --json

Every engine is a real :class:`kvtier.Engine` on the CPU backend. The
in-process engine holds one KV cache of 8 K/V-first fp16 layers; a split
instance of ``world_size`` W runs its scheduler here (``Engine.open(...,
workers=WorkerGroup)``) and W spawned worker processes, each holding 1/W of
every layer's heads. A row is the same number of bytes in both (256 KiB or
2 MiB, every rank's slice together), so the two move the same bytes.

All engines stay open side by side; every repeat measures them back to back
and takes each ratio within the repeat (the figures are medians over the
repeats, ratios separately from GB/s, with the spread of the ratios).

* **Throughput**: requests of 16 blocks, either awaited one after the other
  (``x1``: every job's round trip to the workers is on the critical path) or
  four in flight at once (``x4``: how a serving engine that does not await
  each step's copies before the next runs them); stores of fresh keys (the
  CPU tier evicts), then loads of stored keys. GB/s counts the row bytes moved.
* **Cost of the boundary**: one-block jobs awaited one at a time, at
  ``world_size`` 1. The cost per job is the split engine's median latency
  less the in-process one's; it is given as a fraction of the copy time (the
  median of the same one-block copy through a bare in-process copier,
  :func:`kvtier.transfer.device.open_device_transfer`, without the engine)
  and of the in-process engine's latency (the copy and the engine's own work).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier import Engine, KVLayout, KVTierConfig, Worker, WorkerGroup, chain_keys
from kvtier.region import CPURegion
from kvtier.transfer.device import open_device_transfer

LAYERS = 8
TOKENS = 16
DEVICE_BLOCKS = 64
DEPTHS = (1, 4)
"""Requests in flight at once: 1 (each awaited before the next), 4 (pipelined)."""
REGION_ROWS = 64
BATCH = 16
ROWS = {"256KiB": 256 << 10, "2MiB": 2 << 20}
WORLDS = (1, 2, 4)


def rank_kv(row: int, rank: int, world: int) -> tuple[KVLayout, list[torch.Tensor]]:
    """Rank ``rank``'s layers: ``row / world`` bytes per block over all of them."""
    hidden = row // (LAYERS * 2 * TOKENS * 2 * world)
    g = torch.Generator().manual_seed(rank)
    kv = [
        torch.randint(0, 1 << 15, (2, DEVICE_BLOCKS, TOKENS, hidden), generator=g).to(torch.float16)
        for _ in range(LAYERS)
    ]
    layout = KVLayout.from_tensors(
        kv,
        model_id="bench-processes",
        block_tokens=TOKENS,
        num_blocks=DEVICE_BLOCKS,
        tp_rank=rank,
        tp_size=world,
    )
    assert layout.bytes_per_chunk * world == row
    return layout, kv


async def worker_main(address: str, row: int, rank: int, world: int) -> None:
    layout, kv = rank_kv(row, rank, world)
    worker = await Worker.open(address, layout, kv, backend="cpu")
    await worker.serve()


@dataclass
class Instance:
    """One open engine and what it needs to be driven."""

    name: str
    engine: Engine
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    next_token: int = 0
    stored: list[bytes] = field(default_factory=list)

    def fresh_keys(self, n: int) -> list[bytes]:
        # Tokens never repeat, so every key is new (the store copies every block).
        start = self.next_token
        self.next_token += n * TOKENS
        tokens = list(range(start + 1_000_000_000, start + 1_000_000_000 + n * TOKENS))
        # A distinct first token per request: its chain starts afresh.
        return chain_keys(tokens, TOKENS, self.engine.namespace)

    async def aclose(self) -> None:
        await self.engine.aclose()
        for p in self.procs:
            try:
                await asyncio.wait_for(p.wait(), 30)
            except TimeoutError:
                p.kill()
                await p.wait()


def config(row: int, world: int) -> KVTierConfig:
    return KVTierConfig(cpu_bytes_to_use=REGION_ROWS * row, world_size=world)


async def open_in_process(row: int) -> Instance:
    layout, kv = rank_kv(row, 0, 1)
    engine = await Engine.open(config(row, 1), layout, kv, backend="cpu")
    return Instance("in-process", engine)


async def open_split(row: int, world: int) -> Instance:
    group = WorkerGroup.bind(world)
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--worker", group.address, str(row), str(r), str(world)
        )
        for r in range(world)
    ]
    try:
        layout, _ = rank_kv(row, 0, world)
        engine = await Engine.open(config(row, world), layout, workers=group, worker_timeout=120)
    except BaseException:
        for p in procs:
            p.kill()
            await p.wait()
        raise
    return Instance(f"workers={world}", engine, procs)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def in_flight(depth: int, requests: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run ``requests`` requests with at most ``depth`` in flight; each gets its slot."""
    slots = asyncio.Queue[int]()
    for s in range(depth):
        slots.put_nowait(s)

    async def go(i: int) -> None:
        slot = await slots.get()
        try:
            await one(slot)
        finally:
            slots.put_nowait(slot)

    await asyncio.gather(*(go(i) for i in range(requests)))


def slot_ids(slot: int) -> list[int]:
    return list(range(slot * BATCH, (slot + 1) * BATCH))


async def store_gbps(inst: Instance, requests: int, row: int, depth: int) -> float:
    batches = [inst.fresh_keys(BATCH) for _ in range(requests)]
    todo = iter(batches)

    async def one(slot: int) -> None:
        summary = await inst.engine.store(next(todo), slot_ids(slot))
        assert summary.stored == BATCH, summary

    seconds = await timed(lambda: in_flight(depth, requests, one))
    inst.stored = batches[-1]
    return requests * BATCH * row / seconds / 1e9


async def load_gbps(inst: Instance, requests: int, row: int, depth: int) -> float:
    keys = inst.stored
    assert inst.engine.lookup(keys) == BATCH

    async def one(slot: int) -> None:
        assert await inst.engine.load(keys, slot_ids(slot)) == BATCH

    return requests * BATCH * row / await timed(lambda: in_flight(depth, requests, one)) / 1e9


async def job_seconds(inst: Instance, kind: str, jobs: int) -> float:
    """Median latency of one-block jobs awaited one at a time."""
    times = []
    if kind == "store":
        batches = [inst.fresh_keys(1) for _ in range(jobs)]
        for keys in batches:
            times.append(await timed(lambda k=keys: inst.engine.store(k, [0])))  # type: ignore[misc]
    else:
        key = inst.fresh_keys(1)
        assert (await inst.engine.store(key, [0])).stored == 1
        for _ in range(jobs):
            times.append(await timed(lambda: inst.engine.load(key, [BATCH])))
    return statistics.median(times)


async def copy_seconds(row: int, jobs: int) -> dict[str, float]:
    """Median time of a bare in-process copy of one block, each way (no engine)."""
    layout, kv = rank_kv(row, 0, 1)
    region = CPURegion.create(layout, REGION_ROWS * row, pin="off")
    xfer = open_device_transfer(layout, kv, region.tensor_views(), backend="cpu")
    out: dict[str, float] = {}
    try:
        for kind in ("store", "load"):
            times = []
            for i in range(jobs):
                r = i % REGION_ROWS
                t0 = time.perf_counter()
                await (xfer.store([0], [r]) if kind == "store" else xfer.load([r], [BATCH]))
                times.append(time.perf_counter() - t0)
            out[kind] = statistics.median(times)
    finally:
        await xfer.aclose()
        region.close()
    return out


_KINDS = (("store", store_gbps), ("load", load_gbps))


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}"


async def bench(quick: bool) -> dict[str, Any]:
    repeats = 3 if quick else 7
    volume = (64 if quick else 256) << 20
    out: dict[str, Any] = {"repeats": repeats, "bytes_per_measurement": volume, "rows": {}}
    for label, row in ROWS.items():
        requests = max(1, volume // (BATCH * row))
        jobs = 50 if row >= 1 << 20 else 200
        if quick:
            jobs //= 2
        instances = [await open_in_process(row)]
        try:
            for world in WORLDS:
                instances.append(await open_split(row, world))
            base = instances[0]
            modes = [(f"{k} x{d}", fn, d) for d in DEPTHS for k, fn in _KINDS]
            gb: dict[str, dict[str, list[float]]] = {
                i.name: {m: [] for m, _, _ in modes} for i in instances
            }
            ratio: dict[str, dict[str, list[float]]] = {
                i.name: {m: [] for m, _, _ in modes} for i in instances[1:]
            }
            lat: dict[str, dict[str, list[float]]] = {
                i.name: {"store": [], "load": []} for i in instances[:2]
            }
            copy: dict[str, list[float]] = {"store": [], "load": []}
            for inst in instances:  # warm-up: threads started, pages touched
                for _, fn, d in modes:
                    await fn(inst, max(4, requests // 4), row, d)
            for _ in range(repeats):
                for mode, fn, d in modes:
                    here = {i.name: await fn(i, requests, row, d) for i in instances}
                    for name, v in here.items():
                        gb[name][mode].append(v)
                        if name != base.name:
                            ratio[name][mode].append(v / here[base.name])
                for kind in ("store", "load"):
                    for inst in instances[:2]:
                        lat[inst.name][kind].append(await job_seconds(inst, kind, jobs))
                for kind, seconds in (await copy_seconds(row, jobs)).items():
                    copy[kind].append(seconds)
        finally:
            for inst in instances:
                await inst.aclose()
        med = statistics.median
        result: dict[str, Any] = {
            "gbps": {n: {k: med(v) for k, v in d.items()} for n, d in gb.items()},
            "ratio": {n: {k: med(v) for k, v in d.items()} for n, d in ratio.items()},
            "ratio_spread": {n: {k: spread(v) for k, v in d.items()} for n, d in ratio.items()},
            "job_us": {},
        }
        for kind in ("store", "load"):
            inproc = med(lat["in-process"][kind])
            split = med(lat["workers=1"][kind])
            bare = med(copy[kind])
            result["job_us"][kind] = {
                "copy": bare * 1e6,
                "in_process": inproc * 1e6,
                "workers=1": split * 1e6,
                "boundary": (split - inproc) * 1e6,
                "of_copy": (split - inproc) / bare,
                "fraction": (split - inproc) / inproc,
            }
        out["rows"][label] = result
    return out


def show(r: dict[str, Any]) -> None:
    mib = r["bytes_per_measurement"] >> 20
    print(
        f"Throughput, GB/s of rows moved (requests of {BATCH} blocks, x1: one in flight, "
        f"x{DEPTHS[-1]}: {DEPTHS[-1]} in flight; {mib} MiB per measurement, median of "
        f"{r['repeats']} repeats); ratio = workers / in-process within each repeat "
        "(median, spread)"
    )
    modes = [f"{k} x{d}" for d in DEPTHS for k, _ in _KINDS]
    print("| row | engine | " + " | ".join(f"{m} GB/s (ratio, spread)" for m in modes) + " |")
    print("|---|---|" + "---:|" * len(modes))
    for label, res in r["rows"].items():
        for name, g in res["gbps"].items():
            cells = []
            for m in modes:
                if name in res["ratio"]:
                    rt, sp = res["ratio"][name][m], res["ratio_spread"][name][m]
                    cells.append(f"{g[m]:.2f} ({rt:.2f}, {sp})")
                else:
                    cells.append(f"{g[m]:.2f}")
            print(f"| {label} | {name} | " + " | ".join(cells) + " |")
    print()
    print("Cost of the process boundary per job (one-block jobs awaited one at a time, world 1)")
    print(
        "| row | job | copy µs | in-process µs | workers=1 µs | boundary µs "
        "| boundary / copy | boundary / in-process |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, res in r["rows"].items():
        for kind, j in res["job_us"].items():
            print(
                f"| {label} | {kind} | {j['copy']:.0f} | {j['in_process']:.0f} "
                f"| {j['workers=1']:.0f} | {j['boundary']:.0f} | {j['of_copy']:.2f} "
                f"| {j['fraction']:.2f} |"
            )


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        address, row, rank, world = sys.argv[2], *map(int, sys.argv[3:6])
        asyncio.run(worker_main(address, row, rank, world))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer bytes and repeats")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    result = asyncio.run(bench(args.quick))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
