"""The scheduler side of kvtier's vLLM front: vLLM's manager calls onto kvtier's chain.

See :mod:`kvtier.integrations.vllm.spec` for how the two sides meet.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from kvtier.chain import (
    Answer,
    ChainStatistics,
    FrontCounts,
    FrontStatistics,
    LoopThread,
    ReadDone,
    Runtime,
    Settled,
    TierEvents,
    Written,
    chain_for,
)
from kvtier.config import KVTierConfig
from kvtier.errors import BusyError
from kvtier.integrations.vllm._common import RowsSpec, offload_key_to_kvtier
from kvtier.integrations.vllm.settings import VLLMSettings
from kvtier.integrations.vllm.statistics import VLLM_METRICS, VLLMCounts
from kvtier.layout import KVLayout
from kvtier.manager import BlockRemoved, ManagerEvent
from kvtier.metrics import (
    METRICS,
    READ_DURATION,
    WRITE_DURATION,
    DeltaReporter,
    Samples,
    as_json,
    front_samples,
)
from kvtier.region import CPURegion
from kvtier.tiers.base import Tier
from kvtier.tiers.factory import aclose_tiers, open_tiers

__all__ = [
    "CONFIG_INFO_KEYS",
    "MAX_PENDING_EVENT_KEYS",
    "KVTierOffloadingManager",
]

log = logging.getLogger("kvtier.integrations.vllm")

MAX_PENDING_EVENT_KEYS = 1 << 16
"""Keys of KV cache events kept for :meth:`KVTierOffloadingManager.take_events`.

