"""kvtier's tiers as Prometheus metrics: one vocabulary, two fronts.

A figure keeps one name from the record that counts it to its series: the
field ``read_blocks`` of :class:`~kvtier.chain.TierReport` is the series
``kvtier_read_blocks_total{tier="file"}``. Each series is derived from a
record's field, never written out by hand:

* ``kvtier_`` + the field's name, and ``_total`` for a counter;
* one table per record (:data:`TIER_FIGURES`, :data:`FRONT_FIGURES`,
  :data:`ENGINE_FIGURES`, the vLLM front's beside its own record) gives each
  field its kind and ``# HELP`` line, and :func:`record_metrics` checks that
  it names every field of the record and nothing else;
* the records, one per level: a tier's :class:`~kvtier.chain.TierReport`
  (the chain's counts for it), labelled by ``tier``; a front's
  :class:`~kvtier.chain.FrontStatistics` and its own record (the Engine's
  :class:`~kvtier.EngineCounts`, the vLLM front's ``VLLMCounts``), without;
* a tier's own record (``FileTierStatistics``...) names the figures only it
  measures by their series names itself (:meth:`HasMetrics.metric_figures
  <kvtier.tiers.base.HasMetrics.metric_figures>`); :data:`OWN_FIGURES` gives
  them their ``# HELP`` lines (a counter's name ends in ``_total``).

The same names, labels and meanings reach Prometheus from either front, so one
dashboard serves both (docs/operations.md, "Metrics", lists them all):

* **inside vLLM**, :class:`~kvtier.integrations.vllm.spec.KVTierOffloadingSpec`
  declares :data:`METRICS` (and the vLLM front's own) through vLLM's
  ``build_metric_definitions`` and its manager reports them from ``get_stats``
  (a :class:`DeltaReporter` turns its totals into what vLLM's stats object
  takes); vLLM publishes them on its own ``/metrics``, with its
  ``model_name`` and ``engine`` labels added;
* **beside an** :class:`~kvtier.Engine`, :class:`KVTierCollector` reads
  :meth:`Engine.statistics() <kvtier.Engine.statistics>` at each scrape
  (``prometheus_client``, the optional ``kvtier[metrics]`` extra)::

      from kvtier.metrics import serve_metrics

      server, _thread = serve_metrics(engine, 9400)  # GET :9400/metrics

A tier of the chain is a value of the ``tier`` label (``cpu``, ``file``,
``cluster``), never a metric of its own. The ``metrics`` section of the vLLM
front's ``statistics_file`` (JSON) carries the same names. Sizes are bytes
and times seconds. Each :class:`MetricSpec` says which fronts report it
(``fronts``).

``prometheus_client`` is imported only by :class:`KVTierCollector` and the
functions built on it: ``import kvtier`` never needs it, nor does the vLLM
front (vLLM owns the registry there).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from kvtier.below import LowerCounts
from kvtier.chain import FrontStatistics, TierReport
from kvtier.engine import EngineCounts
from kvtier.errors import ConfigurationError
from kvtier.manager import ManagerStatistics
from kvtier.tiers.base import HasMetrics

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from kvtier.engine import Engine

__all__ = [
    "ENGINE_FIGURES",
    "ENGINE_METRICS",
    "FRONT_FIGURES",
    "FRONT_METRICS",
    "LOOKUPS",
    "LOWER_FIGURES",
    "LOWER_METRICS",
    "METRICS",
    "OWN_FIGURES",
    "OWN_METRICS",
    "READ_DURATION",
    "RECOVERY_STATES",
    "TIER_FIGURES",
    "TIER_METRICS",
    "WRITE_DURATION",
    "DeltaReporter",
    "Figure",
    "KVTierCollector",
    "MetricSpec",
    "Samples",
    "StatsSink",
    "as_json",
    "engine_samples",
    "front_samples",
    "own_figures",
    "record_metrics",
    "register_engine_metrics",
    "series_name",
    "serve_metrics",
]

RECOVERY_STATES = ("running", "complete", "failed")
"""Values of the ``state`` label of ``kvtier_recovery_state``."""

Kind = Literal["counter", "gauge", "histogram"]
Front = Literal["engine", "vllm", "lower"]

Samples = dict[tuple[str, tuple[str, ...]], float]
"""(metric name, label values: ``tier`` first where it has one) -> value."""

_BOTH: tuple[Front, ...] = ("engine", "vllm", "lower")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric, as both fronts declare it."""

    name: str
    """The full Prometheus name (a counter's with its ``_total``)."""
    kind: Kind
    """``counter``, ``gauge`` or ``histogram``."""
    documentation: str
    """The ``# HELP`` text."""
    labelnames: tuple[str, ...] = ("tier",)
    """kvtier's own labels (vLLM adds ``model_name`` and ``engine`` before them)."""
    buckets: tuple[float, ...] | None = None
    """A histogram's upper bounds, in seconds."""
    fronts: tuple[Front, ...] = _BOTH
    """The fronts that report it: ``engine`` (:class:`KVTierCollector`), ``vllm`` (the
    0.32 front), ``lower`` (below another engine's CPU tier: :mod:`kvtier.below`)."""
    field: str | None = None
    """The record field (or a tier's own figure) it reports; None for a histogram."""


