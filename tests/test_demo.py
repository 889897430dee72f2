"""``kvtier demo``: a real model served over every tier gives the recompute's outputs."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvtier.cli import main
from kvtier.demo.model import KEY_BLOCK, MIN_ROWS, DemoModel
from kvtier.demo.serving import DemoSettings, run_demo


async def test_quick_demo_hits_both_tiers_and_matches_recompute(tmp_path: Path) -> None:
    result = await run_demo(replace(DemoSettings.quick(), tmp_parent=tmp_path))
    sources = {r.source for r in result.records}
    assert {"cpu", "file"} <= sources, sources
    assert result.tiers.cpu_hits > 0
    assert result.tiers.file_hits > 0
    assert result.tiers.promotions > 0
    assert result.tiers.cpu_evictions > 0  # the workload does not fit in the CPU tier
    assert result.tiers.load_shortfalls == 0
    assert result.tiers.dropped == 0
    assert all(r.tokens_identical and r.logits_identical for r in result.records)
    assert result.mismatches == 0
    assert sum(r.loaded_tokens for r in result.records) > 0


def test_demo_command_prints_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # Not a terminal: a plain line per request, no progress bar, then the tables.
    assert "served 16/16" in out
    assert "checked 16/16" in out
    assert "━" not in out.split("Tiers")[0]
    assert "file tier" in out
    assert "16/16 requests generated the same 4 greedy tokens" in out
    assert "bit for bit in 16/16" in out
    assert list(tmp_path.iterdir()) == []  # the file tier's directory is gone


def test_a_wrong_block_fails_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The test hook zeroes one loaded device block, as a tier serving wrong
    # bytes would: the comparison with the recompute must catch it.
    assert main(["demo", "--quick", "--corrupt-one-block", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out
    assert "bit for bit in 16/16" not in out


@pytest.mark.parametrize("split", [MIN_ROWS, 64, KEY_BLOCK, KEY_BLOCK + 48, 400], ids=str)
@pytest.mark.parametrize("suffix", [1, 3, MIN_ROWS + 1, 200], ids=lambda n: f"suffix{n}")
def test_prefill_on_cached_kv_equals_recompute_bit_for_bit(split: int, suffix: int) -> None:
    # The demo's check rests on this: KV computed in an earlier, shorter call
    # and a suffix computed on top of it give the logits of one full prefill.
    model = DemoModel(DemoSettings.quick().model, seed=3)
    rng = random.Random(split * 1000 + suffix)
    prompt = [rng.randrange(model.config.vocab) for _ in range(split + suffix)]
    blocks = -(-len(prompt) // 16)
    cache = model.new_cache(2 * blocks, 16)
    table = list(range(blocks, 2 * blocks))  # other device blocks than the full run's
    model.forward(cache, table, prompt[:split], 0)
    logits = model.forward(cache, table, prompt[split:], split)
    full = model.new_cache(blocks, 16)
    expected = model.forward(full, list(range(blocks)), prompt, 0)
    assert torch.equal(logits, expected)
    for got, want in zip(cache, full, strict=True):
        assert torch.equal(got[:, blocks:], want)
