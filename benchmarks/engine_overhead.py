"""The Engine's own scheduling cost per block, beside the residency manager's per key.

Run from the repository root::

    .venv/bin/python benchmarks/engine_overhead.py            # 200 requests x 32 blocks, 7 repeats
    .venv/bin/python benchmarks/engine_overhead.py --quick    # 100 requests, 3 repeats
    .venv/bin/python benchmarks/engine_overhead.py --profile  # and cProfile one pass
    .venv/bin/python benchmarks/engine_overhead.py --sweep    # copy on the loop vs a thread

An :class:`~kvtier.engine.Engine` on the CPU backend, no tier below the CPU
region, tiny blocks (two K/V-first fp16 tensors of 16 tokens x 1 head x 8:
1 KiB per offloaded block), so that what is timed is the engine's scheduling
and not bytes. Requests of ``--blocks`` keys are awaited one after another,
the way a serving loop hands them over:

``store``
    ``await engine.store(keys, ids)`` of fresh keys.
``lookup + load``
    ``engine.lookup(keys)``, then ``await engine.load(keys, ids)`` of the
    stored keys (every one a CPU hit).

In the same run, per repeat, the same requests through a bare
:class:`~kvtier.manager.ResidencyManager` of the same capacity: the calls the
engine makes of it, and nothing else (``prepare_store`` + ``complete_store``;
``lookup`` + ``prepare_load`` + ``complete_load``), and the copy itself on the
calling thread (``run_now`` of a device transfer over the same tensors, the
same request shapes). The figures printed are medians over the repeats, in us
per block; ``engine / manager`` and ``engine - manager - copy`` (what the
engine adds over its parts) are taken per repeat. ``loop iterations`` counts
the event loop's turns per awaited call.

``--sweep`` measures what :data:`kvtier.engine.INLINE_COPY_BYTES` is chosen
from: for loads of 16 KiB to 4 MiB (16 KiB blocks), the copy run on the
calling thread (``run_now``: the time it blocks the event loop) against the
same copy handed to the copier's thread and awaited (what the caller waits,
the hop included), interleaved, medians of ``--repeats``.

The machine this runs on is shared and noisy: compare the ratios, not the
microseconds, between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier import KVLayout, KVTierConfig, chain_keys
from kvtier.engine import Engine
from kvtier.manager import ResidencyManager
from kvtier.region import CPURegion
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import (
    DeviceTransfer,
    RunsNow,
    TransferStatistics,
    open_device_transfer,
)

NUM_BLOCKS = 128
BLOCK_TOKENS = 16
PAGE = 4096


@dataclass(frozen=True, slots=True)
class Figures:
    """One repeat, in us per block (per key for the manager)."""

    store: float
    """``Engine.store`` of a request, over its blocks."""
    load: float
    """``Engine.lookup`` + ``Engine.load`` of a request, over its blocks."""
    manager_store: float
    """``prepare_store`` + ``complete_store`` on a bare manager, over the keys."""
    manager_load: float
    """``lookup`` + ``prepare_load`` + ``complete_load`` on a bare manager, over the keys."""
    copy_store: float
    """The store's copy alone (``run_now`` on the calling thread), over the blocks."""
    copy_load: float
    """The load's copy alone, over the blocks."""
    sched_store: float
    """``Engine.store`` of an engine whose device transfer copies nothing."""
    sched_load: float
    """``Engine.lookup`` + ``Engine.load`` of that engine."""
    loop_store: float
    """Event-loop iterations per ``Engine.store`` call."""
    loop_load: float
    """Event-loop iterations per ``Engine.load`` call."""