@dataclass(frozen=True, slots=True)
class Figure:
    """What a record's field is, for Prometheus: its kind and its ``# HELP`` line."""

    kind: Literal["counter", "gauge"]
    """A counter (its series gets ``_total``) or a gauge."""
    documentation: str
    """The ``# HELP`` text (the record's docstring says more)."""


def _counter(documentation: str) -> Figure:
    return Figure("counter", documentation)


def _gauge(documentation: str) -> Figure:
    return Figure("gauge", documentation)


def series_name(field: str, kind: Kind) -> str:
    """The series of a record's field: ``kvtier_`` + its name, ``_total`` for a counter."""
    return "kvtier_" + field + ("_total" if kind == "counter" else "")


def record_metrics(
    record: type[Any],
    table: Mapping[str, Figure],
    *,
    labelnames: tuple[str, ...] = (),
    fronts: tuple[Front, ...] = _BOTH,
    skip: tuple[str, ...] = (),
) -> tuple[MetricSpec, ...]:
    """One metric per field of the dataclass ``record`` (but ``skip``), in field order.

    Raises
    ------
    ValueError
        ``table`` does not name exactly the fields of ``record`` (but ``skip``).
    """
    names = [f.name for f in fields(record) if f.name not in skip]
    if set(names) != set(table) or len(names) != len(table):
        raise ValueError(
            f"{record.__name__}: fields {sorted(names)} and figures {sorted(table)} differ"
        )
    return tuple(
        MetricSpec(
            series_name(name, table[name].kind),
            table[name].kind,
            table[name].documentation,
            labelnames,
            fronts=fronts,
            field=name,
        )
        for name in names
    )


TIER_FIGURES: dict[str, Figure] = {
    "lookup_hits": _counter("Looked-up keys this tier served."),
    "read_blocks": _counter(
        "Blocks read out of this tier (CPU: loads to the device; "
        "lower tiers: promotions into CPU rows)."
    ),
    "read_bytes": _counter("Payload bytes read out of this tier."),
    "written_blocks": _counter(
        "Blocks written into this tier (CPU: stores from the device; "
        "lower tiers: writes of CPU rows)."
    ),
    "written_bytes": _counter("Payload bytes written into this tier."),
    "read_busy_seconds": _counter("Seconds during which at least one read of this tier ran."),
    "write_busy_seconds": _counter("Seconds during which at least one write into this tier ran."),
    "read_failures": _counter("Blocks a read from this tier did not deliver."),
    "write_failures": _counter("Blocks whose write into this tier failed or could not start."),
    "write_backs": _counter("Blocks handed to this write-back tier (evicted from CPU, at close)."),
    "probes": _counter("Keys asked of this shared tier."),
    "loads_declined": _counter(
        "Lookups answered as misses because reading the block from this tier would have "
        "ended after recomputing it (decline_slow_loads)."
    ),
    "read_seconds_per_block": _gauge(
        "Seconds of reading per block this tier delivered lately (what a read is expected to cost)."
    ),
}
"""Each field of :class:`~kvtier.chain.TierReport` (the chain's counts for a tier)."""

