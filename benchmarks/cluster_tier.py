"""Cluster tier throughput against the bare redis client, on a real three-node Valkey cluster.

For 256 KiB and 2 MiB blocks, stores and loads ``--mib`` MiB through
:class:`~kvtier.tiers.cluster.ClusterTier` and through the bare
``redis.asyncio.cluster.RedisCluster`` doing the same pipelines (values of
the same size, grouped per node, at most ``max_inflight_bytes`` per pipeline,
``pipelines_per_node`` at once) on the same cluster in the same run. Prints
GB/s, client CPU seconds per GB (this process only; the servers are other
processes) and the tier/bare ratios (target >= 0.9), then the cost of
:meth:`~kvtier.tiers.cluster.ClusterTier.lookup` per key (no I/O) and of
:meth:`~kvtier.tiers.cluster.ClusterTier.refresh` (one pipelined EXISTS) per
request and per key. Run: ``.venv/bin/python benchmarks/cluster_tier.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio.cluster import ClusterNode, RedisCluster

from kvtier.testing.tier import Rows, block_keys
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers._format import HEADER_BYTES
from kvtier.tiers.cluster import ClusterTier, ClusterTierConfig

NAMESPACE = bytes(range(16))


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """Wall and CPU seconds of ``await fn()`` (CPU of this process, every thread)."""
    c0, t0 = time.process_time(), time.perf_counter()
    await fn()
    return time.perf_counter() - t0, time.process_time() - c0


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


async def run_size(
    tier: ClusterTier, bare: Bare, block: int, total: int, rounds: int
) -> dict[str, float]:
    n = max(1, total // block)
    rows = Rows(n, block)
    for i in range(n):
        rows.row(i)[:] = os.urandom(64) * (block // 64)
    value_bytes = HEADER_BYTES + block
    values = [bytes(value_bytes) for _ in range(n)]  # what a bare client would send
    best: dict[str, tuple[float, float]] = {}

    def keep(name: str, wall: float, cpu: float) -> None:
        if name not in best or wall < best[name][0]:
            best[name] = (wall, cpu)

    for r in range(rounds):
        keys = block_keys(n, salt=(block >> 16) + 16 * r + 1)
        rkeys = [b"bare:" + k.hex().encode() for k in keys]
        keep("tier store", *await timed(lambda: tier.store(keys, rows.rows())))  # noqa: B023
        out = Rows(n, block)
        out.map.write(bytes(n * block))  # resident, as a CPU region's rows are

        async def load() -> None:
            result = await tier.load(keys, out.rows())  # noqa: B023
            assert len(result.loaded) == n, result.missing

        keep("tier load", *await timed(load))
        keep("bare SET", *await timed(lambda: bare.set(rkeys, values)))  # noqa: B023
        keep("bare GET", *await timed(lambda: bare.get(rkeys, value_bytes)))  # noqa: B023
        tier.remove(keys)
        await bare.client.delete(*rkeys[:1])
        for s in range(0, n, 64):
            for k in rkeys[s : s + 64]:
                await bare.client.delete(k)
    payload = n * block
    out_stats: dict[str, float] = {}
    for name, (wall, cpu) in best.items():
        out_stats[f"{name} GB/s"] = payload / wall / 1e9
        out_stats[f"{name} cpu s/GB"] = cpu / (payload / 1e9)
    return out_stats


async def lookup_costs(tier: ClusterTier) -> tuple[float, float, float]:
    """ns per key of lookup, µs per request and per key of refresh (32-key requests)."""
    keys = block_keys(1024, salt=250)
    for k in keys:
        tier._remember(k)  # as if stored: lookup walks the whole prefix
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        tier.lookup(keys)
    lookup_ns = (time.perf_counter() - t0) / (reps * len(keys)) * 1e9
    fresh = [block_keys(32, salt=251 + (i % 4)) for i in range(100)]
    t0 = time.perf_counter()
    for req in fresh:
        for k in req:
            tier._present.pop(k, None)
        await tier.refresh(req)
    per_req = (time.perf_counter() - t0) / len(fresh) * 1e6
    return lookup_ns, per_req, per_req / 32


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per size and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per size (best kept)")
    args = parser.parse_args()
    with ValkeyCluster.start(3) as cluster:
        config = ClusterTierConfig(nodes=[f"{h}:{p}" for h, p in cluster.startup])
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.startup])
        await client.initialize()
        bare = Bare(client, config)
        print(
            f"three-node Valkey cluster on loopback, {os.cpu_count()} cores; "
            f"{args.mib} MiB per size, best of {args.rounds}"
        )
        print(
            f"{'block':>8} {'op':<6} {'tier GB/s':>10} {'bare GB/s':>10} {'ratio':>6} "
            f"{'tier cpu s/GB':>14} {'bare cpu s/GB':>14}"
        )
        for block in (256 << 10, 2 << 20):
            tier = await ClusterTier.open(config, NAMESPACE, block_bytes=block)
            s = await run_size(tier, bare, block, args.mib << 20, args.rounds)
            for op, t, b in (
                ("store", "tier store", "bare SET"),
                ("load", "tier load", "bare GET"),
            ):
                print(
                    f"{block >> 10:>6}Ki {op:<6} {s[t + ' GB/s']:>10.2f} {s[b + ' GB/s']:>10.2f} "
                    f"{s[t + ' GB/s'] / s[b + ' GB/s']:>6.2f} {s[t + ' cpu s/GB']:>14.2f} "
                    f"{s[b + ' cpu s/GB']:>14.2f}"
                )
            if block == 256 << 10:
                lookup_ns, req_us, key_us = await lookup_costs(tier)
            await tier.aclose()
        await client.aclose()
        print(f"lookup (presence set, no I/O): {lookup_ns:.0f} ns per key")
        print(
            f"refresh (pipelined EXISTS, 32-key request): {req_us:.0f} µs per request, "
            f"{key_us:.1f} µs per key"
        )


if __name__ == "__main__":
    asyncio.run(main())
