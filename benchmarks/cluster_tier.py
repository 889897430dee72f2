"""Cluster tier throughput against the bare redis client, on a real three-node Valkey cluster.

For 256 KiB and 2 MiB blocks, stores and loads ``--mib`` MiB through
:class:`~kvtier.tiers.cluster.ClusterTier` and through the bare
``redis.asyncio.cluster.RedisCluster`` doing the same pipelines (values of
the same size, grouped per node, at most ``max_inflight_bytes`` per pipeline,
``pipelines_per_node`` at once) on the same cluster in the same run.

The machine is noisy (other processes, and the three servers share its cores
with the client), so every figure is a median over ``--repeats`` repeats, and
the tier/bare ratio is taken *within* each repeat (the tier and the bare
client run back to back, their order alternating between repeats so that
neither always runs on a warmer cluster) before its median and its spread
(min-max over the repeats) are printed. Target: ratio >= 0.9.

Client CPU is seconds of this process (every thread) per GB moved; server
CPU the three servers' seconds per GB (``/proc/<pid>/stat``): on a machine
whose cores the client and the servers share, a ratio is bounded by
(server + bare client) / (server + tier client) CPU. Then the cost of
:meth:`~kvtier.tiers.cluster.ClusterTier.lookup` per key (no I/O) and of
:meth:`~kvtier.tiers.cluster.ClusterTier.refresh` (one pipelined EXISTS per
node) per 32-key request and per key. ``load*`` is the tier with
``direct_reads=False`` (every GET reply read by redis-py, then copied into
its row), the way loads went before the direct reader; ``store*`` the tier
with ``direct_writes=False`` (every SET through redis-py, which joins a
pipeline into one ``bytes``), the way stores went before.

Run: ``flock /tmp/kvtier-bench.lock nice -n 0 .venv/bin/python benchmarks/cluster_tier.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.cluster import ClusterTier, ClusterTierConfig

NAMESPACE = bytes(range(16))
OPS = (
    ("store", "tier store", "bare SET"),
    ("store*", "tier store via redis-py", "bare SET"),
    ("load", "tier load", "bare GET"),
    ("load*", "tier load via redis-py", "bare GET"),
)


SERVER_PIDS: list[int] = []
"""The servers' process ids, for their CPU time."""
_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu() -> float:
    """CPU seconds (user and system) the servers used so far."""
    total = 0
    for pid in SERVER_PIDS:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, float, float]:
    """Wall, client CPU (this process, every thread) and server CPU seconds of ``await fn()``."""
    s0, c0, t0 = server_cpu(), time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - t0, time.process_time() - c0, server_cpu() - s0


