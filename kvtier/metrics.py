"""kvtier's tiers as Prometheus metrics: one catalogue, two fronts.

The same names, labels and meanings reach Prometheus from either front, so one
dashboard serves both (docs/operations.md, "Metrics", lists them all):

* **inside vLLM**, :class:`~kvtier.integrations.vllm.spec.KVTierOffloadingSpec`
  declares :data:`METRICS` through vLLM's ``build_metric_definitions`` and its
  manager reports them from ``get_stats`` (a :class:`DeltaReporter` turns its
  totals into what vLLM's stats object takes); vLLM publishes them on its own
  ``/metrics``, with its ``model_name`` and ``engine`` labels added;
* **beside an** :class:`~kvtier.Engine`, :class:`KVTierCollector` reads
  :meth:`Engine.statistics() <kvtier.Engine.statistics>` at each scrape
  (``prometheus_client``, the optional ``kvtier[metrics]`` extra)::

      from kvtier.metrics import serve_metrics

      server, _thread = serve_metrics(engine, 9400)  # GET :9400/metrics

A tier of the chain is a value of the ``tier`` label (``cpu``, ``file``,
``cluster``), never a metric of its own. Every figure of one tier is a field of
:class:`TierMetrics` and its metric is ``kvtier_`` + the field's name, so the
``metrics`` section of the vLLM front's ``statistics_file`` (JSON) carries the
same names. Counters end in ``_total``; sizes are bytes and times seconds.
Each :class:`MetricSpec` says which fronts report it (``fronts``).

``prometheus_client`` is imported only by :class:`KVTierCollector` and the
functions built on it: ``import kvtier`` never needs it, nor does the vLLM
front (vLLM owns the registry there).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

from kvtier.errors import ConfigurationError
from kvtier.manager import ManagerStatistics
from kvtier.tiers.base import HasMetrics, TierStatistics

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from kvtier.chain import FrontStatistics, TierReport
    from kvtier.engine import Engine

__all__ = [
    "DEADLINE_MISSES",
    "EVENTS_DROPPED",
    "EVENTS_PUBLISHED",
    "LOADS_DECLINED",
    "LOAD_SHORTFALLS",
    "LOOKUPS",
    "METRICS",
    "READ_DURATION",
    "RECOVERY_STATES",
    "ROW_LIMIT_MISSES",
    "TIER_METRICS",
    "WRITE_DURATION",
    "DeltaReporter",
    "KVTierCollector",
    "MetricSpec",
    "Samples",
    "StatsSink",
    "TierMetrics",
    "as_json",
    "engine_samples",
    "engine_tiers",
    "register_engine_metrics",
    "samples",
    "serve_metrics",
    "tier_metrics",
]

RECOVERY_STATES = ("running", "complete", "failed")
"""Values of the ``state`` label of ``kvtier_recovery_state``."""

Kind = Literal["counter", "gauge", "histogram"]
Front = Literal["engine", "vllm"]

Samples = dict[tuple[str, tuple[str, ...]], float]
"""(metric name, label values: ``tier`` first where it has one) -> value."""

_BOTH: tuple[Front, ...] = ("engine", "vllm")


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
    """The fronts that report it: ``engine`` (:class:`KVTierCollector`), ``vllm``."""


@dataclass(frozen=True, slots=True)
class TierMetrics:
    """One tier's figures, each the value of the metric ``kvtier_<field>{tier=...}``.

    None where this tier, or the front reporting it, has no such figure: no
    sample is reported then (not a zero). Counters count since the tier (or
    the front) was opened.
    """

    lookup_hits_total: int | None = None
    """Looked-up keys this tier served (the CPU tier: ready in a row; a lower
    tier: read into a row for the lookup): over ``kvtier_lookups_total``, the
    share of lookups each tier serves."""
    read_blocks_total: int | None = None
    """Blocks read out of this tier: CPU rows copied to the device (loads); a
    lower tier's blocks read into CPU rows (promotions)."""
    read_bytes_total: int | None = None
    """Payload bytes of ``read_blocks_total``."""
    written_blocks_total: int | None = None
    """Blocks written into this tier: device blocks copied into CPU rows
    (stores); CPU rows written to a lower tier (write-through, write-back)."""
    written_bytes_total: int | None = None
    """Payload bytes of ``written_blocks_total``."""
    read_busy_seconds_total: float | None = None
    """Time during which at least one read of this tier ran (overlapping reads
    count once): ``rate(read_bytes) / rate(read_busy_seconds)`` is the
    throughput while busy. Engine front."""
    write_busy_seconds_total: float | None = None
    """The same for writes. Engine front."""
    promotions_total: int | None = None
    """Blocks of this lower tier promoted into the CPU tier (read and verified)."""
    promotion_failures_total: int | None = None
    """Blocks a read from this lower tier did not deliver (absent, vanished,
    failed verification, I/O error): each is a miss, recomputed."""
    store_refusals_total: int | None = None
    """Blocks offered to the CPU tier that it had no row for: every row
    pinned by loads or held by writes in flight."""
    write_failures_total: int | None = None
    """Blocks whose write into this lower tier failed or could not start (I/O
    error, no room, the tier still recovering)."""
    integrity_failures_total: int | None = None
    """Blocks read from this tier and refused by verification (checksum,
    truncated, another namespace or key)."""
    quarantined_blocks_total: int | None = None
    """File tier: slots quarantined, failing verification or of another
    namespace (found at open); never used for data again."""
    evictions_total: int | None = None
    """Blocks evicted from this tier to make room."""
    vanished_blocks_total: int | None = None
    """Cluster tier: blocks it was known to hold that were gone when read
    (evicted by the server, removed by a peer). File tier: blocks of other
    instances' partitions rewritten or evicted by their owner while read."""
    peer_blocks: int | None = None
    """File tier: blocks the other instances sharing its root hold, readable here."""
    resident_blocks: int | None = None
    """Blocks held now (ready or being written; the cluster tier: those this
    instance knows to be there)."""
    pinned_blocks: int | None = None
    """CPU tier: blocks held by loads or writes in flight (not evictable)."""
    used_bytes: int | None = None
    """Bytes of this tier holding blocks (CPU: rows x their payload; file: slots)."""
    capacity_bytes: int | None = None
    """Bytes this tier has for blocks (CPU: its rows' payload; file: the slots of
    ``blocks.dat``): ``used_bytes / capacity_bytes`` is its usage."""
    recovery_blocks: int | None = None
    """File tier: blocks found valid when it opened (what survived a restart)."""
    recovery_torn_slots: int | None = None
    """File tier: slots found torn when it opened (writes a crash interrupted)."""
    recovery_seconds: float | None = None
    """File tier: how long the scan of ``blocks.dat`` took at open."""
    recovery_state: str | None = None
    """File tier: ``running``, ``complete`` or ``failed``; the gauge
    ``kvtier_recovery_state{state=...}`` is 1 for it and 0 for the others."""
    node_outages_total: int | None = None
    """Cluster tier: times a node stopped answering (at open, or while serving);
    its keys are misses until a background probe finds it again."""
    nodes_down: int | None = None
    """Cluster tier: nodes not answering now."""
    peer_hits_total: int | None = None
    """Host tier: verified loads of blocks other instances on the host stored
    (from their rows)."""
    stale_peer_reads_total: int | None = None
    """Host tier: loads of another instance's row that found it reused, being
    written or failing its checksum while read: a miss, never wrong bytes."""
    leases_outstanding: int | None = None
    """Host tier: leases on rows held now by live readers (this instance's rows
    cannot be reused under them)."""
    rows_held: int | None = None
    """Host tier: rows of the host segment this instance owns."""

    def as_dict(self) -> dict[str, int | float | str]:
        """The figures this tier has, by field name (the ``statistics_file`` section)."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}


# One line of `# HELP` per field (the docstrings above say more).
_HELP = {
    "lookup_hits_total": "Looked-up keys this tier served.",
    "read_blocks_total": "Blocks read out of this tier (CPU: loads to the device; "
    "lower tiers: promotions into CPU rows).",
    "read_bytes_total": "Payload bytes read out of this tier.",
    "written_blocks_total": "Blocks written into this tier (CPU: stores from the device; "
    "lower tiers: writes of CPU rows).",
    "written_bytes_total": "Payload bytes written into this tier.",
    "read_busy_seconds_total": "Seconds during which at least one read of this tier ran.",
    "write_busy_seconds_total": "Seconds during which at least one write into this tier ran.",
    "promotions_total": "Blocks of this tier promoted into the CPU tier.",
    "promotion_failures_total": "Blocks a read from this tier did not deliver.",
    "store_refusals_total": "Blocks offered to this tier that it had no room for.",
    "write_failures_total": "Blocks whose write into this tier failed or could not start.",
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
    "peer_hits_total": "Host tier: verified loads of blocks other instances on the host stored.",
    "stale_peer_reads_total": "Host tier: reads of another instance's row that found it reused.",
    "leases_outstanding": "Host tier: leases live readers hold on rows now.",
    "rows_held": "Host tier: rows of the host segment this instance owns.",
}

_ENGINE_ONLY = {"read_busy_seconds_total", "write_busy_seconds_total"}


def _tier_spec(name: str) -> MetricSpec:
    return MetricSpec(
        "kvtier_" + name,
        "counter" if name.endswith("_total") else "gauge",
        _HELP[name],
        ("tier", "state") if name == "recovery_state" else ("tier",),
        fronts=("engine",) if name in _ENGINE_ONLY else _BOTH,
    )


TIER_METRICS: tuple[MetricSpec, ...] = tuple(_tier_spec(f.name) for f in fields(TierMetrics))
"""One metric per :class:`TierMetrics` field, in field order, labelled by ``tier``."""

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

LOOKUPS = MetricSpec(
    "kvtier_lookups_total", "counter", "Keys looked up (every tier's hits count against it).", ()
)
READ_DURATION = MetricSpec(
    "kvtier_read_duration_seconds",
    "histogram",
    "Seconds one read job of this tier took (CPU tier: from the scheduler step that "
    "started the load to the one that saw it done).",
    buckets=_DURATION_BUCKETS,
    fronts=("vllm",),
)
WRITE_DURATION = MetricSpec(
    "kvtier_write_duration_seconds",
    "histogram",
    "Seconds one write job into this tier took (CPU tier: from the scheduler step that "
    "started the store to the one that saw it done).",
    buckets=_DURATION_BUCKETS,
    fronts=("vllm",),
)
DEADLINE_MISSES = MetricSpec(
    "kvtier_lookup_deadline_misses_total",
    "counter",
    "Lookups answered as misses because a lower tier's read, or the request's wait, "
    "outlasted lookup_deadline_s.",
    (),
    fronts=("vllm",),
)
LOADS_DECLINED = MetricSpec(
    "kvtier_loads_declined_total",
    "counter",
    "Lookups answered as misses because reading the block from a lower tier would have "
    "ended after recomputing it (decline_slow_loads).",
    (),
    fronts=("vllm",),
)
ROW_LIMIT_MISSES = MetricSpec(
    "kvtier_lookup_row_limit_misses_total",
    "counter",
    "Lookups answered as misses because the request's prefix before them already needed "
    "every CPU row (loaded in part, the rest recomputed).",
    (),
    fronts=("vllm",),
)
EVENTS_PUBLISHED = MetricSpec(
    "kvtier_events_published_total",
    "counter",
    "Keys announced in KV cache events.",
    (),
    fronts=("vllm",),
)
EVENTS_DROPPED = MetricSpec(
    "kvtier_events_dropped_total",
    "counter",
    "Keys of KV cache events dropped because nobody took them.",
    (),
    fronts=("vllm",),
)
LOAD_SHORTFALLS = MetricSpec(
    "kvtier_load_shortfalls_total",
    "counter",
    "Blocks a load had promised but could not deliver.",
    (),
    fronts=("engine",),
)

METRICS: tuple[MetricSpec, ...] = (
    LOOKUPS,
    *TIER_METRICS,
    READ_DURATION,
    WRITE_DURATION,
    DEADLINE_MISSES,
    ROW_LIMIT_MISSES,
    LOADS_DECLINED,
    EVENTS_PUBLISHED,
    EVENTS_DROPPED,
    LOAD_SHORTFALLS,
)
"""Every metric kvtier reports; each front reports those naming it in ``fronts``."""

_KIND = {spec.name: spec.kind for spec in METRICS}


def tier_metrics(
    report: TierReport[Any], *, row_bytes: int, store_refusals: int | None = None
) -> TierMetrics:
    """One tier's figures, from its :class:`~kvtier.chain.TierReport`.

    Parameters
    ----------
    report
        The tier in a front's statistics (``statistics().tiers[name]``): its
        own record and what the chain counted for it.
    row_bytes
        Payload bytes of one CPU row (the CPU tier's block).
    store_refusals
        The CPU tier's refused blocks, as the front reports them.

    Notes
    -----
    A lower tier's blocks and bytes read and written are its own counts, the
    same under every front; the CPU tier's are the chain's (the residency
    manager moves no bytes). Busy seconds are left to the front
    (:func:`engine_tiers`).
    """
    own: ManagerStatistics | TierStatistics = report.statistics
    # One constructor call per tier (no dataclasses.replace): the vLLM front
    # builds these at every scheduler step that changed a figure.
    if isinstance(own, ManagerStatistics):
        return TierMetrics(
            lookup_hits_total=report.lookup_hits,
            read_blocks_total=report.blocks_out,
            read_bytes_total=report.blocks_out * row_bytes,
            written_blocks_total=report.blocks_in,
            written_bytes_total=report.blocks_in * row_bytes,
            store_refusals_total=store_refusals,
            evictions_total=own.evictions,
            resident_blocks=own.used,
            pinned_blocks=own.pinned,
            used_bytes=own.used * row_bytes,
            capacity_bytes=own.capacity * row_bytes,
        )
    figures: dict[str, Any] = {
        "lookup_hits_total": report.lookup_hits,
        "read_blocks_total": own.hits,
        "read_bytes_total": own.bytes_read,
        "written_blocks_total": own.stores,
        "written_bytes_total": own.bytes_written,
        "promotions_total": report.blocks_out,
        "promotion_failures_total": report.read_failures,
        "write_failures_total": report.write_failures,
        "resident_blocks": own.blocks,
    }
    if isinstance(own, HasMetrics):
        # What only this kind of tier measures, by the names of TierMetrics:
        # each tier's record says it itself.
        figures.update(own.metric_figures())
    return TierMetrics(**figures)


def engine_tiers(stats: FrontStatistics, row_bytes: int) -> dict[str, TierMetrics]:
    """Each tier of an engine's chain (CPU first) and its figures, busy seconds included.

    Parameters
    ----------
    stats
        :meth:`Engine.statistics() <kvtier.Engine.statistics>`.
    row_bytes
        Payload bytes of one CPU row (``layout.bytes_per_chunk * world_size``).
    """
    out: dict[str, TierMetrics] = {}
    for name, report in stats.tiers.items():
        refusals = stats.dropped if name == "cpu" else None
        out[name] = replace(
            tier_metrics(report, row_bytes=row_bytes, store_refusals=refusals),
            read_busy_seconds_total=report.seconds_out,
            write_busy_seconds_total=report.seconds_in,
        )
    return out


_TIER_FIELDS = tuple(
    (spec.name, f.name) for spec, f in zip(TIER_METRICS, fields(TierMetrics), strict=True)
)


def samples(tiers: Mapping[str, TierMetrics], extra: Samples | None = None) -> Samples:
    """Every figure of ``tiers`` (tier name -> its figures) as samples, after ``extra``.

    Fields that are None give no sample; ``recovery_state`` gives one sample per
    state in :data:`RECOVERY_STATES`. ``extra`` holds the metrics without a
    ``tier`` label (``kvtier_lookups_total``...).
    """
    out: Samples = dict(extra) if extra else {}
    for tier, figures in tiers.items():
        label = (tier,)
        for name, field in _TIER_FIELDS:
            value = getattr(figures, field)
            if value is None:
                continue
            if isinstance(value, str):
                for state in RECOVERY_STATES:
                    out[(name, (tier, state))] = float(state == value)
            else:
                out[(name, label)] = value
    return out


def as_json(values: Samples) -> dict[str, dict[str, float]]:
    """``values`` for a JSON file, by metric name then label values joined by commas.

    ``{"kvtier_lookup_hits_total": {"cpu": 12}, "kvtier_lookups_total": {"": 20}}``.
    """
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in values.items():
        out.setdefault(name, {})[",".join(labels)] = value
    return out


def engine_samples(stats: FrontStatistics, row_bytes: int) -> Samples:
    """Every metric of the Engine front, from one statistics snapshot."""
    return samples(
        engine_tiers(stats, row_bytes),
        {
            (LOOKUPS.name, ()): stats.lookups,
            (LOAD_SHORTFALLS.name, ()): stats.load_shortfalls,
        },
    )


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

    Notes
    -----
    :meth:`began` and :meth:`ended` may be called from two threads (the
    scheduler's and kvtier's loop thread) for different jobs: each call is
    one dictionary or deque operation, atomic under the GIL. :meth:`report`
    is called by one thread.
    """

    def __init__(self, limit: int = 1 << 16) -> None:
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
            if _KIND[name] != "counter":
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

    def _statistics(self) -> FrontStatistics:
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            return self._engine.statistics()
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            return self._engine.statistics()

        async def snapshot() -> FrontStatistics:
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
