"""Device <-> CPU-region copy throughput (CPU backend) beside a contiguous torch copy.

Run from the repository root::

    .venv/bin/python benchmarks/transfer.py            # 512 MiB per measurement, 5 repeats
    .venv/bin/python benchmarks/transfer.py --quick    # 128 MiB, 3 repeats
    .venv/bin/python benchmarks/transfer.py --json

The "device" is a list of 32 K/V-first fp16 tensors (one per layer) sized so
that one offloaded block is 2 MiB, with ``blocks_per_chunk`` 1 and 4. Rows live
in a real :class:`~kvtier.region.CPURegion` (anonymous, THP-backed). Device
block ids are either consecutive or a random permutation (what a serving
engine's allocator hands out after a while). The baseline copies the same
number of bytes between two contiguous tensors in the same run; the ratio is
what carries between machines. Each figure is the median of the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.transfer.device import DeviceTransfer, open_device_transfer

CHUNK = 2 << 20
LAYERS = 32


def contiguous_gbps(nbytes: int, repeat: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


async def timed(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):  # the first one warms up
        t0 = time.perf_counter()
        await fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


async def measure(bpc: int, chunks: int, repeat: int, order: str) -> dict[str, float | int | str]:
    half = CHUNK // (LAYERS * 2 * bpc)  # bytes of one K (or V) half of one device block
    heads, dim = 8, half // (8 * 2)
    kv = [torch.ones(2, chunks * bpc, heads, dim, dtype=torch.float16) for _ in range(LAYERS)]
    layout = KVLayout.from_tensors(
        kv, model_id="bench", block_tokens=16, blocks_per_chunk=bpc, kv_first=True
    )
    assert layout.bytes_per_chunk == CHUNK
    region = CPURegion.create(layout, chunks * CHUNK, alignment=4096)
    xfer: DeviceTransfer = open_device_transfer(layout, kv, region.tensor_views(), backend="cpu")
    try:
        rows = np.arange(region.rows)
        n = len(rows)
        if order == "consecutive":
            ids = np.arange(n * bpc)
        else:
            ids = np.random.default_rng(0).permutation(chunks * bpc)[: n * bpc]
        before = xfer.statistics().copies_issued
        store_s = await timed(lambda: xfer.store(ids, rows), repeat)
        copies = (xfer.statistics().copies_issued - before) / (repeat + 1)
        load_s = await timed(lambda: xfer.load(rows, ids), repeat)
        nbytes = n * CHUNK
        return {
            "blocks_per_chunk": bpc,
            "ids": order,
            "bytes": nbytes,
            "store_gbps": nbytes / store_s / 1e9,
            "load_gbps": nbytes / load_s / 1e9,
            "copies_per_block": copies / n,
        }
    finally:
        await xfer.aclose()
        region.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chunks = 64 if args.quick else 256
    repeat = 3 if args.quick else 5
    results = []
    for bpc in (1, 4):
        for order in ("consecutive", "scattered"):
            base = contiguous_gbps(chunks * CHUNK, repeat)
            r = await measure(bpc, chunks, repeat, order)
            r["contiguous_gbps"] = base
            r["store_ratio"] = float(r["store_gbps"]) / base
            r["load_ratio"] = float(r["load_gbps"]) / base
            results.append(r)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"CPU backend, 2 MiB offloaded blocks, {LAYERS} K/V-first layers, "
          f"{chunks * CHUNK >> 20} MiB per measurement, median of {repeat}; torch threads "
          f"{torch.get_num_threads()}")
    head = ("bpc", "ids", "torch copy", "store", "load", "copies/blk")
    print(f"{head[0]:>3} {head[1]:>11} {head[2]:>10} {head[3]:>14} {head[4]:>14} {head[5]:>10}")
    for r in results:
        print(f"{r['blocks_per_chunk']:>3} {r['ids']:>11} {r['contiguous_gbps']:>7.2f} GB/s"
              f" {r['store_gbps']:>6.2f} ({r['store_ratio']:.2f}x)"
              f" {r['load_gbps']:>6.2f} ({r['load_ratio']:.2f}x) {r['copies_per_block']:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
