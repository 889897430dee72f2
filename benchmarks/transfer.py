"""Device <-> CPU-region copy throughput (CPU backend) beside a contiguous torch copy.

Run from the repository root::

    .venv/bin/python benchmarks/transfer.py            # 512 MiB per measurement, 7 repeats
    .venv/bin/python benchmarks/transfer.py --quick    # 128 MiB, 3 repeats
    .venv/bin/python benchmarks/transfer.py --json
    .venv/bin/python benchmarks/transfer.py --threads 1   # CPU copier without its helper
    .venv/bin/python benchmarks/transfer.py --python-loop # a slice per piece, not compiled
    .venv/bin/python benchmarks/transfer.py --cpu-time    # one thread's CPU time, not wall

The "device" is a list of 32 K/V-first fp16 tensors (one per layer) sized so
that one offloaded block is 2 MiB, with ``blocks_per_chunk`` 1 and 4. Rows live
in a real :class:`~kvtier.region.CPURegion` (anonymous, ``madvise(MADV_HUGEPAGE)``
before first touch, populated up front). Device block ids and rows are either
consecutive or random permutations (what a serving engine's allocator and the
region's free list hand out after a while).

The baseline is ``Tensor.copy_`` of the same number of bytes between two
contiguous tensors; the last lines print the scattered rows' ratios to it, the
figure the compiled copy loop is held to (at least 0.9x). Machines where this
runs are shared and small, so every repeat times the baseline, the store and
the load back to back, and the ratio is taken per repeat: the figures printed
are medians over the repeats (GB/s and ratios separately), with the spread of
the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.transfer._cpu_copy import CpuCopier
from kvtier.transfer.device import (
    DeviceTransfer,
    _match_tensors,
    _match_views,
    _ThreadedTransfer,
    open_device_transfer,
)

CHUNK = 2 << 20
LAYERS = 32


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def _aseconds(fn: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


def _open(
    layout: KVLayout,
    kv: list[torch.Tensor],
    views: list[torch.Tensor],
    threads: int | None,
    compiled: bool,
) -> DeviceTransfer:
    if threads is None and compiled:
        return open_device_transfer(layout, kv, views, backend="cpu")
    # The same copier with another thread count or without the compiled loop, for an A/B
    # (``native`` passed only when off: this file also runs against older checkouts).
    copier = CpuCopier(threads=threads) if compiled else CpuCopier(threads=threads, native=False)
    return _ThreadedTransfer(
        layout, _match_tensors(layout, kv), _match_views(layout, views, torch), copier
    )


def _thread_seconds(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


async def measure(
    bpc: int,
    chunks: int,
    repeat: int,
    order: str,
    threads: int | None,
    compiled: bool = True,
    cpu_time: bool = False,
) -> dict[str, Any]:
    half = CHUNK // (LAYERS * 2 * bpc)  # bytes of one K (or V) half of one device block
    heads, dim = 8, half // (8 * 2)
    kv = [torch.ones(2, chunks * bpc, heads, dim, dtype=torch.float16) for _ in range(LAYERS)]
    layout = KVLayout.from_tensors(
        kv, model_id="bench", block_tokens=16, blocks_per_chunk=bpc, kv_first=True
    )
    if layout.bytes_per_chunk != CHUNK:
        raise SystemExit(f"layout has {layout.bytes_per_chunk} bytes per chunk, not {CHUNK}")
    region = CPURegion.create(layout, chunks * (CHUNK + 4096), alignment=4096)
    xfer = _open(layout, kv, region.tensor_views(), threads, compiled)
    src = torch.ones(chunks * CHUNK, dtype=torch.uint8)
    dst = torch.empty_like(src)
    try:
        n = min(region.rows, chunks)
        rng = np.random.default_rng(0)
        if order == "consecutive":
            rows, ids = np.arange(n), np.arange(n * bpc)
        else:
            rows = rng.permutation(region.rows)[:n]
            ids = rng.permutation(chunks * bpc)[: n * bpc]
        nbytes = n * CHUNK
        base, store, load, store_ratio, load_ratio = [], [], [], [], []
        before = xfer.statistics().copies_issued
        for i in range(repeat + 1):  # the first round warms up (threads, page tables)
            if cpu_time:
                # One thread does all of it (torch and the copier single-threaded, the
                # copy on the calling thread): its CPU time, not the wall clock, which
                # on a shared machine holds whatever else ran.
                tb = _thread_seconds(lambda: dst[:nbytes].copy_(src[:nbytes]))
                ts = _thread_seconds(lambda: xfer.run_now(True, rows, ids))  # type: ignore[attr-defined]
                tl = _thread_seconds(lambda: xfer.run_now(False, rows, ids))  # type: ignore[attr-defined]
            else:
                tb = _seconds(lambda: dst[:nbytes].copy_(src[:nbytes]))
                ts = await _aseconds(lambda: xfer.store(ids, rows))
                tl = await _aseconds(lambda: xfer.load(rows, ids))
            if i == 0:
                continue
            base.append(nbytes / tb / 1e9)
            store.append(nbytes / ts / 1e9)
            load.append(nbytes / tl / 1e9)
            store_ratio.append(tb / ts)
            load_ratio.append(tb / tl)
        copies = (xfer.statistics().copies_issued - before) / (2 * (repeat + 1))
        st = region.statistics()
        return {
            "blocks_per_chunk": bpc,
            "order": order,
            "bytes": nbytes,
            "copy_threads": threads or "default",
            "backing": f"{st.backing}, THP {st.transparent_huge_pages}",
            "contiguous_gbps": statistics.median(base),
            "store_gbps": statistics.median(store),
            "load_gbps": statistics.median(load),
            "store_ratio": statistics.median(store_ratio),
            "load_ratio": statistics.median(load_ratio),
            "store_ratio_range": [min(store_ratio), max(store_ratio)],
            "load_ratio_range": [min(load_ratio), max(load_ratio)],
            "copies_per_offloaded_block": copies / n,
        }
    finally:
        await xfer.aclose()
        region.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB, 3 repeats")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU copier threads (default: its own)"
    )
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument(
        "--python-loop", action="store_true", help="the CPU copier's Python loop, not compiled"
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, its CPU time (for shared machines): torch and the copier single-threaded",
    )
    args = parser.parse_args()
    chunks = 64 if args.quick else 256
    repeat = args.repeat or (3 if args.quick else 7)
    if args.cpu_time:
        torch.set_num_threads(1)
        args.threads = 1
    results = []
    for bpc in (1, 4):
        for order in ("consecutive", "scattered"):
            results.append(
                await measure(
                    bpc, chunks, repeat, order, args.threads, not args.python_loop, args.cpu_time
                )
            )
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"CPU backend, 2 MiB offloaded blocks, {LAYERS} K/V-first fp16 layers, "
        f"{chunks * CHUNK >> 20} MiB per measurement, median of {repeat} interleaved repeats; "
        f"torch threads {torch.get_num_threads()}, copier threads {args.threads or 'default'}, "
        f"{'Python loop' if args.python_loop else 'compiled loop'}"
        f"{', CPU time of one thread' if args.cpu_time else ''}; "
        f"region {results[0]['backing']}"
    )
    print(
        f"{'bpc':>3} {'ids, rows':>11} {'torch copy':>10} {'store (ratio, range)':>27} "
        f"{'load (ratio, range)':>27} {'copies/2MiB':>12}"
    )
    for r in results:
        cells = []
        for what in ("store", "load"):
            lo, hi = r[f"{what}_ratio_range"]
            cells.append(
                f"{r[f'{what}_gbps']:6.2f} GB/s {r[f'{what}_ratio']:.2f}x [{lo:.2f}-{hi:.2f}]"
            )
        print(
            f"{r['blocks_per_chunk']:>3} {r['order']:>11} {r['contiguous_gbps']:>5.2f} GB/s "
            f"{cells[0]:>27} {cells[1]:>27} {r['copies_per_offloaded_block']:>12.2f}"
        )
    for r in results:
        if r["order"] == "scattered":
            ratios = f"store {r['store_ratio']:.2f}x, load {r['load_ratio']:.2f}x"
            print(
                f"scattered ids and rows, bpc {r['blocks_per_chunk']}: {ratios} a contiguous copy "
                "of the same bytes (target >= 0.9)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
