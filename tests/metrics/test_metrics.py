"""kvtier.metrics: the Engine exporter scraped over HTTP, and the catalogue both fronts share."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier import (
    Engine,
    EngineCounts,
    FileTierConfig,
    FrontStatistics,
    KVLayout,
    KVTierConfig,
    TierReport,
    chain_keys,
)
from kvtier.errors import ConfigurationError
from kvtier.integrations.vllm.statistics import VLLM_METRICS, VLLMCounts
from kvtier.metrics import (
    ENGINE_METRICS,
    FRONT_METRICS,
    LOOKUPS,
    METRICS,
    READ_DURATION,
    TIER_METRICS,
    DeltaReporter,
    Figure,
    MetricSpec,
    record_metrics,
    register_engine_metrics,
    serve_metrics,
)

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
MARK = "<!-- tested: tests/metrics/test_metrics.py -->"
CPU_ROWS = 4


def documented_block() -> str:
    """The python block docs/operations.md shows for the Engine, on a free local port."""
    block = re.search(re.escape(MARK) + r"\n```python\n(.*?)^```", DOCS.read_text(), re.S | re.M)
    assert block is not None, f"docs/operations.md has no python block after {MARK!r}"
    code = block.group(1)
    assert 'serve_metrics(engine, 9400, addr="0.0.0.0")' in code
    return code.replace("9400", "0").replace("0.0.0.0", "127.0.0.1")


@asynccontextmanager
async def small_engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    """An engine of 4 CPU rows over a file tier of 32 slots, on the CPU backend."""
    kv = [torch.randn(2, 32, 4, 2, 64).to(torch.float16) for _ in range(2)]
    layout = KVLayout.from_tensors(kv, model_id="metrics", block_tokens=4, num_blocks=32)
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    config = KVTierConfig(
        cpu_bytes_to_use=CPU_ROWS * row,
        file_tier=FileTierConfig(root=tmp_path / "kv", bytes_to_use=32 * (row + 4096) + 4096),
    )
    engine = await Engine.open(config, layout, kv)
    try:
        yield engine, kv
    finally:
        await engine.aclose()


async def exercise(engine: Engine) -> list[bytes]:
    """Store 8 blocks through 4 CPU rows (so 4 reach only the file tier), load them all."""
    tokens = list(range(8 * engine.block_tokens))
    keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
    for i in range(0, 8, 2):
        await engine.store(keys[i : i + 2], [i, i + 1])
    await engine.flush()
    assert engine.lookup(keys) == 8
    assert await engine.load(keys[:4], [20, 21, 22, 23]) == 4  # promoted from the file tier
    assert await engine.load(keys[4:], [24, 25, 26, 27]) == 4
    return keys


def scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_engine_metrics_scraped_over_http(tmp_path: Path) -> None:
    async with small_engine(tmp_path) as (engine, _kv):
        await exercise(engine)
        scope: dict[str, Any] = {"engine": engine}
        exec(documented_block(), scope)  # on this loop, as the docs say
        server, thread = scope["server"], scope["_thread"]
        try:
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            # The server's thread takes the snapshot on this loop: fetch from another thread.
            text = await asyncio.to_thread(_fetch, url)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)
        st = engine.statistics()
        row_bytes = engine.layout.bytes_per_chunk
        got = scraped(text)

    assert value(got, "kvtier_lookups_total") == st.lookups == 8
    cpu_hits = value(got, "kvtier_lookup_hits_total", tier="cpu")
    file_hits = value(got, "kvtier_lookup_hits_total", tier="file")
    assert (cpu_hits, file_hits) == (st.tiers["cpu"].lookup_hits, st.tiers["file"].lookup_hits)
    assert cpu_hits + file_hits == 8
    assert file_hits > 0
    # The CPU tier: device <-> rows, in whole rows.
    assert value(got, "kvtier_written_blocks_total", tier="cpu") == 8
    assert value(got, "kvtier_written_bytes_total", tier="cpu") == 8 * row_bytes
    assert value(got, "kvtier_read_blocks_total", tier="cpu") == 8
    assert value(got, "kvtier_capacity_bytes", tier="cpu") == CPU_ROWS * row_bytes
    assert 0 < value(got, "kvtier_used_bytes", tier="cpu") <= CPU_ROWS * row_bytes
    assert value(got, "kvtier_evictions_total", tier="cpu") >= 4
    assert value(got, "kvtier_store_refusals_total") == st.store_refusals  # each awaited room
    assert value(got, "kvtier_dropped_total") == st.front.dropped == 0
    # The file tier: written through, promoted back, verified, recovered at open.
    assert value(got, "kvtier_written_blocks_total", tier="file") == 8
    assert (
        value(got, "kvtier_written_bytes_total", tier="file")
        == st.tiers["file"].written_bytes
        == st.tiers["file"].statistics.bytes_written
        > 0
    )
    assert value(got, "kvtier_read_blocks_total", tier="file") == st.tiers["file"].read_blocks >= 4
    assert value(got, "kvtier_read_bytes_total", tier="file") == st.tiers["file"].read_bytes > 0
    assert value(got, "kvtier_write_busy_seconds_total", tier="file") > 0
    assert value(got, "kvtier_read_failures_total", tier="file") == 0
    assert value(got, "kvtier_quarantined_blocks_total", tier="file") == 0
    assert value(got, "kvtier_resident_blocks", tier="file") == 8
    assert (
        value(got, "kvtier_capacity_bytes", tier="file")
        == st.tiers["file"].statistics.capacity_bytes
        > 0
    )
    assert value(got, "kvtier_recovery_state", tier="file", state="complete") == 1
    assert value(got, "kvtier_recovery_state", tier="file", state="running") == 0
    assert value(got, "kvtier_load_shortfalls_total") == st.front.load_shortfalls == 0
    # Every field of every record, under its own series and nowhere else.
    for spec, record in [
        *((spec, st) for spec in FRONT_METRICS),
        *((spec, st.front) for spec in ENGINE_METRICS),
    ]:
        assert spec.field is not None
        expected = getattr(record, spec.field)
        if expected is None:  # no such figure yet: no sample
            assert (spec.name, ()) not in got, spec.name
        else:
            assert value(got, spec.name) == expected, spec.name
    for tier, report in st.tiers.items():
        for spec in TIER_METRICS:
            assert spec.field is not None
            expected = getattr(report, spec.field)
            if expected is None:
                assert (spec.name, (("tier", tier),)) not in got, (spec.name, tier)
            else:
                assert value(got, spec.name, tier=tier) == expected, (spec.name, tier)
    # Prometheus conventions, as the text format carries them.
    assert "# TYPE kvtier_lookup_hits_total counter" in text
    assert "# TYPE kvtier_used_bytes gauge" in text
    assert not any(tier == "cluster" for (_n, labels) in got for k, tier in labels if k == "tier")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


async def test_a_scrape_on_the_engines_loop_reads_at_once(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with small_engine(tmp_path) as (engine, _kv):
        collector = register_engine_metrics(engine, registry)
        await exercise(engine)
        text = prometheus_client.generate_latest(registry).decode()  # on the loop's thread
        registry.unregister(collector)
    assert value(scraped(text), "kvtier_lookups_total") == 8


def test_the_exporter_names_its_extra_when_prometheus_client_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what an absent package gives
    with pytest.raises(ConfigurationError, match=re.escape("pip install prometheus-client")):
        serve_metrics(object(), 0)  # type: ignore[arg-type]


def test_importing_kvtier_does_not_import_prometheus_client() -> None:
    code = "import sys, kvtier, kvtier.metrics; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_metric_is_in_the_operations_guide() -> None:
    text = DOCS.read_text()
    missing = [spec.name for spec in (*METRICS, *VLLM_METRICS) if f"`{spec.name}`" not in text]
    assert missing == []


RECORDS: list[tuple[type[Any], tuple[MetricSpec, ...], set[str]]] = [
    (TierReport, TIER_METRICS, {"statistics"}),
    (FrontStatistics, FRONT_METRICS, {"tiers", "front"}),
    (EngineCounts, ENGINE_METRICS, set()),
    (VLLMCounts, VLLM_METRICS, set()),
]


@pytest.mark.parametrize(
    ("record", "specs", "skip"), RECORDS, ids=[r.__name__ for r, _s, _k in RECORDS]
)
def test_every_record_field_has_exactly_one_series_named_after_it(
    record: type[Any], specs: tuple[MetricSpec, ...], skip: set[str]
) -> None:
    names = [f.name for f in dataclasses.fields(record) if f.name not in skip]
    assert [spec.field for spec in specs] == names
    for spec in specs:
        assert spec.name == f"kvtier_{spec.field}" + ("_total" if spec.kind == "counter" else "")
    every = [spec.name for spec in (*METRICS, *VLLM_METRICS)]
    assert len(every) == len(set(every)), "a series named twice"
    assert all(sum(s.field == n for s in specs) == 1 for n in names)


def test_a_figure_table_must_name_every_field_of_its_record() -> None:
    with pytest.raises(ValueError, match="differ"):
        record_metrics(EngineCounts, {"dropped": Figure("counter", "Dropped.")})


def test_names_follow_prometheus_conventions() -> None:
    for spec in (*METRICS, *VLLM_METRICS):
        assert re.fullmatch(r"kvtier_[a-z_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds"), spec.name
    assert all(spec.labelnames[0] == "tier" for spec in TIER_METRICS)
    assert LOOKUPS.labelnames == ()


class Recorded:
    """What a DeltaReporter sent, in order (the calls vLLM's stats object takes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, tuple[str, ...]]] = []

    def increase_counter(self, name: str, value: float = 1, labels: tuple[str, ...] = ()) -> None:
        self.calls.append(("counter", name, value, labels))

    def set_gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self.calls.append(("gauge", name, value, labels))

    def observe_histogram(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self.calls.append(("histogram", name, value, labels))


def test_delta_reporter_sends_increases_and_changed_gauges() -> None:
    reporter = DeltaReporter()
    hits, used = "kvtier_lookup_hits_total", "kvtier_used_bytes"
    first, second, third = Recorded(), Recorded(), Recorded()
    failures = "kvtier_write_failures_total"
    reporter.report({(hits, ("cpu",)): 3, (used, ("cpu",)): 100, (failures, ("file",)): 0}, first)
    reporter.began("job")
    reporter.ended("job", READ_DURATION, "file")
    reporter.ended("never began", READ_DURATION, "file")
    reporter.report({(hits, ("cpu",)): 5, (used, ("cpu",)): 100}, second)
    reporter.report({(hits, ("cpu",)): 1, (used, ("cpu",)): 50}, third)  # reset below the last
    assert first.calls == [
        ("counter", hits, 3, ("cpu",)),
        ("gauge", used, 100, ("cpu",)),
        ("counter", failures, 0, ("file",)),  # the series exists before its first failure
    ]
    assert second.calls[0] == ("counter", hits, 2, ("cpu",))
    ((kind, name, seconds, labels),) = second.calls[1:]
    assert (kind, name, labels) == ("histogram", READ_DURATION.name, ("file",))
    assert 0 <= seconds < 10
    assert third.calls == [("counter", hits, 1, ("cpu",)), ("gauge", used, 50, ("cpu",))]


def test_the_grafana_dashboard_queries_only_kvtiers_metrics() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "grafana-kvtier.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {re.sub(r"_bucket$", "", n) for e in exprs for n in re.findall(r"kvtier_\w+", e)}
    assert used <= {spec.name for spec in (*METRICS, *VLLM_METRICS)}
    # The panels the operations guide promises.
    assert {"kvtier_lookup_hits_total", "kvtier_read_bytes_total", "kvtier_used_bytes"} <= used
    assert {"kvtier_read_failures_total", "kvtier_quarantined_blocks_total"} <= used