FRONT_FIGURES: dict[str, Figure] = {
    "lookups": _counter("Keys looked up (every tier's hits count against it)."),
    "lookup_misses": _counter("Lookups no tier served."),
    "stores": _counter("Store calls (vLLM: prepare_store calls that placed blocks)."),
    "loads": _counter("Load calls (vLLM: prepare_load calls)."),
    "store_refusals": _counter(
        "Blocks offered to the CPU tier that it had no row for (every row pinned or held "
        "by writes in flight)."
    ),
    "recompute_seconds_per_block": _gauge("Seconds recomputing one block costs, set or measured."),
    "rows_held_by_writes": _gauge("CPU rows pinned now for writes to lower tiers."),
}
"""Each field of :class:`~kvtier.chain.FrontStatistics` but ``tiers`` and ``front``."""

ENGINE_FIGURES: dict[str, Figure] = {
    "dropped": _counter("Blocks a store gave up on: no row could be freed."),
    "load_shortfalls": _counter("Blocks a load had promised but could not deliver."),
    "abandoned_at_close": _counter(
        "Blocks aclose did not write to the lower tiers because its timeout passed first."
    ),
    "in_flight": _gauge("Jobs (device copies, promotions) running now."),
}
"""Each field of :class:`~kvtier.EngineCounts` (the Engine's own record)."""

OWN_FIGURES: dict[str, str] = {
    "integrity_failures_total": "Blocks read from this tier that failed verification.",
    "quarantined_blocks_total": "Slots of this tier quarantined (bad data or another namespace's).",
    "evictions_total": "Blocks evicted from this tier to make room.",
    "vanished_blocks_total": "Blocks this tier was known to hold, gone when read.",
    "peer_blocks": "Blocks other instances sharing this tier's root hold, readable here.",
    "resident_blocks": "Blocks held by this tier now.",
    "pinned_blocks": "Blocks of this tier held by loads or writes in flight.",
    "used_bytes": "Bytes of this tier holding blocks.",
    "capacity_bytes": "Bytes this tier has for blocks.",
    "recovery_blocks": "Blocks this tier found valid when it opened.",
    "recovery_torn_slots": "Slots this tier found torn (interrupted writes) when it opened.",
    "recovery_seconds": "Seconds this tier's recovery scan took when it opened.",
    "recovery_state": "1 for this tier's recovery state (running, complete, failed), else 0.",
    "node_outages_total": "Times a node of this tier stopped answering (its keys then miss).",
    "nodes_down": "Nodes of this tier not answering now.",
    "round_trips_total": "Cluster tier: pipelines sent, one round trip to one node each.",
    "peer_hits_total": "Host tier: verified loads of blocks other instances on the host stored.",
    "stale_peer_reads_total": "Host tier: reads of another instance's row that found it reused.",
    "leases_outstanding": "Host tier: leases live readers hold on rows now.",
    "rows_held": "Host tier: rows of the host segment this instance owns.",
}
"""The figures a tier's own record measures, by series name without ``kvtier_``: those
of :meth:`~kvtier.tiers.base.HasMetrics.metric_figures`, and of the CPU tier's
``ManagerStatistics`` (:func:`own_figures`). A counter's name ends in ``_total``."""

TIER_METRICS: tuple[MetricSpec, ...] = record_metrics(
    TierReport, TIER_FIGURES, labelnames=("tier",), skip=("statistics",)
)
"""One metric per :class:`~kvtier.chain.TierReport` field, labelled by ``tier``."""

FRONT_METRICS: tuple[MetricSpec, ...] = record_metrics(
    FrontStatistics, FRONT_FIGURES, skip=("tiers", "front")
)
"""One metric per :class:`~kvtier.chain.FrontStatistics` field, both fronts."""

ENGINE_METRICS: tuple[MetricSpec, ...] = record_metrics(
    EngineCounts, ENGINE_FIGURES, fronts=("engine",)
)
"""One metric per :class:`~kvtier.EngineCounts` field (the Engine front only)."""

LOWER_FIGURES: dict[str, Figure] = {
    "jobs_failed": _counter("Transfer jobs of the engine above with at least one failed block."),
    "blocks_failed": _counter(
        "Blocks of the engine's jobs that failed (a load recomputed, a store not kept)."
    ),
    "refused": _counter("Jobs refused at once (kvtier closed, or a slot out of range)."),
}
"""Each field of :class:`~kvtier.below.LowerCounts`."""

LOWER_METRICS: tuple[MetricSpec, ...] = record_metrics(
    LowerCounts, LOWER_FIGURES, fronts=("lower",)
)
"""One metric per :class:`~kvtier.below.LowerCounts` field (the lower front only)."""

