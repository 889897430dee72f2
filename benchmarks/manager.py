"""Replay a prefix-sharing trace against ResidencyManager: ns per key, bytes per block, hit rate.

Run ``python benchmarks/manager.py`` (10k, 100k and 1M slots) or add ``--quick``
(10k and 100k, shorter traces). It replays the manager ``ResidencyManager``
builds by default, the compiled core; ``--python`` replays the pure-Python one.
The trace: requests of 16-64 blocks whose leading blocks come from one of many
shared prefixes (a document, a system prompt, a conversation), chosen with a
Zipf law, and whose remaining blocks are new (the request's own tokens). The
number of prefixes scales with the capacity, so the shared blocks are about
four times what fits and every size evicts.

Each request is played as an engine plays it: ``lookup``; on a hit,
``prepare_load`` and ``complete_load`` of the hit prefix; ``prepare_store`` and
``complete_store`` of the rest; ``touch`` of the hit prefix. The first third of
the trace fills the manager and is not timed.

Columns: ns per key of each call (its time over the keys passed to it);
``all``: the time of all six calls over the keys of the requests (what one
requested block costs, whichever calls it went through); ``sum``: the six
per-call figures added up (as if every key went through every call);
``B/block``: memory per resident block at the end of a replay, measured with
tracemalloc in a separate run, plus the 16-byte key object (49 bytes in
CPython) that the manager keeps alive; ``hit``: lookup hit rate over the timed
part. Times are the median of ``--repeats`` replays (a fresh manager each).

``floor``: measured in the same run, per size, the least dict work any manager
must do per requested key: one lookup, one insert and one delete on a dict of
that many 16-byte keys, in batches of 32 as C-level ``map`` calls. The machine's
speed varies from run to run by more than the changes worth measuring;
``all / floor`` does much less, so compare that between runs. ``--json PATH``
writes every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from kvtier.manager import ResidencyManager

CALLS = ("lookup", "prepare_load", "complete_load", "prepare_store", "complete_store", "touch")


@dataclass(frozen=True, slots=True)
class Trace:
    """A list of requests, each a list of distinct 16-byte keys."""

    requests: list[list[bytes]]
    """The requests in order."""
    warmup: int
    """Requests replayed before timing starts."""


@dataclass(frozen=True, slots=True)
class Result:
    """Figures of one (capacity, policy) replay."""

    capacity: int
    """Slots of the manager."""
    policy: str
    """Policy name."""
    ns_per_key: dict[str, float]
    """Per call: its total time over the keys passed to it."""
    ns_all: float
    """All calls' time over the requests' keys (median of the repeats)."""
    ns_all_repeats: list[float]
    """``ns_all`` of each repeat, in run order."""
    floor_ns: float
    """The same-run dict floor at this size (see :func:`dict_floor`)."""
    hit_rate: float
    """Lookup hits over lookup keys, timed part."""
    bytes_per_block: float
    """Traced memory over resident blocks, key objects included."""


def make_trace(capacity: int, requests_per_slot: float, seed: int = 1) -> Trace:
    """Requests with Zipf-popular shared prefixes and per-request new tails."""
    rng = np.random.default_rng(seed)
    rand = random.Random(seed)
    prefixes = max(16, capacity // 16)  # x 64 blocks each: ~4x the capacity
    weights = 1.0 / np.arange(1, prefixes + 1) ** 1.0
    weights /= weights.sum()
    n = int(capacity * requests_per_slot)
    which = rng.choice(prefixes, size=n, p=weights)
    lengths = rng.integers(16, 65, size=n)
    shared_part = rng.uniform(0.5, 1.0, size=n)
    chains: dict[int, list[bytes]] = {}
    out: list[list[bytes]] = []
    for j, length, frac in zip(which.tolist(), lengths.tolist(), shared_part.tolist(), strict=True):
        chain = chains.get(j)
        if chain is None:
            chain = chains[j] = [rand.randbytes(16) for _ in range(64)]
        shared = int(length * frac)
        out.append(chain[:shared] + [rand.randbytes(16) for _ in range(length - shared)])
    return Trace(out, warmup=n // 3)


def replay(m: ResidencyManager, requests: list[list[bytes]]) -> None:
    """Play requests untimed (warm-up, memory runs)."""
    for req in requests:
        h = m.lookup(req)
        if h:
            head = req[:h]
            m.prepare_load(head)
            m.complete_load(head)
        plan = m.prepare_store(req[h:])
        if plan is not None and plan.keys:
            m.complete_store(plan.keys)
        if h:
            m.touch(req[:h])


def timed_replay(
    m: ResidencyManager, requests: list[list[bytes]]
) -> tuple[list[int], list[int], list[int]]:
    """Play requests, timing each call; returns ns, keys and calls per call kind."""
    clock = time.perf_counter_ns
    ns = [0] * 6
    nk = [0] * 6
    nc = [0] * 6
    lookup, prepare_load, complete_load = m.lookup, m.prepare_load, m.complete_load
    prepare_store, complete_store, touch = m.prepare_store, m.complete_store, m.touch
    for req in requests:
        t0 = clock()
        h = lookup(req)
        t1 = clock()
        ns[0] += t1 - t0
        nk[0] += len(req)
        nc[0] += 1
        if h:
            head = req[:h]
            t0 = clock()
            prepare_load(head)
            t1 = clock()
            complete_load(head)
            t2 = clock()
            ns[1] += t1 - t0
            ns[2] += t2 - t1
            nk[1] += h
            nk[2] += h
            nc[1] += 1
            nc[2] += 1
        tail = req[h:]
        t0 = clock()
        plan = prepare_store(tail)
        t1 = clock()
        ns[3] += t1 - t0
        nk[3] += len(tail)
        nc[3] += 1
        if plan is not None and plan.keys:
            t0 = clock()
            complete_store(plan.keys)
            t1 = clock()
            ns[4] += t1 - t0
            nk[4] += len(plan.keys)
            nc[4] += 1
        if h:
            t0 = clock()
            touch(head)
            t1 = clock()
            ns[5] += t1 - t0
            nk[5] += h
            nc[5] += 1
    return ns, nk, nc


def clock_overhead() -> float:
    """ns that one perf_counter_ns call adds to a measured interval."""
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(10000):
            clock()
        best = min(best, (clock() - t0) / 10000)
    return best


def measure_memory(capacity: int, policy: str, trace: Trace, native: bool) -> float:
    """Bytes per resident block after replaying the trace, key objects included.

    tracemalloc sees the compiled core's arrays too (they come from
    ``PyMem_RawMalloc``).
    """
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    m = ResidencyManager(capacity, policy, native=native)
    replay(m, trace.requests)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # The keys were made before tracing began; the manager keeps one per block.
    key_bytes = sys.getsizeof(bytes(16))
    return used / len(m) + key_bytes


def dict_floor(capacity: int, repeats: int, seed: int = 2) -> float:
    """ns per key of the dict work every key costs a manager at this size (median of repeats).

    A dict holds ``capacity`` 16-byte keys; each batch of 32 new keys is looked
    up (absent), inserted, and the 32 oldest keys are deleted, so the dict stays
    at ``capacity`` entries and touches memory as a full manager's index does.
    """
    rand = random.Random(seed)
    resident = [rand.randbytes(16) for _ in range(capacity)]
    incoming = [rand.randbytes(16) for _ in range(max(65_536, capacity // 4))]
    hash(tuple(incoming))  # bytes cache their hash: the manager's keys were hashed by lookup
    batch = 32
    results: list[float] = []
    for _ in range(repeats):
        index = dict(zip(resident, range(capacity), strict=True))
        oldest = deque(resident)
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for i in range(0, len(incoming), batch):
                new = incoming[i : i + batch]
                deque(map(index.__contains__, new), maxlen=0)
                index.update(zip(new, range(len(new)), strict=True))
                deque(map(index.__delitem__, map(deque.popleft, [oldest] * len(new))), maxlen=0)
                oldest.extend(new)
            results.append((time.perf_counter_ns() - t0) / len(incoming))
        finally:
            gc.enable()
        del index, oldest
    return statistics.median(results)


def run(
    capacity: int, policy: str, trace: Trace, repeats: int, floor: float, native: bool
) -> Result:
    """Median of ``repeats`` timed replays (a fresh manager each), then a memory run."""
    overhead = clock_overhead()
    runs: list[tuple[float, list[float], float]] = []
    for _ in range(repeats):
        m = ResidencyManager(capacity, policy, native=native)
        replay(m, trace.requests[: trace.warmup])
        stats0 = m.statistics()
        gc.collect()
        gc.disable()  # the manager makes no cycles; a collection would time the trace
        try:
            ns, nk, nc = timed_replay(m, trace.requests[trace.warmup :])
        finally:
            gc.enable()
        stats = m.statistics()
        hits = stats.hits - stats0.hits
        hit = hits / (hits + stats.misses - stats0.misses)
        net = [t - c * overhead for t, c in zip(ns, nc, strict=True)]
        per_call = [t / k if k else 0.0 for t, k in zip(net, nk, strict=True)]
        runs.append((sum(net) / nk[0], per_call, hit))
        del m
        gc.collect()
    # The median repeat, whole: its per-call figures add up to its 'all'.
    ns_all, per_call, hit = sorted(runs)[(len(runs) - 1) // 2]
    mem = measure_memory(capacity, policy, trace, native)
    return Result(
        capacity,
        policy,
        dict(zip(CALLS, per_call, strict=True)),
        ns_all,
        [r[0] for r in runs],
        floor,
        hit,
        mem,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10k and 100k slots, shorter traces")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed replays per case (median kept)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every figure to PATH")
    parser.add_argument(
        "--python",
        action="store_true",
        help="replay the pure-Python manager instead of the compiled core",
    )
    args = parser.parse_args(argv)
    native = not args.python
    sizes = [10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000]
    per_slot = 0.1 if args.quick else 0.15
    head = (
        f"{'slots':>9} {'policy':>6} "
        + " ".join(f"{c:>14}" for c in CALLS)
        + f" {'all':>6} {'floor':>6} {'all/fl':>6} {'sum':>6} {'B/block':>8} {'hit':>6}"
    )
    print(
        f"ns per key, median of {args.repeats} replays; 'all' = all calls' time / request"
        " keys; 'floor' = same-run dict lookup + insert + delete per key; 'sum' ="
        " per-call figures added"
    )
    print(
        "manager: "
        + ("compiled core (NativeResidencyManager)" if native else "pure Python (native=False)")
    )
    print(head)
    results: list[Result] = []
    for cap in sizes:
        trace = make_trace(cap, per_slot)
        floor = dict_floor(cap, args.repeats)
        for policy in ("lru", "arc"):
            r = run(cap, policy, trace, args.repeats, floor, native)
            results.append(r)
            cols = " ".join(f"{r.ns_per_key[c]:>14.0f}" for c in CALLS)
            print(
                f"{cap:>9} {policy:>6} {cols} {r.ns_all:>6.0f} {floor:>6.0f}"
                f" {r.ns_all / floor:>6.2f} {sum(r.ns_per_key.values()):>6.0f}"
                f" {r.bytes_per_block:>8.0f} {r.hit_rate:>6.1%}",
                flush=True,
            )
        del trace
        gc.collect()
    for policy in ("lru", "arc"):
        rows = [r for r in results if r.policy == policy]
        print(f"{policy}: 'all' largest / smallest size = {rows[-1].ns_all / rows[0].ns_all:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "command": sys.argv,
                    "implementation": "native" if native else "python",
                    "repeats": args.repeats,
                    "statistic": "median",
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
