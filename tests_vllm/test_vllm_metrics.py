"""kvtier's tiers on vLLM's Prometheus /metrics (issue 34).

The scheduler side alone first (vLLM's own stats object: what ``get_stats``
reports, declared by ``build_metric_definitions``), then a real ``vllm serve``
(the command docs/vllm.md shows, run by test_vllm_serve.py's fixture): two
requests sharing a prefix, and /metrics scraped over HTTP.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests_vllm._harness import offloading_config, prompts
from tests_vllm.test_vllm_serve import Server, _post, server  # noqa: F401 - the fixture

Scraped = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[Any]:
    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    file_tier = {"root": str(tmp_path / "kv"), "bytes_to_use": "8MiB"}
    spec = KVTierOffloadingSpec(offloading_config(rows=8, extra={"file_tier": file_tier}))
    manager = spec.get_manager()
    try:
        yield manager
    finally:
        manager.shutdown()


def _reported(stats: Any) -> dict[str, dict[tuple[str, ...], Any]]:
    return dict(stats.data["data"]) if stats is not None else {}


def test_get_stats_reports_what_build_metric_definitions_declares(manager: Any) -> None:
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
        ReqContext,
        make_offload_key,
    )

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

    declared = KVTierOffloadingSpec.build_metric_definitions({})
    ctx = ReqContext(req_id="r")
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(4)]
    out = manager.prepare_store(keys, ctx)
    manager.complete_store(out.keys_to_store, ctx)
    deadline = time.monotonic() + 10
    while manager.statistics().tiers["file"].written_blocks < 4 and time.monotonic() < deadline:
        manager.on_schedule_end(None)
        time.sleep(0.01)
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 4
    manager.prepare_load(keys, ctx)
    manager.complete_load(keys, ctx)

    stats = manager.get_stats()
    data, types = _reported(stats), dict(stats.data["types"])
    kinds = {
        "counter": OffloadingCounterMetadata,
        "gauge": OffloadingGaugeMetadata,
        "histogram": OffloadingHistogramMetadata,
    }
    for name, series in data.items():
        assert isinstance(declared[name], kinds[types[name]]), name
        assert all(len(labels) == len(declared[name].labelnames) for labels in series), name
    assert data["kvtier_lookups_total"][()] == 4
    assert data["kvtier_lookup_hits_total"][("cpu",)] == 4
    row = 4096  # offloading_config's worker_kv_bytes_per_block, one rank
    assert data["kvtier_written_bytes_total"][("cpu",)] == 4 * row
    assert data["kvtier_read_blocks_total"][("cpu",)] == 4
    assert data["kvtier_written_blocks_total"][("file",)] == 4
    assert data["kvtier_written_bytes_total"][("file",)] > 0
    assert data["kvtier_capacity_bytes"][("cpu",)] == 8 * row
    assert data["kvtier_capacity_bytes"][("file",)] > 0
    assert data["kvtier_recovery_state"][("file", "complete")] == 1
    # One store and one load of the CPU tier, and the write-through, timed.
    assert len(data["kvtier_write_duration_seconds"][("cpu",)]) == 1
    assert len(data["kvtier_read_duration_seconds"][("cpu",)]) == 1
    assert len(data["kvtier_write_duration_seconds"][("file",)]) == 1
    # Every field of the front's records, under its own series (a None: no sample).
    from kvtier.integrations.vllm.statistics import VLLM_METRICS
    from kvtier.metrics import FRONT_METRICS, TIER_METRICS

    st = manager.statistics()
    for spec, record in [
        *((spec, st) for spec in FRONT_METRICS),
        *((spec, st.front) for spec in VLLM_METRICS),
    ]:
        if getattr(record, spec.field) is not None:
            assert data[spec.name][()] == getattr(record, spec.field), spec.name
    for tier, report in st.tiers.items():
        for spec in TIER_METRICS:
            if getattr(report, spec.field) is not None:
                assert data[spec.name][(tier,)] == getattr(report, spec.field), (spec.name, tier)
    # Counters go to vLLM as increases: nothing new, nothing reported.
    assert manager.get_stats() is None
    manager.lookup(keys[0], ctx)
    assert _reported(manager.get_stats())["kvtier_lookups_total"] == {(): 1}
    # The statistics_file carries the same names, with totals.
    totals = manager.statistics_json()["metrics"]
    assert totals["kvtier_lookups_total"] == {"": 5}
    assert totals["kvtier_lookup_hits_total"]["cpu"] == 5


def _scrape(base: str) -> tuple[str, Scraped]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    samples: Scraped = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvtier_"):
                # vLLM's model_name and engine labels: one engine here, summed away.
                labels = tuple(
                    sorted((k, v) for k, v in s.labels.items() if k in ("tier", "le", "state"))
                )
                key = (s.name, labels)
                samples[key] = samples.get(key, 0.0) + s.value
    return text, samples


def _get(samples: Scraped, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_vllm_serve_publishes_kvtiers_tiers(server: Server, model_dir: Path) -> None:  # noqa: F811
    base, _proc, _before = server
    a, b = prompts(n_a=1024, shared=768, n_b=1024)
    for tokens in (a, b):
        out = _post(
            f"{base}/v1/completions",
            {"model": str(model_dir), "prompt": tokens, "max_tokens": 4, "temperature": 0},
        )
        assert out["usage"]["completion_tokens"] == 4
    # vLLM sends kvtier's figures with each scheduler step: a write-through that
    # ends after the last step shows at the next one (one more short request).
    text, got = _scrape(base)
    for _ in range(3):
        if _get(got, "kvtier_written_bytes_total", tier="file") > 0:
            break
        _post(
            f"{base}/v1/completions",
            {"model": str(model_dir), "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0},
        )
        time.sleep(1.0)
        text, got = _scrape(base)

    assert "# TYPE kvtier_lookup_hits_total counter" in text
    assert 'model_name="' in text.split("kvtier_lookup_hits_total{", 1)[1].split("}", 1)[0]
    # B's 6 shared blocks (768 tokens / 128) were served by the CPU tier.
    assert _get(got, "kvtier_lookup_hits_total", tier="cpu") >= 6
    assert _get(got, "kvtier_lookups_total") >= 6
    assert _get(got, "kvtier_read_blocks_total", tier="cpu") >= 6
    # A's 8 blocks and B's own were stored, then written through to the file tier.
    assert _get(got, "kvtier_written_blocks_total", tier="cpu") >= 8
    assert _get(got, "kvtier_written_bytes_total", tier="cpu") > 0
    assert _get(got, "kvtier_written_blocks_total", tier="file") >= 8
    assert _get(got, "kvtier_written_bytes_total", tier="file") > 0
    # Failure counters are there at zero, before any failure.
    for name, tier in [
        ("kvtier_write_failures_total", "file"),
        ("kvtier_read_failures_total", "file"),
        ("kvtier_quarantined_blocks_total", "file"),
    ]:
        assert got[(name, (("tier", tier),))] == 0, name
    assert got[("kvtier_store_refusals_total", ())] >= 0  # the CPU tier's, no tier label
    # Usage and capacity, per tier, in bytes.
    for tier in ("cpu", "file"):
        capacity = _get(got, "kvtier_capacity_bytes", tier=tier)
        assert 0 < _get(got, "kvtier_used_bytes", tier=tier) <= capacity
    assert _get(got, "kvtier_capacity_bytes", tier="cpu") <= 1 << 30  # cpu_bytes_to_use 1GiB
    assert _get(got, "kvtier_recovery_state", tier="file", state="complete") == 1
    # Transfer latency: histograms of the CPU tier's loads and stores.
    assert _get(got, "kvtier_read_duration_seconds_count", tier="cpu") >= 1
    assert _get(got, "kvtier_write_duration_seconds_count", tier="cpu") >= 1
    assert _get(got, "kvtier_write_duration_seconds_count", tier="file") >= 1