vLLM takes them every scheduler step, which keeps the queue short; when nobody
takes them the oldest events are dropped (counted as ``events_dropped``)."""

_FILE_OWNER = "kvtier-file"

CONFIG_INFO_KEYS = (
    "kvtier_cpu_rows",
    "kvtier_row_bytes",
    "kvtier_tiers",
    "kvtier_lookup_deadline_s",
    "kvtier_file_io_engine",
    "kvtier_file_queue_depth",
    "kvtier_file_direct_io",
)
"""The labels of ``vllm:kv_offload_config_info`` that
:meth:`KVTierOffloadingManager.config_info` fills (vLLM 0.33)."""


class KVTierOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """The scheduler side: vLLM's calls translated onto kvtier's chain of tiers.

    Every method is called by vLLM's scheduler thread, is synchronous and does
    no I/O. Where every block is and what to do next is the
    :class:`~kvtier.chain.Chain`'s (the same decisions whatever the front);
    this class translates vLLM's keys and answers, carries the chain's intents
    to kvtier's loop thread (the runtime, :class:`~kvtier.chain.Runtime`, runs
    them on the tiers) and takes back what the runtime settled from the queue
    it drains at the start of every call. It never waits for I/O (except in
    :meth:`shutdown`).

    *Names.* vLLM's key of a block is kept (``kvtier key -> OffloadKey``) while
    the block is in the CPU tier, to report it as evicted, and, with events on,
    while it is in the file tier with its store announced, to announce its
    removal: blocks a file tier recovered at start-up have no name (kvtier
    stores its own hashed key) and are announced neither way.
    """

    def __init__(
        self,
        settings: VLLMSettings,
        layout: KVLayout,
        region: CPURegion,
        loop: LoopThread,
        tiers: list[Tier],
        *,
        enable_events: bool = False,
    ) -> None:
        """Use :meth:`open`."""
        self._settings = settings
        self._config: KVTierConfig = settings.config
        self._layout = layout
        self._ns = layout.namespace
        self._region = region
        self._loop = loop
        self._tiers = tiers
        specs = [spec for _name, spec in self._config.chain]
        self._tier_names = [spec.name for spec in specs]
        self._chain = chain_for(
            self._config,
            tiers,
            region.rows,
            lookup_deadline_s=settings.lookup_deadline_s,
            measure_recompute=True,  # a step's stores follow the compute that made them
            enable_events=enable_events,
        )
        # The file tier (the one tier of this instance's own) announces KV events.
        self._event_tier = self._tier_names.index("file") if "file" in self._tier_names else -1
        self._names: dict[bytes, OffloadKey] = {}
        self._events: collections.deque[OffloadingEvent] | None = (
            collections.deque() if enable_events else None
        )
        self._event_keys = 0
        self._announced_file: set[bytes] = set()
        self._closed = False
        self._counts = FrontCounts()
        """What this front counts as every front does, beside the chain (:meth:`statistics`)."""
        self._own = VLLMCounts()
        """What only this front counts (:meth:`statistics`' ``front``; the chain
        counts the lookups its deadlines and row limit answered)."""
        self._last_stats = ""
        self._refusal_logged = False
        # kvtier's metrics for vLLM (get_stats): totals turned into increases,
        # and how long each tier's jobs took.
        self._reporter = DeltaReporter(metrics=(*METRICS, *VLLM_METRICS))
        self._row_bytes = region.slice_bytes * region.world_size
        # Whether a figure may have changed since the last get_stats: most
        # steps (decoding) change none, and then cost no snapshot at all.
        self._changed = True
        # Intents go to kvtier's loop thread; outcomes come back through a queue
        # drained at the start of every call (vLLM's thread never waits). The
        # file tier's own events are taken there after each of its calls, and
        # come back in order with the outcomes.
        self._runtime = Runtime(
            self._chain,
            tiers,
            self._tier_names,
            region,
            loop.loop,
            queued=True,
            events_from=self._event_tier if enable_events and self._event_tier >= 0 else None,
        )
        self._runtime.start()  # what the tiers recovered; peers followed
        self._drain()

    @classmethod
    def open(
        cls,
        settings: VLLMSettings,
        layout: KVLayout,
        region: CPURegion,
        *,
        enable_events: bool = False,
    ) -> KVTierOffloadingManager:
        """Open the tiers below the CPU region (if configured) on a loop thread of their own.

        Parameters
        ----------
        settings, layout, region
            The adapter's settings, the row layout, the region mapped whole.
        enable_events
            Record KV cache events for :meth:`take_events` (vLLM's
            ``enable_kv_cache_events``).
        """
        config = settings.config
        loop: LoopThread | None = None
        tiers: list[Tier] = []
        try:
            loop = LoopThread("kvtier-vllm-scheduler")
            # The tiers run on the loop thread; a tier that fails to open closes
            # those opened before it.
            tiers = loop.run(open_tiers(config, layout, region, enable_events=enable_events))
            log.info("kvtier: namespace %s (%s)", layout.namespace.hex(), _meaning(layout))
            log.info(
                "kvtier: CPU tier of %d rows of %d bytes (cpu_bytes_to_use=%d)",
                region.rows,
                region.row_stride,
                int(config.cpu_bytes_to_use),
            )
            records = loop.run(_statistics(tiers))
            for (name, _spec), record in zip(config.chain, records, strict=True):
                log.info("kvtier: %s tier: %s", name, _describe(record))
            return cls(settings, layout, region, loop, tiers, enable_events=enable_events)
        except BaseException:
            # Whatever failed (a tier's open, a record, the constructor), release
            # what was opened: the tiers, the loop thread, and the region (its
            # /dev/shm file goes when no other process holds it).
            try:
                if loop is not None:
                    if tiers:  # all open; a record or the constructor failed
                        names = [name for name, _spec in config.chain]
                        with contextlib.suppress(Exception):  # each failure is logged
                            loop.run(aclose_tiers(tiers, names), timeout=60.0 * len(tiers))
                    loop.stop()
            finally:
                region.close()
            raise

    # -- vLLM's OffloadingManager -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain()
        k = self._key(key)
        self._changed = True
        # Per request: its wait is bounded and its prefix fits the CPU tier.
        answer = self._chain.lookup(k, req_context.req_id)
        if answer is Answer.RETRY:
            self._names[k] = key  # announced in the CPU tier once promoted
        elif answer is Answer.MISS:
            self._counts.lookup_misses += 1
        return _ANSWERS[answer]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> RowsSpec:
        self._drain()
        ks = [self._key(k) for k in keys]
        slots = self._chain.pin_for_device_load(ks)
        self._reporter.began((False, frozenset(ks)))
        self._changed = True
        self._counts.loads += 1
        return RowsSpec(list(slots))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._chain.touch([self._key(x) for x in keys])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ks = [self._key(k) for k in keys]
        self._chain.unpin_device_load(ks)
        self._reporter.ended((False, frozenset(ks)), READ_DURATION, "cpu")
        self._changed = True
        self._drain()

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._drain()
        self._changed = True
        holds = self._chain.holds
        todo: dict[bytes, OffloadKey] = {}
        for key in keys:
            k = self._key(key)
            if not holds(k):
                todo[k] = key
        if not todo:
            return PrepareStoreOutput(keys_to_store=[], store_spec=RowsSpec([]), evicted_keys=[])
        plan = self._chain.place(list(todo))
        if plan is None:  # every row pinned or being written
            # vLLM keeps these blocks and asks again at its next step.
            self._refused(len(todo), 0)
            return None
        if len(plan.keys) < len(todo):
            # The leading blocks (a prefix: what a later request can hit) are
            # stored; vLLM does not offer this request's others again.
            self._refused(len(todo) - len(plan.keys), len(todo))
        self._counts.stores += 1
        self._reporter.began((True, frozenset(plan.keys)))
        for k in plan.keys:
            self._names[k] = todo[k]
        self._pull_cpu_events()  # the evictions' names are needed, then forgotten
        evicted = [self._names[k] for k in plan.evicted if k in self._names]
        self._forget(plan.evicted)
        return PrepareStoreOutput(
            keys_to_store=[todo[k] for k in plan.keys],
            store_spec=RowsSpec(list(plan.slots)),
            evicted_keys=evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        ks = [self._key(k) for k in keys]
        self._changed = True
        self._chain.stored(ks, success)
        if success:
            self._reporter.ended((True, frozenset(ks)), WRITE_DURATION, "cpu")
        else:
            self._forget(ks)
        self._dispatch()  # write-through starts now, not at the end of the step
        self._drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._chain.forget_request(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._drain()
        self._dispatch()
        self._write_statistics()

    def has_pending_work(self) -> bool:
        # Lookups waiting on a read or probe, and tier writes in flight: vLLM
        # keeps stepping until they end, so their outcomes (rows unpinned,
        # statistics and metrics) are taken in, as vLLM's own tiers do.
        self._drain()
        return self._chain.busy

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The KV cache events since the last call, oldest first (see the module's Notes).

        Empty unless vLLM enabled KV cache events. A key is announced removed
        from a medium only after it was announced stored there.
        """
        self._drain()
        if not self._events:
            return []
        out = list(self._events)
        self._events.clear()
        self._event_keys = 0
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        """kvtier's metrics since the last call, for vLLM's /metrics (see :mod:`kvtier.metrics`).

        vLLM's scheduler calls it at every step and sends what it returns to
        its front-end process, which adds each counter's value to its
        Prometheus counter, sets each gauge and observes each duration: so
        counters are reported as their increase since the last call, gauges
        when they changed, and None when nothing did.
        """
        self._drain()
        if not self._changed:
            return None
        self._changed = False
        stats = OffloadingConnectorStats()
        self._reporter.report(self._metrics(self.statistics()), stats)
        return None if stats.is_empty() else stats

    def reset_cache(self) -> None:
        self._drain()
        self._changed = True
        try:
            self._chain.reset()
        except BusyError:
            log.warning("reset_cache: blocks are being loaded or stored; nothing was reset")
            return
        self._pull_cpu_events()
        self._forget(list(self._names))

    def shutdown(self) -> None:
        """Wait for tier writes in flight (30 s at most), close the tiers and the region."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 30.0
        self._drain()
        self._dispatch()
        while self._chain.busy and time.monotonic() < deadline:
            time.sleep(0.01)
            self._drain()
            self._dispatch()
        self._write_statistics(force=True)
        self._runtime.cancel_seeding()
        try:
            # One bound for them all: a hung tier's close must not hold vLLM's exit.
            self._loop.run(aclose_tiers(self._tiers, self._tier_names), timeout=60.0)
        except Exception:
            log.exception("closing kvtier's tiers failed")
        finally:
            self._loop.stop()
            self._region.close()

    # -- kvtier's side ------------------------------------------------------------------

    def config_info(self) -> list[dict[str, str | int | float | bool]]:
        """Static facts of this instance for ``vllm:kv_offload_config_info`` (vLLM 0.33).

        One series, labelled by :data:`CONFIG_INFO_KEYS`: the CPU tier's rows
        and their size, the chain, the lookup deadline, and the file tier's
        I/O engine, queue depth and O_DIRECT as chosen at open (empty
        without a file tier).
        """
        info: dict[str, str | int | float | bool] = {
            "kvtier_cpu_rows": self._chain.capacity,
            "kvtier_row_bytes": self._region.row_stride,
            "kvtier_tiers": ",".join(["cpu", *self._tier_names]),
            "kvtier_lookup_deadline_s": self._settings.lookup_deadline_s,
        }
        if "file" in self._tier_names:
            st = asdict(self._runtime.tier_statistics()[self._tier_names.index("file")])
            info.update(
                kvtier_file_io_engine=st["io_engine"],
                kvtier_file_queue_depth=st["queue_depth"],
                kvtier_file_direct_io=st["direct_io"],
            )
        return [info]

    def statistics(self) -> FrontStatistics[VLLMCounts]:
        """Every tier (the chain's counts, their bytes and busy time, the tier's own
        record), the counters of every front, and this front's own in ``front``
        (:class:`~kvtier.integrations.vllm.statistics.VLLMCounts`).

        The ``statistics_file`` holds it as JSON (:func:`dataclasses.asdict`),
        with the totals of kvtier's Prometheus metrics under ``metrics`` (metric
        name, then label values joined by commas: see :func:`kvtier.metrics.as_json`).
        """
        own = self._own

        def front(chain: ChainStatistics) -> VLLMCounts:
            return replace(
                own,
                lookup_deadline_misses=chain.lookup_deadline_misses,
                lookup_row_limit_misses=chain.lookup_row_limit_misses,
            )

        return self._runtime.statistics(self._counts, front)

    def statistics_json(self) -> dict[str, Any]:
        """What the ``statistics_file`` holds: :meth:`statistics` as
        :func:`dataclasses.asdict` gives it, and the totals of kvtier's metrics
        under ``metrics`` (``{"kvtier_lookup_hits_total": {"cpu": 12, ...}}``)."""
        st = self.statistics()
        return {**asdict(st), "metrics": as_json(self._metrics(st))}

    def _metrics(self, st: FrontStatistics[VLLMCounts]) -> Samples:
        """Every metric of this front in ``st``, as totals (docs/operations.md, "Metrics")."""
        return front_samples(st, self._row_bytes, VLLM_METRICS)

    def _key(self, key: OffloadKey) -> bytes:
        return offload_key_to_kvtier(bytes(key), self._ns)

    def _refused(self, count: int, offered: int) -> None:
        """Log the first refusal with the sizing rule (the chain counts them)."""
        if self._refusal_logged:
            return
        self._refusal_logged = True
        log.warning(
            "kvtier's CPU tier (%d rows of %d bytes, cpu_bytes_to_use=%d) could not take "
            "%d of the %d blocks one scheduler step offered%s. Give it at least twice the "
            "rows one step stores (max_num_batched_tokens / (block_size x "
            "blocks_per_chunk)): rows held by tier writes in flight are not reusable "
            "until the write ends. See docs/vllm.md, 'Sizing the CPU tier'. Logged once; "
            "refusals are counted as store_refusals",
            self._chain.capacity,
            self._region.row_stride,
            int(self._config.cpu_bytes_to_use),
            count,
            offered or count,
            "" if not offered else " (the leading ones were stored)",
        )

    def _forget(self, keys: Iterable[bytes]) -> None:
        """Drop the names of blocks that no tier holds under a name any more."""
        chain = self._chain
        for k in keys:
            if k not in chain and k not in self._announced_file and not chain.is_waiting(k):
                self._names.pop(k, None)

    def _publish(self, keys: list[bytes], medium: Medium, removed: bool) -> None:
        """Queue one event for the named ``keys`` (a bounded queue: see the module)."""
        events = self._events
        if events is None:
            return
        file = medium is Medium.STORAGE
        if file and removed:
            keys = [k for k in keys if k in self._announced_file]
            self._announced_file.difference_update(keys)
        names = [self._names[k] for k in keys if k in self._names]
        if file and not removed:
            self._announced_file.update(k for k in keys if k in self._names)
        if not names:
            return
        events.append(
            OffloadingEvent(
                keys=names,
                medium=medium,
                removed=removed,
                locality=Locality.LOCAL if file else None,
                ownership=_FILE_OWNER if file else None,
                # The file tier announces its removals itself.
                removal_expected=file and not removed,
            )
        )
        self._own.events_published += len(names)
        self._event_keys += len(names)
        while self._event_keys > MAX_PENDING_EVENT_KEYS and len(events) > 1:
            old = events.popleft()
            self._event_keys -= len(old.keys)
            if not self._own.events_dropped:
                log.warning(
                    "kvtier's KV cache events are not being taken: dropping the oldest "
                    "(more than %d keys queued)",
                    MAX_PENDING_EVENT_KEYS,
                )
            self._own.events_dropped += len(old.keys)

    def _translate(self, events: Iterable[ManagerEvent], medium: Medium) -> None:
        for ev in events:
            removed = isinstance(ev, BlockRemoved)
            self._publish(list(ev.keys), medium, removed)
            if removed:
                self._forget(ev.keys)

    def _pull_cpu_events(self) -> None:
        if self._events is not None:
            self._translate(self._chain.take_cpu_events(), Medium.CPU)

    def _dispatch(self) -> None:
        """Hand the chain's intents to the loop thread (one wake-up for all of them)."""
        self._runtime.dispatch()

    def _drain(self) -> None:
        """Apply what the runtime settled, in order: outcomes, the file tier's events."""
        arrived = self._runtime.drain()
        if arrived:
            self._changed = True
        for item in arrived:
            if isinstance(item, TierEvents):
                self._translate(item.events, Medium.STORAGE)
            else:
                self._settled(item)
        self._pull_cpu_events()

    def _settled(self, done: Settled) -> None:
        outcome = done.outcome
        if done.seconds is not None and isinstance(outcome, Written | ReadDone):
            metric = WRITE_DURATION if isinstance(outcome, Written) else READ_DURATION
            self._reporter.observe(metric, self._tier_names[outcome.intent.tier], done.seconds)
        if isinstance(outcome, ReadDone):
            self._forget([k for k in outcome.intent.keys if k not in outcome.loaded])

    def _write_statistics(self, force: bool = False) -> None:
        path = self._settings.statistics_file
        if path is None:
            return
        text = json.dumps(self.statistics_json(), default=str, sort_keys=True)
        if text == self._last_stats and not force:
            return
        self._last_stats = text
        self._loop.soon(_write_atomic, str(path), text)


_ANSWERS = {
    Answer.HIT: LookupResult.HIT,
    Answer.PENDING: LookupResult.HIT_PENDING,
    Answer.RETRY: LookupResult.RETRY,
    Answer.MISS: LookupResult.MISS,
}


def _meaning(layout: KVLayout) -> str:
    """What the start-up log says of the namespace: what the bytes mean, field by field."""
    encoding = layout.encoding.describe() if layout.encoding is not None else {}
    return ", ".join(f"{k} {v}" for k, v in encoding.items() if v is not None) or "no encoding"


def _describe(statistics: Any) -> str:
    """One line on an open tier for the start-up log: what its record says of its set-up."""
    record = asdict(statistics)
    shown = ("io_engine", "queue_depth", "direct_io", "capacity_bytes", "recovered_blocks")
    return ", ".join(f"{k} {record[k]}" for k in shown if k in record) or "open"


async def _statistics(tiers: Sequence[Tier]) -> list[Any]:
    return [tier.statistics() for tier in tiers]


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write kvtier statistics to %s: %s", path, exc)