OWN_METRICS: tuple[MetricSpec, ...] = tuple(
    MetricSpec(
        "kvtier_" + stem,
        "counter" if stem.endswith("_total") else "gauge",
        documentation,
        ("tier", "state") if stem == "recovery_state" else ("tier",),
        field=stem,
    )
    for stem, documentation in OWN_FIGURES.items()
)
"""One metric per figure of the tiers' own records (:data:`OWN_FIGURES`)."""

LOOKUPS = FRONT_METRICS[0]
"""``kvtier_lookups_total``: the denominator of every hit rate."""

_DURATION_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

READ_DURATION = MetricSpec(
    "kvtier_read_duration_seconds",
    "histogram",
    "Seconds one read job of this tier took (CPU tier: from the scheduler step that "
    "started the load to the one that saw it done).",
    buckets=_DURATION_BUCKETS,
    fronts=("vllm", "lower"),
)
WRITE_DURATION = MetricSpec(
    "kvtier_write_duration_seconds",
    "histogram",
    "Seconds one write job into this tier took (CPU tier: from the scheduler step that "
    "started the store to the one that saw it done).",
    buckets=_DURATION_BUCKETS,
    fronts=("vllm", "lower"),
)

METRICS: tuple[MetricSpec, ...] = (
    *FRONT_METRICS,
    *TIER_METRICS,
    *OWN_METRICS,
    *ENGINE_METRICS,
    *LOWER_METRICS,
    READ_DURATION,
    WRITE_DURATION,
)
"""Every metric of :mod:`kvtier.metrics`; each front reports those naming it in
``fronts`` (the vLLM front adds its own record's, ``VLLM_METRICS``)."""


def own_figures(report: TierReport[Any], row_bytes: int) -> dict[str, int | float | str]:
    """The figures of a tier's own record, by the stems of :data:`OWN_FIGURES`.

    Parameters
    ----------
    report
        The tier in a front's statistics (``statistics().tiers[name]``).
    row_bytes
        Payload bytes of one CPU row (the CPU tier's block).
    """
    own = report.statistics
    if isinstance(own, ManagerStatistics):
        return {
            "evictions_total": own.evictions,
            "resident_blocks": own.used,
            "pinned_blocks": own.pinned,
            "used_bytes": own.used * row_bytes,
            "capacity_bytes": own.capacity * row_bytes,
        }
    figures: dict[str, int | float | str] = {"resident_blocks": own.blocks}
    if isinstance(own, HasMetrics):
        # What only this kind of tier measures: each tier's record names it itself.
        figures.update(own.metric_figures())
    return figures


def _record(
    out: Samples, specs: Iterable[MetricSpec], record: Any, labels: tuple[str, ...]
) -> None:
    for spec in specs:
        value = getattr(record, cast("str", spec.field))
        if value is not None:  # None: no such figure yet (no sample, not a zero)
            out[(spec.name, labels)] = value


def front_samples(
    stats: FrontStatistics[Any], row_bytes: int, own: Iterable[MetricSpec] = ()
) -> Samples:
    """Every figure of a front's statistics as samples, each under its field's series.

    Parameters
    ----------
    stats
        The front's snapshot (``Engine.statistics()``, the vLLM front's ``statistics()``).
    row_bytes
        Payload bytes of one CPU row (``layout.bytes_per_chunk * world_size``).
    own
        The metrics of the front's own record, ``stats.front`` (:data:`ENGINE_METRICS`...).

    Notes
    -----
    Each tier's samples are :func:`tier_samples`'; a figure that is None gives none.
    """
    out: Samples = {}
    _record(out, FRONT_METRICS, stats, ())
    _record(out, own, stats.front, ())
    for tier, report in stats.tiers.items():
        out.update(tier_samples(tier, report, row_bytes))
    return out


def tier_samples(tier: str, report: TierReport[Any], row_bytes: int) -> Samples:
    """One tier's samples, labelled ``tier``: its :data:`TIER_METRICS` and its own figures.

    ``recovery_state`` gives one sample per state in :data:`RECOVERY_STATES`;
    a figure that is None gives none.
    """
    out: Samples = {}
    label = (tier,)
    _record(out, TIER_METRICS, report, label)
    for stem, value in own_figures(report, row_bytes).items():
        if isinstance(value, str):
            for state in RECOVERY_STATES:
                out[("kvtier_" + stem, (tier, state))] = float(state == value)
        else:
            out[("kvtier_" + stem, label)] = value
    return out


