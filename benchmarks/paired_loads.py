"""Two checkouts' verified loads at the same time on one CPU: their CPU per GB, and the ratio.

Run from the repository root::

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/paired_loads.py --a /tmp/before --b . --block 256K
    .venv/bin/python benchmarks/paired_loads.py --a . --lean --block 256K --depth 64

On this shared VM a checkout's CPU per GB of loads moves by 10-20% from one
run to the next, more than most changes worth measuring, so two runs one
after the other cannot tell a 5% change from noise. Here both checkouts load
at once, each in its own process, pinned to the same CPU (``--cpu``, by
default one that does not take the disk's interrupts): whatever else the
machine does then weighs on both alike, and the ratio of their CPU per GB
repeats within about 1% (the same checkout on both sides: 0.996-1.004).

Each process imports kvtier from its checkout (and says which file it ran:
a script that imports ``benchmarks/file_tier.py`` first gets the repository
it lives in instead), opens a file tier of ``--total`` bytes of
``--block`` blocks (io_uring, ``--depth``, rows registered), stores every
block, waits until both are ready, then loads the whole tier again and
again for ``--seconds``; its CPU time (all threads) over the bytes loaded is
its figure. The two share the disk too, so each one's GB/s is about half of
what it reaches alone; compare CPU per GB, not throughput.

``--lean`` (instead of ``--b``) runs on the b side, from ``--a``'s checkout,
the least Python a verified load loop can run on kvtier's own ring and
compiled helpers: the same tier's slots read at the same depth, each reap
one callback (``Ring.reap_runs``, ``verify_reaped`` over lists built once,
one ``Ring.prep_rw`` and submission for as many new reads), with no engine
batches, no pipeline and no residency bookkeeping. It is not a tier (it
settles nothing); what the tier costs beyond it is what a compiled
completion path could take off at most (docs/lab/file-tier-runs.md, run 16).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.tiers.file import FileTier

HERE = Path(__file__).resolve().parent


def child(args: argparse.Namespace) -> None:
    """One side: import kvtier from ``--root``, fill a tier, wait for the go, load
    (through the tier, or with ``--loop lean`` the least-Python loop on its slots)."""
    root = Path(args.root).resolve()
    sys.path.insert(0, str(root))
    import kvtier  # from the checkout under test, before file_tier puts its own first

    sys.path.insert(1, str(HERE))
    import file_tier as bench

    from kvtier.tiers.file import FileTier

    async def run() -> dict[str, object]:
        bs, total = bench.parse_size(args.block), bench.parse_size(args.total)
        n = total // bs
        region = bench.thp_buffer(total)
        view = memoryview(region)
        rows = [view[i * bs : (i + 1) * bs] for i in range(n)]
        keys = [i.to_bytes(16, "little") for i in range(n)]
        work = Path(tempfile.mkdtemp(prefix="paired-", dir=args.dir))
        config = bench.tier_config(work, "io_uring", bs, args.depth, n)
        tier = await FileTier.open(config, bench.layout(), block_bytes=bs)
        tier.register_memory([region])
        batch = max(1, min(256, (64 << 20) // bs))
        try:
            for i in range(0, n, batch):
                if (await tier.store(keys[i : i + batch], rows[i : i + batch])).failed:
                    raise RuntimeError("store failed")
            lean = lean_loop(tier, keys, rows, args.depth) if args.loop == "lean" else None
            print("ready", flush=True)
            sys.stdin.readline()  # the go, sent once both sides are ready
            moved, cpu0, t0 = 0, time.process_time(), time.perf_counter()
            if lean is not None:
                moved = await lean(args.seconds)
            while lean is None and time.perf_counter() - t0 < args.seconds:
                parts = [
                    tier.load(keys[i : i + batch], rows[i : i + batch]) for i in range(0, n, batch)
                ]
                for part in parts:
                    if (await part).missing:
                        raise RuntimeError("load failed")
                moved += n * bs
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        finally:
            await tier.aclose()
            shutil.rmtree(work, ignore_errors=True)
        return {
            "kvtier": kvtier.__file__,
            "cpu_s_per_gb": cpu / (moved / 1e9),
            "gbps": moved / 1e9 / wall,
        }

    print(json.dumps(asyncio.run(run())), flush=True)


def lean_loop(
    tier: FileTier, keys: list[bytes], rows: list[memoryview], depth: int
) -> Callable[[float], Awaitable[int]]:
    """``--loop lean``: a loop reading ``tier``'s blocks of ``keys`` into ``rows``,
    ``depth`` at a time, each verified, with the least Python per reap.

    Everything per block is built here, once: the requests (a header page of
    ``depth`` and the row), their offsets, one ``struct iovec`` array. The
    returned coroutine function reads for its argument's seconds, then
    returns the bytes read. Reaches into the tier for its slot file and
    namespace; the blocks stay resident (the plan that named their slots is
    completed at once).
    """
    from kvtier.tiers._blocks import verify_reaped
    from kvtier.transfer._ring import OP_READV, Ring

    n, bs = len(keys), rows[0].nbytes
    if n % depth:
        raise SystemExit("--loop lean needs a block count that is a multiple of --depth")
    pipeline = tier._pipeline
    manager, slots = pipeline._manager, pipeline._slots
    plan = manager.prepare_load(keys)
    offsets = [slots.file_slot[s] * slots.file_bytes for s in plan.slots]
    manager.complete_load(keys)
    header = memoryview(mmap.mmap(-1, depth * 4096))
    # The reads in flight are `depth` consecutive blocks (mod n): block i's
    # header page is page i % depth, never two in flight at once.
    pages = [header[(i % depth) * 4096 : (i % depth + 1) * 4096] for i in range(n)]
    requests = [[pages[i], rows[i]] for i in range(n)]
    iov = bytearray(n * 2 * 16)
    fd, namespace, expected = slots.fd, pipeline._namespace, slots.file_bytes

    async def run(seconds: float) -> int:
        loop = asyncio.get_running_loop()
        ring = Ring(2 * depth)  # two entries of room per request, as the engine keeps
        efd = os.eventfd(0, os.EFD_NONBLOCK)
        ring.register_eventfd(efd)
        state = {"next": 0, "in_flight": 0, "read": 0}
        stop = False
        drained = loop.create_future()

        def issue(count: int) -> None:
            first = state["next"]
            head = min(count, n - first)
            ring.prep_rw(OP_READV, fd, iov, 2, requests, offsets, first, head, 1)
            if head < count:
                ring.prep_rw(OP_READV, fd, iov, 2, requests, offsets, 0, count - head, 1)
            state["next"] = (first + count) % n
            state["in_flight"] += count
            ring.submit()

        def reaped() -> None:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(efd)
            got = 0
            for _, outcomes, _, failed in ring.reap_runs(None):
                if failed or verify_reaped(pages, keys, namespace, rows, outcomes, expected):
                    raise RuntimeError("a lean read failed or did not verify")
                got += len(outcomes)
            state["in_flight"] -= got
            state["read"] += got * bs
            if stop:
                if not state["in_flight"] and not drained.done():
                    drained.set_result(None)
            elif got:
                issue(got)

        loop.add_reader(efd, reaped)
        try:
            issue(depth)
            await asyncio.sleep(seconds)
            stop = True
            await drained
        finally:
            loop.remove_reader(efd)
            ring.close()
            os.close(efd)
        return state["read"]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--a", type=Path, help="the checkout to compare against (built)")
    parser.add_argument("--b", type=Path, help="the checkout measured against --a (built)")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="instead of --b: the least-Python load loop, from --a's checkout, as the b side",
    )
    parser.add_argument("--depth", type=int, default=32, help="queue depth, each side")
    parser.add_argument("--block", default="256K", help="block size: 256K, 2M, or bytes")
    parser.add_argument("--total", default="1G", help="tier size, each side")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cpu", type=int, default=None, help="default: one without disk IRQs")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/kvtier-bench"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loop", default="tier", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.a is None or (args.b is None) == (not args.lean):
        parser.error("--a and one of --b and --lean are required")
    sides = {"a": (args.a, "tier"), "b": (args.a, "lean") if args.lean else (args.b, "tier")}
    args.dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(HERE))
    import file_tier as bench  # (this process measures nothing: its kvtier does not matter)

    if args.cpu is None:
        cpus, _ = bench.pick_cpus("auto", args.dir)
        args.cpu = cpus[0]
    block, total = bench.parse_size(args.block), bench.parse_size(args.total)
    print(f"block {bench.fmt(block)}, tier {bench.fmt(total)} each, CPU {args.cpu}")
    ratios = []
    for r in range(args.rounds):
        procs = []
        # The side started first alternates between rounds.
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            root, loop = sides[side]
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                "--root",
                str(root),
                *("--loop", loop, "--depth", str(args.depth)),
                *("--block", str(block), "--total", str(total)),
                *("--seconds", str(args.seconds), "--dir", str(args.dir)),
            ]
            procs.append(
                (
                    side,
                    subprocess.Popen(
                        ["taskset", "-c", str(args.cpu), *cmd],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    ),
                )
            )
        try:
            for _, proc in procs:
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise SystemExit(f"a side failed to start (exit {proc.wait()})")
            for _, proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            out = {}
            for side, proc in procs:
                assert proc.stdout is not None
                out[side] = json.loads(proc.stdout.readline())
                proc.wait()
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
        a, b = out["a"], out["b"]
        ratios.append(float(b["cpu_s_per_gb"]) / float(a["cpu_s_per_gb"]))
        ran = [Path(str(got["kvtier"])).parent.parent for got in (a, b)]
        if args.lean:
            ran[1] = Path(f"{ran[1]}, lean loop")
        print(
            f"round {r + 1}: a {a['cpu_s_per_gb']:.4f} CPU s/GB ({a['gbps']:.2f} GB/s, {ran[0]}), "
            f"b {b['cpu_s_per_gb']:.4f} ({b['gbps']:.2f} GB/s, {ran[1]}): b / a {ratios[-1]:.3f}"
        )
    print(f"b / a CPU per GB: median {statistics.median(ratios):.3f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
