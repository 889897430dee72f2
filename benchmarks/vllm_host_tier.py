"""Two `vllm serve` on one host, sessions moving between them: private CPU tiers or one host tier.

Run from the repository root, in the vLLM venv (``make .venv-vllm/.installed``)::

    .venv-vllm/bin/python benchmarks/vllm_host_tier.py --quick   # 8 users, 4 rounds, 1 repeat
    .venv-vllm/bin/python benchmarks/vllm_host_tier.py           # 8 users, 5 rounds, 2 repeats

Two servers of ``benchmarks/vllm_serving.py``'s model run at once (one
process group each), behind a round-robin client: round ``r`` of user ``u``
goes to server ``(u + r) % 2``, so every round lands on the other server than
the one before, as a router without session affinity sends it (or one that
rebalances). Each round's prompt is the whole conversation so far. vLLM's own
KV cache holds two of the longest prompts; kvtier's RAM is the same in both
configurations (``--ram-blocks``; by default the working set plus both
servers' staging rows):

``private``
    each server has a CPU tier of half of it (kvtier's default today);
``shared``
    each server has a CPU tier of the longest prompt plus a step (its
    staging rows) and the rest is one host tier both use (``host_tier`` with
    ``instances: 2``).

Reported per configuration (medians over repeats): requests/s, TTFT p50/p99,
tokens served from vLLM's cache, from kvtier (vLLM's external prefix hits),
kvtier's host-tier peer hits, and whether every greedy answer equals the
other configuration's (the same prompts, the same order). The machine this
runs on is shared and noisy: compare the ratios between configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

import vllm_serving as serving  # noqa: E402 - the serving benchmark's server and client parts
from vllm_ttft import BLOCK, SHAPES  # noqa: E402

from kvtier.tiers.host import reap_host_segments  # noqa: E402

CONFIGS = ("private", "shared")


def _extra(config: str, sizes: serving.Sizes, ram_blocks: int, staging: int) -> dict[str, Any]:
    spec = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
    }
    if config == "private":
        return {**spec, "cpu_bytes_to_use": ram_blocks // 2 * sizes.block_bytes}
    host_rows = ram_blocks - 2 * staging
    return {
        **spec,
        "cpu_bytes_to_use": staging * sizes.block_bytes,
        "host_tier": {
            # A row is a 4 KiB header and the block, rounded to pages.
            "bytes_to_use": host_rows * (4096 + math.ceil(sizes.block_bytes / 4096) * 4096),
            "instances": 2,
        },
    }


def _server(
    model: Path, config: str, sizes: serving.Sizes, extra: dict[str, Any], tmp: Path, i: int
) -> serving.Server:
    server = serving.Server(
        model, "kvtier-cpu", sizes, tmp / f"kv{i}", tmp / f"{config}-{i}.log", "0"
    )
    # The serving benchmark's server, with this configuration's connector.
    at = server.args.index("--kv-transfer-config") + 1
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    server.args[at] = json.dumps({**kv, "kv_connector_extra_config": extra})
    server.extra = extra
    server.name = f"{config}-{i}"
    return server


async def _users(
    bases: list[str],
    model: str,
    users: int,
    rounds: int,
    system: int,
    turn: int,
    gen: int,
    seed: int,
) -> tuple[list[dict[str, Any]], float]:
    import httpx  # type: ignore[import-not-found,unused-ignore]

    rng = random.Random(seed)
    shared = [rng.randrange(serving.VOCAB) for _ in range(system)]
    turns = [
        [[rng.randrange(serving.VOCAB) for _ in range(turn)] for _ in range(rounds)]
        for _ in range(users)
    ]
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def user(u: int, client: Any) -> None:
        history = list(shared)
        for r in range(rounds):
            history += turns[u][r]
            base = bases[(u + r) % 2]
            ttft, _itl, tokens, _n = await serving._complete(
                client, f"{base}/v1/completions", model, history, gen
            )
            out.append({"user": u, "round": r, "ttft": ttft, "tokens": tokens})
            history += tokens
            await asyncio.sleep(0.2)

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(user(u, client) for u in range(users)))
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--quick", action="store_true", help="4 rounds, 1 repeat")
    ap.add_argument(
        "--ram-blocks",
        type=int,
        help="kvtier's RAM in blocks, both servers together (default: the working set "
        "plus both servers' staging rows)",
    )
    args = ap.parse_args()
    rounds = args.rounds or (4 if args.quick else 5)
    reps = args.reps or (1 if args.quick else 2)
    system, turn, gen = 512, 256, 16
    started = time.perf_counter()
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    answers: dict[str, dict[tuple[int, int], list[int]]] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model = serving.build_model(tmp / "model", SHAPES["default"])
        wl = serving.Workload(
            users=args.users, rounds=rounds, system=system, turn=turn, gen=gen, think=0.2, seed=0
        )
        sizes = serving.Sizes.plan(serving.kv_bytes_per_token(model), wl, None)
        longest = math.ceil(wl.longest() / BLOCK)
        ws = sizes.working_set_blocks
        staging = longest + serving.ROWS_PER_STEP_TOKENS // BLOCK
        # kvtier's RAM, the same in both: by default the working set once plus both
        # servers' staging rows, so that the host tier holds every block once while
        # each private tier holds about 60% of it.
        ram = args.ram_blocks or ws + 2 * staging
        print(
            f"{args.users} users x {rounds} rounds ({system}-token system prompt, {turn}-token "
            f"turns, {gen} generated), sessions alternating between 2 servers; working set "
            f"{ws} blocks of {sizes.block_bytes >> 10} KiB, vLLM's cache {sizes.engine_blocks} "
            f"blocks a server; kvtier's RAM {ram} blocks: private {ram // 2} a server; shared "
            f"{staging} a server + a host tier of {ram - 2 * staging}",
            file=sys.stderr,
        )
        for rep in range(reps):
            for config in CONFIGS if rep % 2 == 0 else reversed(CONFIGS):
                extra = _extra(config, sizes, ram, staging)
                servers = [_server(model, config, sizes, extra, tmp, i) for i in range(2)]
                try:
                    for s in servers:
                        s.start()
                    before = [serving.scrape(s.base) for s in servers]
                    reqs, seconds = asyncio.run(
                        _users(
                            [s.base for s in servers],
                            str(model),
                            args.users,
                            rounds,
                            system,
                            turn,
                            gen,
                            rep,
                        )
                    )
                    after = [serving.scrape(s.base) for s in servers]
                finally:
                    for s in servers:
                        s.stop()
                    # vLLM force-kills its EngineCore: the segment is left to its janitor.
                    # Removed now, so that the next phase does not adopt this one's blocks.
                    reap_host_segments()

                def delta(name: str, after: Any = after, before: Any = before) -> float:
                    pairs = zip(after, before, strict=True)
                    return sum(serving._delta(a, b, name) for a, b in pairs)

                ttfts = [r["ttft"] for r in reqs]
                answers.setdefault(config, {}).update(
                    {(r["user"], r["round"]): r["tokens"] for r in reqs}
                )
                rows[config].append(
                    {
                        "req_s": len(reqs) / seconds,
                        "ttft_p50": serving.pct(ttfts, 50),
                        "ttft_p99": serving.pct(ttfts, 99),
                        "vllm_tokens": delta("vllm:prefix_cache_hits_total"),
                        "kvtier_tokens": delta("vllm:external_prefix_cache_hits_total"),
                        "peer_hits": delta("kvtier_peer_hits_total{host}"),
                        "prompt_tokens": delta("vllm:prompt_tokens_total"),
                    }
                )
                print(f"{config} rep {rep}: {rows[config][-1]}", file=sys.stderr)
    equal = answers.get("private") == answers.get("shared")
    print(
        f"\n{' '.join(sys.argv[1:]) or 'full run'}: {time.perf_counter() - started:.0f} s; "
        f"greedy answers equal across configurations: {equal}"
    )
    print(
        "| config | req/s | TTFT p50 | TTFT p99 | tokens from vLLM's cache | from kvtier "
        "| host peer hits (blocks) |"
    )
    print("|---|---|---|---|---|---|---|")
    med: dict[str, dict[str, float]] = {}
    for config in CONFIGS:
        med[config] = {k: statistics.median(r[k] for r in rows[config]) for k in rows[config][0]}
        m = med[config]
        print(
            f"| {config} | {m['req_s']:.2f} | {m['ttft_p50'] * 1e3:.0f} ms "
            f"| {m['ttft_p99'] * 1e3:.0f} ms | {m['vllm_tokens']:.0f} "
            f"| {m['kvtier_tokens']:.0f} | {m['peer_hits']:.0f} |"
        )
    own, one = med["private"], med["shared"]
    print(
        f"shared / private: req/s {one['req_s'] / own['req_s']:.2f}x, TTFT p50 "
        f"{one['ttft_p50'] / own['ttft_p50']:.2f}x, p99 {one['ttft_p99'] / own['ttft_p99']:.2f}x, "
        f"tokens from kvtier {one['kvtier_tokens'] / max(own['kvtier_tokens'], 1):.2f}x"
    )


if __name__ == "__main__":
    main()
