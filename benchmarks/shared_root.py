"""What a second instance on the same file-tier root costs, and how soon it sees a write.

Run from the repository root (the machines are shared: take the lock)::

    flock /tmp/kvtier-bench.lock .venv/bin/python benchmarks/shared_root.py
    .venv/bin/python benchmarks/shared_root.py --quick        # under a minute
    .venv/bin/python benchmarks/shared_root.py --json /tmp/shared_root.json

Every tier is a real :class:`~kvtier.tiers.file.FileTier` (O_DIRECT,
io_uring, ``queue_depth`` 8) with ``instances=2``, so a partition has the same
share of the budget whether or not another instance uses the root.

**Cost of a second instance.** This process opens two tiers: *alone* on a
root nobody else uses, *shared* on a root where a second process (this
script with ``--child busy``) stores fresh blocks at full speed (evicting),
loads its own and loads this process's. Each round measures the same
operations on one tier, then on the other (ABBA order across rounds), with
the second process stopped (``SIGSTOP``) while *alone* is measured and
running (``SIGCONT``) while *shared* is: one instance alone against the same
with a second one at work on its root. Operations, each ``--batch`` blocks:
a store of fresh keys (evicting), a load of this tier's own blocks, and
lookups (no I/O) of its own blocks, of absent keys, and (shared only) of the
other process's blocks; a load of the other process's blocks (shared only)
is compared with the own load measured alone. Figures are per-round medians;
each ratio is the median over rounds of that round's ratio, with its range
(the machine is shared and noisy: ratios carry over, absolute times do not).
On a machine with few cores the second process also takes a core: that is
part of what it costs.

**Visibility.** A second process (``--child publish``) stores one block at a
time, at random intervals, and notes the monotonic time each store completed
(CLOCK_MONOTONIC is the machine's: comparable across processes); this process,
idle, notes when each key became visible to its lookups (its tier's ``watch``
listener fires in the same poll that makes ``lookup`` true). Printed: median
and p99 of the difference, with ``peer_poll_s`` (default 0.02 s: the expected
median is about half of it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.config import FileTierConfig
from kvtier.layout import KVLayout, TensorSpec
from kvtier.tiers.file import FileTier

BLOCK = 64 << 10
"""Payload bytes of a block."""
SLOTS = 256
"""Slots of each partition."""
DEPTH = 8


def layout() -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 4096), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="bench-shared-root", block_tokens=16)


def config(root: Path, poll_s: float) -> FileTierConfig:
    return FileTierConfig(
        root=root,
        bytes_to_use=2 * FileTier.budget_for(SLOTS, BLOCK),
        instances=2,
        queue_depth=DEPTH,
        peer_poll_s=poll_s,
    )


async def open_tier(root: Path, poll_s: float) -> FileTier:
    return await FileTier.open(config(root, poll_s), layout(), block_bytes=BLOCK)


class Rows:
    """Page-aligned rows (what a CPU region's rows look like), random bytes."""

    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map[:] = random.Random(n).randbytes(n * BLOCK)
        whole = memoryview(self.map)
        self.views = [whole[i * BLOCK : (i + 1) * BLOCK] for i in range(n)]


def fresh(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


# -- the second process -------------------------------------------------------------------


async def child_busy(root: Path, batch: int, poll_s: float) -> None:
    """Store fresh blocks at full speed (evicting), load own and the other's, until killed."""
    tier = await open_tier(root, poll_s)
    theirs: dict[bytes, None] = {}

    def changed(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        for k in removed:
            theirs.pop(k, None)
        theirs.update(dict.fromkeys(added))

    tier.watch(changed)
    rows = Rows(batch)
    mine: list[bytes] = []
    print(json.dumps({"ready": tier.statistics().partition}), flush=True)
    while True:
        keys = fresh(batch)
        result = await tier.store(keys, rows.views)
        mine = [*mine, *result.stored][-SLOTS // 2 :]
        await tier.load(mine[-batch:], rows.views[: len(mine[-batch:])])
        other = list(theirs)[-batch:]
        if other:
            await tier.load(other, rows.views[: len(other)])


async def child_publish(root: Path, count: int, poll_s: float) -> None:
    """Store ``count`` blocks one at a time at random intervals; print when each completed."""
    tier = await open_tier(root, poll_s)
    rows = Rows(1)
    rng = random.Random(7)
    await tier.store(fresh(1), rows.views)  # the other finds the partition with it
    print(json.dumps({"ready": tier.statistics().partition}), flush=True)
    sys.stdin.readline()  # go
    done = []
    for _ in range(count):
        await asyncio.sleep(rng.uniform(0, 2 * poll_s))
        key = fresh(1)
        await tier.store(key, rows.views)
        done.append((key[0].hex(), time.monotonic()))
    print(json.dumps({"done": done}), flush=True)
    await tier.aclose()


async def spawn(*args: object) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        *map(str, args),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    if not line:
        raise RuntimeError("the child process failed to open its tier")
    return proc


# -- the measurements ---------------------------------------------------------------------


async def timed(op: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await op()
    return time.perf_counter() - start


def timed_lookups(tier: FileTier, keys: list[bytes], calls: int) -> float:
    """Seconds per ``tier.lookup(keys)`` call, over ``calls`` calls."""
    lookup = tier.lookup
    start = time.perf_counter()
    for _ in range(calls):
        lookup(keys)
    return (time.perf_counter() - start) / calls


async def measure(
    tier: FileTier, rows: Rows, peer: dict[bytes, None] | None, ops: int, batch: int
) -> dict[str, float]:
    """Median seconds of each operation over ``ops`` repetitions on ``tier``
    (``peer``: the keys the other partitions hold, kept by a ``watch`` listener)."""
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    absent = fresh(batch)
    for _ in range(ops):
        keys = fresh(batch)
        add("store", await timed(lambda k=keys: tier.store(k, rows.views)))  # type: ignore[misc]
        own = keys if all(tier.is_ready(k) for k in keys) else []
        if own:
            add("load own", await timed(lambda k=own: tier.load(k, rows.views)))  # type: ignore[misc]
            add("lookup own", timed_lookups(tier, own, 200))
        add("lookup absent", timed_lookups(tier, absent, 200))
        if peer is not None:
            theirs = list(peer)[-batch:]
            if len(theirs) == batch:
                add("lookup peer", timed_lookups(tier, theirs, 200))
                add("load peer", await timed(lambda k=theirs: tier.load(k, rows.views)))  # type: ignore[misc]
        await asyncio.sleep(0)
    return {name: statistics.median(v) for name, v in times.items()}


async def overhead(work: Path, rounds: int, ops: int, batch: int, poll_s: float) -> dict[str, Any]:
    alone = await open_tier(work / "alone", poll_s)
    shared = await open_tier(work / "shared", poll_s)
    theirs: dict[bytes, None] = {}

    def changed(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        for k in removed:
            theirs.pop(k, None)
        theirs.update(dict.fromkeys(added))

    shared.watch(changed)
    rows = Rows(batch)
    busy = await spawn("--child", "busy", work / "shared", "--batch", batch, "--poll", poll_s)
    per_round: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(rounds):
            order = ["alone", "shared"] if r % 2 == 0 else ["shared", "alone"]
            figures: dict[str, dict[str, float]] = {}
            for mode in order:
                if mode == "alone":
                    busy.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(0.05)
                    figures[mode] = await measure(alone, rows, None, ops, batch)
                else:
                    busy.send_signal(signal.SIGCONT)
                    await asyncio.sleep(0.2)  # it runs again, and its blocks are known
                    figures[mode] = await measure(shared, rows, theirs, ops, batch)
            per_round.append(figures)
        stats = shared.statistics()
    finally:
        busy.send_signal(signal.SIGCONT)
        busy.kill()
        await busy.wait()
        await alone.aclose()
        await shared.aclose()
    rows_out: dict[str, Any] = {}
    pairs = [
        ("store", "store", "store"),
        ("load own", "load own", "load own"),
        ("load peer", "load own", "load peer (vs own, alone)"),
        ("lookup own", "lookup own", "lookup own"),
        ("lookup absent", "lookup absent", "lookup absent"),
        ("lookup peer", "lookup own", "lookup peer (vs own, alone)"),
    ]
    for shared_op, alone_op, label in pairs:
        rounds_ok = [f for f in per_round if shared_op in f["shared"] and alone_op in f["alone"]]
        if not rounds_ok:
            continue
        ratios = [f["shared"][shared_op] / f["alone"][alone_op] for f in rounds_ok]
        rows_out[label] = {
            "alone_s": statistics.median(f["alone"][alone_op] for f in rounds_ok),
            "shared_s": statistics.median(f["shared"][shared_op] for f in rounds_ok),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds": len(rounds_ok),
        }
    rows_out["_shared_tier"] = {
        "peer_hits": stats.peer_hits,
        "peer_stale": stats.peer_stale,
        "peer_blocks": stats.peer_blocks,
    }
    return rows_out


async def visibility(work: Path, count: int, poll_s: float) -> dict[str, Any]:
    tier = await open_tier(work / "visibility", poll_s)
    seen: dict[str, float] = {}
    found = asyncio.Event()

    def changed(added: Sequence[bytes], _removed: Sequence[bytes]) -> None:
        now = time.monotonic()
        for k in added:
            seen.setdefault(k.hex(), now)
        if added:
            found.set()

    tier.watch(changed)
    publisher = await spawn(
        "--child", "publish", work / "visibility", "--count", count, "--poll", poll_s
    )
    try:
        assert publisher.stdin is not None
        assert publisher.stdout is not None
        # Its partition is new: found by the next listing of the root (every
        # second), with the block it stored first; not timed. Then its blocks
        # are found by the polls.
        await asyncio.wait_for(found.wait(), 10)
        publisher.stdin.write(b"go\n")
        await publisher.stdin.drain()
        line = await asyncio.wait_for(publisher.stdout.readline(), 60 + count * 4 * poll_s)
        done = json.loads(line)["done"]
        await asyncio.sleep(3 * poll_s)  # the last ones
        await publisher.wait()
    finally:
        if publisher.returncode is None:
            publisher.kill()
            await publisher.wait()
        await tier.aclose()
    delays = sorted(seen[k] - t for k, t in done if k in seen)
    return {
        "peer_poll_s": poll_s,
        "blocks": count,
        "seen": len(delays),
        "median_s": statistics.median(delays),
        "p99_s": delays[min(len(delays) - 1, int(0.99 * len(delays)))],
        "max_s": delays[-1],
    }


def table(over: dict[str, Any], vis: dict[str, Any], batch: int) -> str:
    lines = [
        f"second instance on the root: {batch}-block operations, medians "
        f"(ratio = shared / alone, median over rounds [min-max])",
        f"{'operation':<28}{'alone':>12}{'shared':>12}{'ratio':>8}  range",
    ]
    for label, row in over.items():
        if label.startswith("_"):
            continue
        lines.append(
            f"{label:<28}{fmt(row['alone_s']):>12}{fmt(row['shared_s']):>12}"
            f"{row['ratio']:>7.2f}x  [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]"
        )
    lines.append(
        f"visibility of a write in another process (peer_poll_s={vis['peer_poll_s']} s, "
        f"{vis['seen']}/{vis['blocks']} blocks): median {vis['median_s'] * 1e3:.1f} ms, "
        f"p99 {vis['p99_s'] * 1e3:.1f} ms, max {vis['max_s'] * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms"


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvtier-shared-root-", dir=args.dir))
    try:
        rounds, ops, count = (4, 30, 100) if args.quick else (args.rounds, args.ops, args.count)
        over = await overhead(work, rounds, ops, args.batch, args.poll)
        vis = await visibility(work, count, args.poll)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(over, vis, args.batch))
    if args.json:
        text = json.dumps({"overhead": over, "visibility": vis}, indent=2)
        await asyncio.to_thread(Path(args.json).write_text, text)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="4 rounds of 30, 100 visibility blocks")
    p.add_argument("--rounds", type=int, default=8, help="alone/shared rounds (default 8)")
    p.add_argument("--ops", type=int, default=60, help="repetitions per round (default 60)")
    p.add_argument("--count", type=int, default=300, help="blocks timed for visibility")
    p.add_argument("--batch", type=int, default=16, help="blocks per operation (default 16)")
    p.add_argument("--poll", type=float, default=0.02, help="peer_poll_s (default 0.02)")
    p.add_argument("--dir", default=None, help="where the roots go (default: the temp dir)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--child", choices=["busy", "publish"], help=argparse.SUPPRESS)
    p.add_argument("root", nargs="?", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    options = parse()
    if options.child == "busy":
        asyncio.run(child_busy(options.root, options.batch, options.poll))
    elif options.child == "publish":
        asyncio.run(child_publish(options.root, options.count, options.poll))
    else:
        asyncio.run(main(options))