def as_json(values: Samples) -> dict[str, dict[str, float]]:
    """``values`` for a JSON file, by metric name then label values joined by commas.

    ``{"kvtier_lookup_hits_total": {"cpu": 12}, "kvtier_lookups_total": {"": 20}}``.
    """
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in values.items():
        out.setdefault(name, {})[",".join(labels)] = value
    return out


def engine_samples(stats: FrontStatistics[EngineCounts], row_bytes: int) -> Samples:
    """Every metric of the Engine front, from one statistics snapshot."""
    return front_samples(stats, row_bytes, ENGINE_METRICS)


class StatsSink(Protocol):
    """Where a :class:`DeltaReporter` reports: vLLM's ``OffloadingConnectorStats``."""

    def increase_counter(
        self, name: str, value: int | float = 1, labelvalues: tuple[str, ...] = (), /
    ) -> None:
        """Add ``value`` to a counter."""
        ...

    def set_gauge(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = (), /
    ) -> None:
        """Set a gauge."""
        ...

    def observe_histogram(
        self, name: str, value: int | float, labelvalues: tuple[str, ...] = (), /
    ) -> None:
        """Record one observation of a histogram."""
        ...


class DeltaReporter:
    """Totals and job durations, reported as vLLM's stats object takes them.

    vLLM adds each counter value it gets to its Prometheus counter and sets
    each gauge, once per scheduler step (the stats of every step are sent to
    the front end and applied there). :meth:`report` therefore sends a
    counter's increase since the last report (its whole value the first time,
    zero included, so that the series exists before its first event; a total
    that went down, as after a reset, restarts from zero), a gauge only when
    it changed, and the durations observed since.

    Parameters
    ----------
    limit
        Durations and unfinished jobs kept at most between reports (the
        oldest durations are dropped; stale jobs forgotten).
    metrics
        The metrics it reports (their kinds): :data:`METRICS` and the front's own.

    Notes
    -----
    :meth:`began` and :meth:`ended` may be called from two threads (the
    scheduler's and kvtier's loop thread) for different jobs: each call is
    one dictionary or deque operation, atomic under the GIL. :meth:`report`
    is called by one thread.
    """

    def __init__(self, limit: int = 1 << 16, metrics: Iterable[MetricSpec] = METRICS) -> None:
        self._kind = {spec.name: spec.kind for spec in metrics}
        self._last: Samples = {}
        self._started: dict[Hashable, float] = {}
        self._limit = limit
        self._durations: collections.deque[tuple[str, str, float]] = collections.deque(maxlen=limit)

    def began(self, job: Hashable) -> None:
        """A job starts now (``job``: any key its end will name)."""
        if len(self._started) >= self._limit:
            self._started.clear()  # jobs whose end never came (vLLM forgot them at a reset)
        self._started[job] = time.perf_counter()

    def ended(self, job: Hashable, metric: MetricSpec, tier: str) -> None:
        """``job`` ended: observe its duration in ``metric`` (a histogram) for ``tier``."""
        start = self._started.pop(job, None)
        if start is not None:
            self.observe(metric, tier, time.perf_counter() - start)

    def observe(self, metric: MetricSpec, tier: str, seconds: float) -> None:
        """A job of ``tier`` took ``seconds`` (timed elsewhere): observe it in ``metric``."""
        self._durations.append((metric.name, tier, seconds))

    def report(self, values: Samples, sink: StatsSink) -> None:
        """Send what changed in ``values`` since the last call, and the durations since."""
        last = self._last
        for key, value in values.items():
            before = last.get(key)
            if before == value:
                continue
            last[key] = value
            name, labels = key
            if self._kind[name] != "counter":
                sink.set_gauge(name, value, labels)
            elif before is None or value < before:
                # Zero too, the first time: the series exists before its first event.
                sink.increase_counter(name, value, labels)
            else:
                sink.increase_counter(name, value - before, labels)
        durations = self._durations
        while durations:
            name, tier, seconds = durations.popleft()
            sink.observe_histogram(name, seconds, (tier,))


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core  # the metric families of custom collectors
    except ImportError as exc:
        raise ConfigurationError(
            "kvtier's Prometheus exporter needs prometheus_client: pip install prometheus-client"
        ) from exc
    return prometheus_client