class _CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts its iterations (``_run_once`` calls)."""

    turns = 0

    def _run_once(self) -> None:
        self.turns += 1
        super()._run_once()  # type: ignore[misc]


class _NoCopy(DeviceTransfer):
    """A device transfer that copies nothing on the calling thread (``run_now``).

    An engine over it does all its own work and none of the copier's: its
    time is the engine's scheduling alone. Larger requests (none here) would
    go to the real copier.
    """

    def __init__(self, inner: DeviceTransfer) -> None:
        self._inner = inner

    @property
    def backend(self) -> str:
        return self._inner.backend

    def store(self, device_block_ids: Any, rows: Any) -> Completion[None]:
        return self._inner.store(device_block_ids, rows)

    def load(self, rows: Any, device_block_ids: Any, skip: int = 0) -> Completion[None]:
        return self._inner.load(rows, device_block_ids, skip)

    def run_now(self, store: bool, rows: Any, device_block_ids: Any, skip: int = 0) -> None:
        pass

    def statistics(self) -> TransferStatistics:
        return self._inner.statistics()

    async def aclose(self) -> None:
        await self._inner.aclose()


def _kv() -> list[torch.Tensor]:
    return [torch.zeros(2, NUM_BLOCKS, BLOCK_TOKENS, 1, 8, dtype=torch.float16) for _ in range(2)]


def _layout(kv: list[torch.Tensor]) -> KVLayout:
    return KVLayout.from_tensors(
        kv, model_id="overhead", block_tokens=BLOCK_TOKENS, num_blocks=NUM_BLOCKS
    )


def _requests(n: int, blocks: int, salt: int) -> list[list[bytes]]:
    keys = chain_keys(
        np.arange(n * blocks * BLOCK_TOKENS, dtype=np.int64) + salt * 10**9,
        BLOCK_TOKENS,
        b"overhead",
    )
    return [keys[i * blocks : (i + 1) * blocks] for i in range(n)]


def _per_block(seconds: float, blocks: int) -> float:
    return seconds / blocks * 1e6


def _manager(capacity: int, reqs: list[list[bytes]]) -> tuple[float, float]:
    """The manager's own calls for the same requests: seconds for stores, for loads."""
    m = ResidencyManager(capacity, "lru", tier="cpu")
    clock = time.perf_counter
    t0 = clock()
    for keys in reqs:
        plan = m.prepare_store(keys)
        assert plan is not None
        m.complete_store(plan.keys)
    t1 = clock()
    for keys in reqs:
        n = m.lookup(keys)
        head = keys[:n]
        m.prepare_load(head)
        m.complete_load(head)
    return t1 - t0, clock() - t1


def _copies(xfer: RunsNow, reqs: int, ids: np.ndarray) -> tuple[float, float]:
    """The copies alone, on this thread: seconds for ``reqs`` stores, then as many loads."""
    rows = np.arange(ids.size, dtype=np.int64)
    clock = time.perf_counter
    t0 = clock()
    for _ in range(reqs):
        xfer.run_now(True, rows, ids)
    t1 = clock()
    for _ in range(reqs):
        xfer.run_now(False, rows, ids)
    return t1 - t0, clock() - t1


async def _engine_pass(
    engine: Engine, reqs: list[list[bytes]], ids: np.ndarray, loop: _CountingLoop
) -> tuple[float, float, int, int]:
    """Store every request, then look up and load each: seconds and loop turns of each."""
    clock = time.perf_counter
    turns = loop.turns
    t0 = clock()
    for keys in reqs:
        await engine.store(keys, ids)
    t1 = clock()
    turns_store = loop.turns - turns
    turns = loop.turns
    for keys in reqs:
        n = engine.lookup(keys)
        got = await engine.load(keys[:n], ids)
        assert got == len(keys), (got, len(keys))
    t2 = clock()
    return t1 - t0, t2 - t1, turns_store, loop.turns - turns