class Bare:
    """The same pipelines as the tier, with the bare client and prebuilt values."""

    def __init__(self, client: RedisCluster, config: ClusterTierConfig) -> None:
        self.client = client
        self.max_bytes = int(config.max_inflight_bytes)
        self.per_node = config.pipelines_per_node
        self.gates: dict[str, asyncio.Semaphore] = {}

    def plan(self, rkeys: list[bytes], value_bytes: int) -> list[tuple[str, list[bytes]]]:
        per_node: dict[str, list[bytes]] = {}
        for k in rkeys:
            node = self.client.get_node_from_key(k)  # type: ignore[arg-type]
            assert node is not None
            per_node.setdefault(node.name, []).append(k)
        step = max(1, self.max_bytes // value_bytes)
        return [
            (n, ks[s : s + step]) for n, ks in per_node.items() for s in range(0, len(ks), step)
        ]

    async def _pipe(self, node: str, cmds: list[tuple[Any, ...]]) -> list[Any]:
        gate = self.gates.setdefault(node, asyncio.Semaphore(self.per_node))
        async with gate:
            pipe = self.client.pipeline(transaction=False)
            for c in cmds:
                pipe.execute_command(*c)
            out: list[Any] = await pipe.execute()
            return out

    async def set(self, rkeys: list[bytes], values: list[bytes]) -> None:
        value_of = dict(zip(rkeys, values, strict=True))
        plans = self.plan(rkeys, len(values[0]))
        await asyncio.gather(
            *(self._pipe(n, [("SET", k, value_of[k]) for k in ks]) for n, ks in plans)
        )

    async def get(self, rkeys: list[bytes], value_bytes: int) -> None:
        plans = self.plan(rkeys, value_bytes)
        res = await asyncio.gather(*(self._pipe(n, [("GET", k) for k in ks]) for n, ks in plans))
        assert all(len(v) == value_bytes for part in res for v in part)

    async def delete(self, rkeys: list[bytes]) -> None:
        await asyncio.gather(
            *(self._pipe(n, [("DEL", k) for k in ks]) for n, ks in self.plan(rkeys, 64))
        )


async def one_repeat(
    tier: ClusterTier, slow: ClusterTier, bare: Bare, rows: Rows, values: list[bytes], rep: int
) -> dict[str, tuple[float, float, float]]:
    """:func:`timed` of each operation, in an order set by ``rep``."""
    n, block = len(values), rows.block_bytes
    keys = block_keys(n, salt=(16 * (rep + 1) + (block >> 16) + 1) % 256)
    keys2 = block_keys(n, salt=(16 * (rep + 1) + (block >> 16) + 9) % 256)  # store*'s own
    rkeys = [b"bare:" + k.hex().encode() for k in keys]
    out = Rows(n, block)
    out.map.write(bytes(n * block))  # resident, as a CPU region's rows are

    async def tier_store() -> None:
        result = await tier.store(keys, rows.rows())
        assert len(result.stored) == n, result.failed

    async def tier_load() -> None:
        result = await tier.load(keys, out.rows())
        assert len(result.loaded) == n, result.missing

    async def slow_load() -> None:
        result = await slow.load(keys, out.rows())
        assert len(result.loaded) == n, result.missing

    async def slow_store() -> None:
        result = await slow.store(keys2, rows.rows())
        assert len(result.stored) == n, result.failed

    steps: dict[str, Callable[[], Awaitable[Any]]] = {
        "tier store": tier_store,
        "bare SET": lambda: bare.set(rkeys, values),
        "tier store via redis-py": slow_store,
        "tier load": tier_load,
        "bare GET": lambda: bare.get(rkeys, HEADER_BYTES + block),
        "tier load via redis-py": slow_load,
    }
    # Alternate who goes first: the second writer finds a cluster whose
    # memory the first has already grown, the second reader warmer caches.
    order = list(steps)
    if rep % 2:
        order = [
            "tier store via redis-py",
            "bare SET",
            "tier store",
            "tier load via redis-py",
            "bare GET",
            "tier load",
        ]
    times = {name: await timed(steps[name]) for name in order}
    tier.remove(keys)  # forget; the values are deleted below
    slow.remove(keys2)
    await bare.delete(rkeys + [tier.key_of(k) for k in keys + keys2])
    await asyncio.sleep(0.05)  # the tier's own background DELs, before the next repeat
    return times


async def run_size(
    tier: ClusterTier, slow: ClusterTier, bare: Bare, block: int, total: int, repeats: int
) -> dict[str, list[tuple[float, float, float]]]:
    """Per operation, (GB/s, client CPU s/GB, server CPU s/GB) of every repeat."""
    n = max(1, total // block)
    rows = Rows(n, block)
    for i in range(n):
        rows.row(i)[:] = os.urandom(64) * (block // 64)
    values = [os.urandom(64) * ((HEADER_BYTES + block) // 64) for _ in range(n)]
    payload = n * block / 1e9
    per_op: dict[str, list[tuple[float, float, float]]] = {}
    await one_repeat(tier, slow, bare, rows, values, -1)  # warm-up: connections, allocator
    for rep in range(repeats):
        for name, (wall, cpu, srv) in (
            await one_repeat(tier, slow, bare, rows, values, rep)
        ).items():
            per_op.setdefault(name, []).append((payload / wall, cpu / payload, srv / payload))
    return per_op


async def lookup_costs(tier: ClusterTier) -> tuple[float, float, float]:
    """ns per key of lookup, µs per request and per key of refresh (32-key requests)."""
    keys = block_keys(1024, salt=250)
    tier._presence.remember_all(keys)  # as if stored: lookup walks the whole prefix
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        tier.lookup(keys)
    lookup_ns = (time.perf_counter() - t0) / (reps * len(keys)) * 1e9
    fresh = [block_keys(32, salt=251 + (i % 4)) for i in range(100)]
    t0 = time.perf_counter()
    for req in fresh:
        for k in req:
            tier._presence.known.pop(k, None)
        await tier.refresh(req)
    per_req = (time.perf_counter() - t0) / len(fresh) * 1e6
    return lookup_ns, per_req, per_req / 32


def med(xs: list[float]) -> float:
    return statistics.median(xs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per size and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per size (medians)")
    args = parser.parse_args()
    with ValkeyCluster.start(3) as cluster:
        SERVER_PIDS[:] = [p.pid for p in cluster.procs if p is not None]
        config = ClusterTierConfig(nodes=[f"{h}:{p}" for h, p in cluster.startup])
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup])
        await client.initialize()
        bare = Bare(client, config)
        print(
            f"three-node Valkey cluster on loopback, {os.cpu_count()} cores; {args.mib} MiB "
            f"per size and repeat; medians of {args.repeats} repeats; ratio = tier/bare "
            "within a repeat (median, min-max)"
        )
        print(
            f"{'block':>8} {'op':<6} {'tier GB/s':>10} {'bare GB/s':>10} {'ratio':>6} "
            f"{'min-max':>10} {'tier cpu s/GB':>14} {'bare cpu s/GB':>14} "
            f"{'srv cpu s/GB':>12} {'(bare)':>7}"
        )
        for block in (256 << 10, 2 << 20):
            tier = await ClusterTier.open(config, NAMESPACE, block_bytes=block)
            # The same blocks read and written through redis-py (direct
            # connections off): what they gain, in the same run.
            slow_config = config.model_copy(update={"direct_reads": False, "direct_writes": False})
            slow = await ClusterTier.open(slow_config, NAMESPACE, block_bytes=block)
            s = await run_size(tier, slow, bare, block, args.mib << 20, args.repeats)
            for op, t, b in OPS:
                ratios = [x[0] / y[0] for x, y in zip(s[t], s[b], strict=True)]
                print(
                    f"{block >> 10:>6}Ki {op:<6} {med([x[0] for x in s[t]]):>10.2f} "
                    f"{med([x[0] for x in s[b]]):>10.2f} {med(ratios):>6.2f} "
                    f"{min(ratios):>4.2f}-{max(ratios):<4.2f} "
                    f"{med([x[1] for x in s[t]]):>14.2f} {med([x[1] for x in s[b]]):>14.2f} "
                    f"{med([x[2] for x in s[t]]):>12.2f} {med([x[2] for x in s[b]]):>7.2f}"
                )
            if block == 256 << 10:
                lookup_ns, req_us, key_us = await lookup_costs(tier)
            await tier.aclose()
            await slow.aclose()
        await client.aclose()
        print("store*, load*: the tier with direct_writes=False, direct_reads=False (redis-py)")
        print(f"lookup (presence set, no I/O): {lookup_ns:.0f} ns per key")
        print(
            f"refresh (pipelined EXISTS, 32-key request): {req_us:.0f} µs per request, "
            f"{key_us:.1f} µs per key"
        )


if __name__ == "__main__":
    asyncio.run(main())