_ENGINE_METRICS = tuple(
    spec for spec in METRICS if "engine" in spec.fronts and spec.kind != "histogram"
)


class KVTierCollector:
    """A ``prometheus_client`` collector over one :class:`~kvtier.Engine`'s statistics.

    Register it in a registry (:func:`register_engine_metrics` does); each
    scrape reads :meth:`Engine.statistics() <kvtier.Engine.statistics>` once.

    Parameters
    ----------
    engine
        The engine to report.
    loop
        The event loop the engine runs on. A scrape from another thread (the
        HTTP server's) takes the snapshot on that loop, so that it never reads
        the tiers while the loop changes them; a scrape on the loop's own
        thread reads it at once. Defaults to the running loop when built in a
        coroutine, else none (every scrape then reads from its own thread).
    timeout
        Seconds a scrape from another thread waits for the loop.

    Raises
    ------
    ConfigurationError
        ``prometheus_client`` is not installed (``pip install prometheus-client``).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout: float = 10.0,
    ) -> None:
        _prometheus()
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        self._engine = engine
        self._loop = loop
        self._timeout = timeout
        self._row_bytes = engine.layout.bytes_per_chunk * engine.config.world_size

    def describe(self) -> list[Metric]:
        """The metrics this collector reports, without samples (read at registration)."""
        return self._families({})

    def collect(self) -> list[Metric]:
        """Every metric of the engine's tiers, now.

        Raises
        ------
        TimeoutError
            The engine's loop did not run the snapshot within ``timeout``.
        """
        return self._families(engine_samples(self._statistics(), self._row_bytes))

    def _statistics(self) -> FrontStatistics[EngineCounts]:
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return self._engine.statistics()
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return self._engine.statistics()

        async def snapshot() -> FrontStatistics[EngineCounts]:
            return self._engine.statistics()

        future = asyncio.run_coroutine_threadsafe(snapshot(), loop)
        try:
            return future.result(self._timeout)
        except TimeoutError:
            future.cancel()
            raise

    @staticmethod
    def _families(values: Samples) -> list[Metric]:
        core = _prometheus().core
        kinds = {"counter": core.CounterMetricFamily, "gauge": core.GaugeMetricFamily}
        families = {
            spec.name: kinds[spec.kind](spec.name, spec.documentation, labels=spec.labelnames)
            for spec in _ENGINE_METRICS
        }
        for (name, labels), value in values.items():
            families[name].add_metric(list(labels), value)
        return list(families.values())


def register_engine_metrics(
    engine: Engine,
    registry: CollectorRegistry | None = None,
    *,
    loop: asyncio.AbstractEventLoop | None = None,
) -> KVTierCollector:
    """Report ``engine``'s tiers in ``registry`` (``prometheus_client``'s default one if None).

    Call it from the engine's event loop, or pass ``loop`` (see
    :class:`KVTierCollector`). Remove it with ``registry.unregister(collector)``.

    Raises
    ------
    ConfigurationError
        ``prometheus_client`` is not installed (``pip install prometheus-client``).
    ValueError
        ``registry`` already reports these metric names.
    """
    collector = KVTierCollector(engine, loop=loop)
    target = _prometheus().REGISTRY if registry is None else registry
    target.register(collector)
    return collector


def serve_metrics(
    engine: Engine,
    port: int,
    *,
    addr: str = "127.0.0.1",
    loop: asyncio.AbstractEventLoop | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``engine``'s metrics, and only those, at ``http://addr:port/metrics``.

    The server runs in a daemon thread with a registry of its own; stop it
    with ``server.shutdown()`` then ``server.server_close()``. Port 0 picks a
    free port (``server.server_port``). Call it from the engine's event loop,
    or pass ``loop``.

    Raises
    ------
    ConfigurationError
        ``prometheus_client`` is not installed (``pip install prometheus-client``).
    OSError
        The address cannot be bound.
    """
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=True)
    register_engine_metrics(engine, registry, loop=loop)
    served = prom.start_http_server(port, addr, registry)
    return cast("tuple[WSGIServer, threading.Thread]", served)
