"""A vLLM instance with or without kvtier, prompts and results, for tests_vllm.

The tiny random models are built by :mod:`kvtier.testing.vllm_model`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_SIZE = 128
SPEC = {"spec_name": "KVTierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm.spec"}


def prompts(
    n_a: int = 1024, shared: int = 768, n_b: int = 1024, seed: int = 1
) -> tuple[list[int], list[int]]:
    """Request A, and B sharing A's first ``shared`` tokens."""
    rng = random.Random(seed)
    a = [rng.randrange(1024) for _ in range(n_a)]
    b = a[:shared] + [rng.randrange(1024) for _ in range(n_b - shared)]
    return a, b


@dataclass
class Result:
    tokens: list[int]
    logprobs: list[float]
    num_cached_tokens: int


def kv_config(extra: Mapping[str, Any] | None) -> Any:
    from vllm.config import KVTransferConfig

    if extra is None:
        return None
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={**SPEC, **extra},
    )


@contextlib.contextmanager
def instance(model: Path, extra: Mapping[str, Any] | None, **kwargs: Any) -> Iterator[Any]:
    """A vLLM instance (EngineCore and workers in their own processes); stopped on exit."""
    from vllm import LLM

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kv_config(extra),
        **kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, tokens: list[int], max_tokens: int = 8) -> Result:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    comp = out.outputs[0]
    lps = [float(d[t].logprob) for d, t in zip(comp.logprobs, comp.token_ids, strict=True)]
    return Result(list(comp.token_ids), lps, int(out.num_cached_tokens or 0))


def read_statistics(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def offloading_config(
    *,
    events: bool = False,
    groups: int = 1,
    blocks_per_chunk: int = 1,
    row_bytes: int = 4096,
    engine_id: str | None = None,
    extra: Mapping[str, Any] | None = None,
    rows: int = 8,
    model: str = "tiny",
) -> Any:
    """vLLM's ``OffloadingConfig`` for kvtier, as vLLM builds it: one rank, ``rows`` rows."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
    )

    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=128, layer_names=(f"layers.{g}.attn",), group_id=g
            )
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "KVTierOffloadingSpec",
            "spec_module_path": "kvtier.integrations.vllm.spec",
            "cpu_bytes_to_use": rows * row_bytes * blocks_per_chunk,
            **(extra or {}),
        },
        engine_id=engine_id or f"test-{uuid.uuid4()}",
        model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=blocks_per_chunk),
        parallel=single_rank(),
    )


def single_rank() -> Any:
    """vLLM's ``OffloadingParallelConfig`` of one process: no parallelism."""
    from vllm.v1.kv_offload.config import OffloadingParallelConfig

    return OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=True,
    )


def offloading_config_of_vllm(
    model: Path,
    *,
    cache_dtype: str = "auto",
    kv_cache_layout: str = "LBNHC",
    extra: Mapping[str, Any] | None = None,
    rows: int = 8,
) -> Any:
    """vLLM's ``OffloadingConfig`` for the tiny Llama, built by vLLM from a real ``VllmConfig``.

    vLLM's own steps without its processes: the engine core's KV cache config
    (``get_kv_cache_configs``) from the specs the model's attention layers
    publish, then the connector's translation (``build_offloading_config``).
    ``kv_cache_layout`` stands for the attention backend's choice: the engine
    core resolves it from what the workers' backends support and records it in
    ``cache_config.kv_cache_layout``, which vLLM lets tests preset (its CPU
    build has one backend).
    """
    import pytest
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if current_platform.is_unspecified():
        pytest.skip("no vLLM platform to build a VllmConfig on (0.33's Python without its engine)")

    # The tiny Llama's layers: 2 KV heads of 64, one byte per element when quantized.
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32 if cache_dtype == "auto" else torch.uint8,
    )
    layers = {f"model.layers.{i}.self_attn.attn": spec for i in range(4)}
    row_bytes = len(layers) * spec.page_size_bytes
    cache = CacheConfig(block_size=BLOCK_SIZE, cache_dtype=cache_dtype)
    cache.kv_cache_layout = kv_cache_layout
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model), dtype="float32", skip_tokenizer_init=True, max_model_len=4096
        ),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=f"test-{uuid.uuid4()}",
            kv_connector_extra_config={
                **SPEC,
                "cpu_bytes_to_use": rows * row_bytes,
                **(extra or {}),
            },
        ),
    )
    (kv_cache_config,) = _kv_cache_configs(vllm_config, layers, 64 * row_bytes)
    return build_offloading_config(vllm_config, kv_cache_config)


def _kv_cache_configs(vllm_config: Any, layers: Mapping[str, Any], memory: int) -> Any:
    """The engine core's KV cache configs of one worker, as its vLLM (0.32 or 0.33) makes them."""
    try:  # 0.33: the groups of the whole model first, then each worker's config
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        return get_kv_cache_configs(vllm_config, [dict(layers)], [memory])
    groups = get_global_kv_cache_groups(vllm_config, [dict(layers)])
    return get_kv_cache_configs(vllm_config, [dict(layers)], [memory], groups)


@contextlib.contextmanager
def serve(model: Path, extra: Mapping[str, Any] | None, log: Path) -> Iterator[Served]:
    """``vllm serve`` of the tiny model (kvtier's command for vLLM's CPU build) on a free
    port of 127.0.0.1, in a process group of its own; SIGTERM by pid on exit, then
    SIGKILL to the group of whatever is left after 60 s."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    args = [sys.executable, "-m", "kvtier.integrations.vllm.serve", str(model)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init"]
    args += ["--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "4096"]
    args += ["--no-enable-prefix-caching", "--enforce-eager", "--seed", "0"]
    if extra is not None:
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
        args += [
            "--kv-transfer-config",
            json.dumps({**kv, "kv_connector_extra_config": {**SPEC, **extra}}),
        ]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            args,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=log.parent,
        )
    served = Served(f"http://127.0.0.1:{port}", proc, str(model), log)
    try:
        deadline = time.monotonic() + 420
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            try:
                with urllib.request.urlopen(f"{served.base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(1.0)
        yield served
    finally:
        if proc.poll() is None:
            group = os.getpgid(proc.pid)
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(group, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)  # stragglers of the group


@dataclass
class Served:
    """A running ``vllm serve``: its URL, its process (the group's leader), its log."""

    base: str
    proc: Any
    model: str
    log: Path

    def complete(self, tokens: list[int], max_tokens: int = 8) -> list[int]:
        """A greedy completion of ``tokens``: the token ids generated."""
        import urllib.request

        body = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"{self.base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            out = json.loads(resp.read())
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` that carry ``labels`` (0: none)."""
        import urllib.request

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " ")) and all(w in line for w in want)
        )