async def _run(args: argparse.Namespace, loop: _CountingLoop) -> list[Figures]:
    kv = _kv()
    layout = _layout(kv)
    blocks, n = args.blocks, args.requests
    capacity = n * blocks + blocks
    # Rows are page-aligned by default: one 4 KiB page per tiny row.
    row = -(-layout.bytes_per_chunk // PAGE) * PAGE
    config = KVTierConfig(cpu_bytes_to_use=capacity * row)
    ids = np.arange(blocks, dtype=np.int64)
    region = CPURegion.create(layout, blocks * row)
    xfer = open_device_transfer(layout, kv, region.tensor_views(), backend="cpu")
    assert isinstance(xfer, RunsNow)
    out: list[Figures] = []
    try:
        async with (
            await Engine.open(config, layout, kv, backend="cpu") as engine,
            await Engine.open(config, layout, kv, backend="cpu", wrap_transfer=_NoCopy) as bare,
        ):
            cap = engine.statistics().tiers["cpu"].statistics.capacity
            # Warm-up: threads started, code paths and allocators hot.
            for e in (engine, bare):
                await _engine_pass(e, _requests(min(n, 20), blocks, salt=999), ids, loop)
            for rep in range(args.repeats):
                reqs = _requests(n, blocks, salt=rep)
                ms, ml = _manager(cap, reqs)
                cs, cl = _copies(xfer, n, ids)
                ss, sl, _ts, _tl = await _engine_pass(bare, reqs, ids, loop)
                if args.profile and rep == args.repeats - 1:
                    prof = cProfile.Profile()
                    prof.enable()
                es, el, ts, tl = await _engine_pass(engine, reqs, ids, loop)
                if args.profile and rep == args.repeats - 1:
                    prof.disable()
                    s = io.StringIO()
                    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
                    print(s.getvalue())
                k = n * blocks
                out.append(
                    Figures(
                        store=_per_block(es, k),
                        load=_per_block(el, k),
                        manager_store=_per_block(ms, k),
                        manager_load=_per_block(ml, k),
                        copy_store=_per_block(cs, k),
                        copy_load=_per_block(cl, k),
                        sched_store=_per_block(ss, k),
                        sched_load=_per_block(sl, k),
                        loop_store=ts / n,
                        loop_load=tl / n,
                    )
                )
    finally:
        await xfer.aclose()
        region.close()
    return out


async def _sweep(repeats: int) -> None:
    """Loads of growing size: on this thread against handed to the copier's thread."""
    blocks = 512
    kv = [torch.zeros(2, blocks, 16, 4, 32, dtype=torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, model_id="sweep", block_tokens=16, num_blocks=blocks)
    region = CPURegion.create(layout, blocks * layout.bytes_per_chunk)
    xfer = open_device_transfer(layout, kv, region.tensor_views(), backend="cpu")
    assert isinstance(xfer, RunsNow)
    clock = time.perf_counter
    print(f"\nLoads of n blocks of {layout.bytes_per_chunk >> 10} KiB, CPU backend, us per call")
    print(f"(median of {repeats} x 20 calls each)\n")
    print(f"{'KiB':>7}{'on the loop':>13}{'via thread':>12}{'thread - loop':>15}")
    try:
        for n in (1, 4, 16, 32, 64, 256):
            rows = np.arange(n, dtype=np.int64)
            ids = np.arange(n, dtype=np.int64)
            now: list[float] = []
            hop: list[float] = []
            await xfer.load(rows, ids)
            for _ in range(repeats):
                t0 = clock()
                for _ in range(20):
                    xfer.run_now(False, rows, ids)
                now.append((clock() - t0) / 20)
                t0 = clock()
                for _ in range(20):
                    await xfer.load(rows, ids)
                hop.append((clock() - t0) / 20)
            a, b = statistics.median(now) * 1e6, statistics.median(hop) * 1e6
            kib = n * layout.bytes_per_chunk >> 10
            print(f"{kib:>7}{a:>13.1f}{b:>12.1f}{b - a:>15.1f}")
    finally:
        await xfer.aclose()
        region.close()


def _median(figs: list[Figures], fn: Callable[[Figures], float]) -> float:
    return statistics.median(fn(f) for f in figs)


def _spread(figs: list[Figures], fn: Callable[[Figures], float]) -> str:
    vals = [fn(f) for f in figs]
    return f"{min(vals):.2f}-{max(vals):.2f}"


def _column(f: Figures, what: str, col: str) -> float:
    """One figure of one repeat, by column name."""
    if col == "sched/manager":
        return float(getattr(f, f"sched_{what}") / getattr(f, f"manager_{what}"))
    name = {"engine": what, "scheduling": f"sched_{what}", "loop turns": f"loop_{what}"}
    return float(getattr(f, name.get(col, f"{col}_{what}")))


def report(figs: list[Figures], blocks: int) -> dict[str, Any]:
    """Print the table; return the medians (and every repeat) for ``--json``."""
    print(f"\nEngine scheduling cost, {blocks}-block requests, CPU backend, tiny blocks")
    print(f"(median of {len(figs)} repeats; us per block, per key for the manager)\n")
    cols = ("engine", "copy", "scheduling", "manager", "sched/manager", "loop turns")
    print(f"{'':<15}" + "".join(f"{c:>14}" for c in cols))
    rows: dict[str, Any] = {}
    for what, label in (("store", "store"), ("load", "lookup + load")):
        med = {c: _median(figs, partial(_column, what=what, col=c)) for c in cols}
        spread = {c: _spread(figs, partial(_column, what=what, col=c)) for c in cols}
        print(f"{label:<15}" + "".join(f"{med[c]:>14.2f}" for c in cols))
        rows[what] = {**med, "spread": spread}
    print("\nspread over the repeats (min-max):")
    for what in ("store", "load"):
        print(f"  {what}: " + ", ".join(f"{c} {v}" for c, v in rows[what]["spread"].items()))
    print(
        "\nengine: the awaited calls; copy: the same copies alone on this thread (the device"
        "\ntransfer's run_now: its validation, planning and memcpy); scheduling: the same calls"
        "\nof an engine whose transfer copies nothing (the manager's calls included)."
        "\nTarget (issue 37): <= 2 us per block."
    )
    rows["repeats"] = [asdict(f) for f in figs]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per repeat")
    ap.add_argument("--blocks", type=int, default=32, help="blocks per request")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="100 requests, 3 repeats")
    ap.add_argument("--profile", action="store_true", help="cProfile the last repeat")
    ap.add_argument("--sweep", action="store_true", help="copy on the loop vs on a thread")
    ap.add_argument("--json", metavar="PATH", help="write every figure")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 100, 3
    if args.sweep:
        asyncio.run(_sweep(args.repeats))
        return
    loop = _CountingLoop()
    try:
        figs = loop.run_until_complete(_run(args, loop))
    finally:
        loop.close()
    rows = report(figs, args.blocks)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
