"""A hybrid model (sliding-window and full-attention layers: two KV cache groups).

A tiny random Gemma2 in vLLM's own processes: its sliding-window layers and its
full-attention layers are two KV cache groups, each with its own offload keys
and its own blocks in every transfer.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.testing.vllm_model import build_tiny_gemma2
from tests_vllm._harness import BLOCK_SIZE, generate, instance, prompts, read_statistics

A, _ = prompts(seed=7)
# B extends A: a sliding-window group only keeps (and vLLM only offloads) the
# blocks of the last window, so B's hit must end where A's window did.
B = A + [random.Random(8).randrange(1024) for _ in range(2 * BLOCK_SIZE)]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma2(tmp_path_factory.mktemp("gemma2"), sliding_window=2 * BLOCK_SIZE)


def test_both_groups_are_offloaded_and_loaded(gemma2: Path, tmp_path: Path) -> None:
    with instance(gemma2, None) as llm:
        want = generate(llm, B)
    stats = tmp_path / "stats.json"
    with instance(gemma2, {"cpu_bytes_to_use": "64MiB", "statistics_file": str(stats)}) as llm:
        generate(llm, A)
        got = generate(llm, B)
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got.num_cached_tokens > 0
    st = read_statistics(stats)
    # The full-attention group's blocks of the hit, and the window's blocks of
    # the sliding-window group on top of them.
    assert st["tiers"]["cpu"]["read_blocks"] > got.num_cached_tokens // BLOCK_SIZE
    assert st["loads"] >= 1
