"""Two live vLLM instances on one file-tier root: B reuses a prefix only A served.

Instances A and B (each vLLM with its own EngineCore and worker processes,
both alive at once) are given the same ``file_tier`` block with
``instances: 2``: A opens partition 0 of the namespace, B partition 1 (see
docs/file-tier.md, "Sharing a root"). A serves a prompt; its blocks are
written through to A's partition and published in its index; B serves a
prompt sharing a long prefix with it, finds the prefix through A's index
(no I/O on lookup), reads it from A's slot file, verified, and its greedy
outputs and logprobs equal those of a run without offloading.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.file import IndexReader
from tests_vllm._harness import Result, generate, instance, prompts, read_statistics

SHARED = 768
BLOCK_TOKENS = 128
LOGPROB_ATOL = 1e-4
A, B = prompts(seed=21)


def _extra(root: Path, stats: Path) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": "64MiB",
        "file_tier": {
            "root": str(root),
            "bytes_to_use": "512MiB",
            "instances": 2,
            "peer_poll_s": 0.01,
        },
        "statistics_file": str(stats),
    }


def _same(got: Result, want: Result) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == pytest.approx(want.logprobs, abs=LOGPROB_ATOL)


def _published(root: Path) -> int:
    """Blocks published in partition 0's index (A's), read as another instance would."""
    (ns_dir,) = [p for p in root.iterdir() if p.is_dir() and "." not in p.name]
    index = IndexReader(ns_dir / "index")
    try:
        return sum(key is not None for _slot, key in index.changes())
    finally:
        index.close()


def test_two_live_instances_share_one_root(model_dir: Path, tmp_path: Path) -> None:
    with instance(model_dir, None) as plain:
        want = {"A": generate(plain, A), "B": generate(plain, B)}
    root = tmp_path / "kv"
    stats_a, stats_b = tmp_path / "a.json", tmp_path / "b.json"
    with (
        instance(model_dir, _extra(root, stats_a)) as a,
        instance(model_dir, _extra(root, stats_b)) as b,
    ):
        got_a = generate(a, A)
        _same(got_a, want["A"])
        assert got_a.num_cached_tokens == 0
        # A's write-through ends shortly after its request: wait for its index
        # to show the prefix, then for B's poll (0.01 s) to pick it up.
        deadline = time.monotonic() + 30
        while _published(root) < SHARED // BLOCK_TOKENS:
            assert time.monotonic() < deadline, "A's blocks never reached its partition"
            time.sleep(0.05)
        time.sleep(0.2)
        got_b = generate(b, B)
        _same(got_b, want["B"])
        assert got_b.num_cached_tokens == SHARED
        st_b = read_statistics(stats_b)
        assert st_b["tiers"]["file"]["lookup_hits"] >= SHARED // BLOCK_TOKENS
        assert st_b["tiers"]["file"]["statistics"]["partition"].endswith(".1")
        assert st_b["tiers"]["file"]["statistics"]["peer_hits"] >= SHARED // BLOCK_TOKENS
        assert st_b["tiers"]["file"]["statistics"]["peer_stale"] == 0
        assert st_b["tiers"]["file"]["statistics"]["quarantined"] == 0
    st_a = read_statistics(stats_a)
    assert (
        st_a["tiers"]["file"]["statistics"]["partition"]
        == st_b["tiers"]["file"]["statistics"]["partition"].split(".")[0]
    )
    assert st_a["tiers"]["file"]["statistics"]["stores"] >= SHARED // BLOCK_TOKENS
