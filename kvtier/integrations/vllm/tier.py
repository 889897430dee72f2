"""kvtier as a secondary tier of vLLM 0.33's tiered offloading (below vLLM's CPU tier).

vLLM 0.33's ``TieringOffloadingSpec`` keeps vLLM's own CPU tier (the
*primary*) and loads storage tiers below it by module path::

    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{
            "type": "KVTierSecondaryTier",
            "module_path": "kvtier.integrations.vllm.tier",
            "file_tier": {"root": "/mnt/nvme/kvtier", "bytes_to_use": "500GiB"},
        }],
    }

:class:`KVTierSecondaryTier` is a thin adapter over kvtier's lower front
(:class:`~kvtier.below.LowerFront`): vLLM's primary slots are the rows kvtier
reads into and writes from (each slot page-aligned, its length a multiple of
4096: straight to disk with O_DIRECT), and kvtier's chain decides as for
every front (verified reads, fall-through, deadlines, the load decision).
vLLM calls it on its scheduler thread under its manager's lock; nothing here
waits for I/O (but :meth:`KVTierSecondaryTier.drain_jobs` and
:meth:`KVTierSecondaryTier.shutdown`) and nothing raises into vLLM after the
constructor: a failed block is a miss or a failed key of its job.
See docs/vllm.md, "Below vLLM 0.33's CPU tier".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (  # type: ignore[import-not-found]
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.below import LOWER_KEYS, JobDone, LowerFront, parse_lower_settings
from kvtier.chain import Answer
from kvtier.errors import ConfigurationError
from kvtier.integrations.vllm._common import kv_encoding, model_digest, offload_key_to_kvtier
from kvtier.layout import KVLayout, TensorSpec
from kvtier.metrics import (
    LOWER_METRICS,
    METRICS,
    READ_DURATION,
    WRITE_DURATION,
    DeltaReporter,
    MetricSpec,
    front_samples,
)
from kvtier.region import ForeignRows

__all__ = ["TIER_KEYS", "KVTierSecondaryTier"]

log = logging.getLogger("kvtier.integrations.vllm")

TIER_KEYS = LOWER_KEYS | {"model_revision"}
"""kvtier's keys in its ``secondary_tiers`` entry (beside vLLM's ``type`` and
``module_path``): the lower front's (:data:`~kvtier.below.LOWER_KEYS`) and
``model_revision``."""

_VLLM_KEYS = frozenset({"locality"})
"""Keys vLLM reads from a tier's entry and passes on to it: accepted, not used."""

_WHERE = "secondary_tiers (KVTierSecondaryTier)"

_CONFIG_INFO_KEYS = ("kvtier_tiers", "kvtier_slot_bytes", "kvtier_lookup_deadline_s")

_ANSWERS = {Answer.HIT: LookupResult.HIT, Answer.RETRY: LookupResult.RETRY}


def _metrics() -> tuple[MetricSpec, ...]:
    return tuple(spec for spec in (*METRICS, *LOWER_METRICS) if "lower" in spec.fronts)


class KVTierSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """kvtier's lower tiers (host, file, cluster) as one secondary tier of vLLM 0.33.

    Parameters
    ----------
    offloading_spec, primary_kv_view, tier_type, backpressure_detector
        What vLLM's factory passes every secondary tier.
    locality
        vLLM passes it on from the entry; not used.
    **kvtier_keys
        kvtier's keys (:data:`TIER_KEYS`): ``file_tier``, ``host_tier``,
        ``cluster_tier`` (tables as in kvtier's configuration), ``lookup_deadline_s``,
        ``decline_slow_loads``, ``recompute_s_per_block``, ``model_revision``.

    Raises
    ------
    ConfigurationError
        A bad key or value (named), no tier, or a primary view kvtier cannot
        read into directly (not page-aligned).
    KVTierError
        A tier failed to open.
    """

    medium: ClassVar[Any] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        locality: Any = None,
        **kvtier_keys: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        table = dict(kvtier_keys)
        revision = table.pop("model_revision", None)
        if revision is not None and (not isinstance(revision, str) or not revision.strip()):
            raise ConfigurationError(
                f"{_WHERE}: model_revision must be a non-empty string, got {revision!r}",
                (("model_revision", "not a non-empty string"),),
            )
        settings = parse_lower_settings(
            table, where=_WHERE, buffer_bytes=primary_kv_view.nbytes, ignore=_VLLM_KEYS
        )
        stride = self.block_size_bytes
        try:
            rows = ForeignRows(primary_kv_view, stride)
        except ValueError as exc:
            raise ConfigurationError(
                f"{_WHERE}: vLLM's primary CPU tier cannot be read into directly: {exc}"
            ) from exc
        self._layout = _layout(offloading_spec, stride, revision)
        self._ns = self._layout.namespace
        self._settings = settings
        try:
            self._front = LowerFront.open(
                settings, self._layout, rows, name=f"kvtier-vllm-{tier_type}"
            )
        except BaseException:
            rows.release()
            raise
        self._reporter = DeltaReporter(metrics=_metrics())
        self._names: dict[int, tuple[list[OffloadKey], list[bytes]]] = {}
        """Each job in flight: vLLM's keys and kvtier's (a partial load names its successes)."""
        self._failures_logged: set[str] = set()
        self._closed = False

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when one of kvtier's tiers holds the block and reading it beats
        recomputing it; RETRY while the cluster tier is asked; else MISS."""
        try:
            answer = self._front.lookup(self._key(key), req_context.req_id)
        except Exception as exc:
            self._failed("lookup", exc)
            return LookupResult.MISS
        return _ANSWERS.get(answer, LookupResult.MISS)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Nothing: kvtier's tiers keep their own recency, from their reads."""

    # -- jobs ------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the job's primary slots to kvtier's tiers (those that lack them)."""
        self._submit(job_metadata, load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Read the job's blocks into its primary slots, verified."""
        self._submit(job_metadata, load=True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job that ended since the last call; no I/O touches their slots any more."""
        try:
            ended = self._front.finished()
        except Exception as exc:  # pragma: no cover - the front does not raise here
            self._failed("finished", exc)
            return []
        return [self._result(done) for done in ended]

    def has_pending_work(self) -> bool:
        """Jobs, or lookups waiting on the cluster tier, are in flight."""
        try:
            return self._front.busy
        except Exception as exc:  # pragma: no cover
            self._failed("busy", exc)
            return False

    def drain_jobs(self) -> None:
        """Block until every job has ended (their results wait for :meth:`get_finished_jobs`)."""
        self._front.drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """None: kvtier's tiers do not announce KV events below vLLM 0.33 yet."""
        return ()

    # -- requests ------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """No preference of kvtier's for how the request's blocks are offloaded."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The request looks nothing up any more."""
        self._front.forget_request(req_context.req_id)

    # -- statistics, info, shutdown --------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvtier's metrics (:mod:`kvtier.metrics`, those of the lower front), in vLLM's terms."""
        from kvtier.integrations.vllm.spec import metric_metadata

        return {spec.name: metric_metadata(spec) for spec in _metrics()}

    def get_stats(self) -> Any:
        """kvtier's metrics since the last call: counters as increases, gauges when
        they changed, each job's duration (see :class:`~kvtier.metrics.DeltaReporter`)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
            OffloadingConnectorStats,
        )

        try:
            st = self._front.statistics()
            samples = front_samples(st, self.block_size_bytes, LOWER_METRICS)
            samples = {k: v for k, v in samples.items() if k[1][:1] != ("cpu",)}
            stats = OffloadingConnectorStats()
            self._reporter.report(samples, stats)
        except Exception as exc:
            self._failed("statistics", exc)
            return None
        return None if stats.is_empty() else stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info`` this tier fills."""
        return _CONFIG_INFO_KEYS

    def config_info(self) -> dict[str, str | int | float | bool]:
        """kvtier's tiers, the slot size, the lookup deadline."""
        return {
            "kvtier_tiers": ",".join(self._front.tier_names),
            "kvtier_slot_bytes": self.block_size_bytes,
            "kvtier_lookup_deadline_s": self._settings.lookup_deadline_s,
        }

    def shutdown(self) -> None:
        """Wait for jobs in flight (30 s at most), close kvtier's tiers, release every
        view of the primary buffer (vLLM then unmaps it)."""
        if self._closed:
            return
        self._closed = True
        self._front.close()

    @property
    def front(self) -> LowerFront:
        """The lower front this tier drives (its statistics, for tests and tools)."""
        return self._front

    # -- inside --------------------------------------------------------------------------

    def _key(self, key: OffloadKey) -> bytes:
        return offload_key_to_kvtier(bytes(key), self._ns)

    def _submit(self, job: TransferJob, *, load: bool) -> None:
        names = list(job.keys)
        keys = [self._key(k) for k in names]
        if job.job_id in self._names:  # vLLM numbers its jobs once: never seen
            self._failed("submit", ValueError(f"job {job.job_id} is in flight already"))
            return
        self._names[job.job_id] = (names, keys)
        try:
            self._reporter.began((load, job.job_id))
            if load:
                self._front.load(job.job_id, keys, job.chunk_ids.tolist())
            else:
                self._front.store(job.job_id, keys, job.chunk_ids.tolist())
        except Exception as exc:  # a job id in flight twice: vLLM's bug, not a block's
            self._failed("submit", exc)

    def _result(self, done: JobDone) -> JobResult:
        names, keys = self._names.pop(done.job, ((), ()))
        self._reporter.ended(
            (done.load, done.job), READ_DURATION if done.load else WRITE_DURATION, "lower"
        )
        successful = None
        if done.load and not done.ok:
            successful = [n for n, k in zip(names, keys, strict=True) if k in done.done]
        return JobResult(
            job_id=done.job,
            success=done.ok,
            successful_keys=successful,
            transfer_time=done.seconds,
            transfer_bytes=done.moved * self.block_size_bytes,
        )

    def _failed(self, what: str, exc: BaseException) -> None:
        if what not in self._failures_logged:
            self._failures_logged.add(what)
            log.warning("kvtier secondary tier: %s failed (%s); logged once", what, exc)


def _layout(spec: Any, stride: int, revision: str | None) -> KVLayout:
    """What a block of vLLM's primary means, in kvtier's terms: its namespace.

    A block is one primary slot (every worker's bytes of one chunk, then the
    pad to the page). Its namespace holds the model's identity, its KV cache
    groups' layers and block sizes, tokens per hash, blocks per chunk, bytes
    per block per worker, the world size and whether every rank holds the same
    bytes (``replicated_layout``), the slot size, and what the bytes mean
    (:func:`~kvtier.integrations.vllm._common.kv_encoding`: KV dtype, page
    order, sharding, vLLM's release): two instances share blocks only when
    all of it is equal.
    """
    config = spec.config
    model_id = json.dumps(
        {
            "integration": "vllm-secondary-tier",
            "model": model_digest(config, revision),
            "groups": [[int(g.tokens_per_block), list(g.layer_names)] for g in config.groups],
            "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk,
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "world_size": config.parallel.world_size,
            "replicated_layout": bool(getattr(spec, "replicated_layout", False)),
        },
        sort_keys=True,
    )
    tokens = sorted({int(g.tokens_per_block) for g in config.groups}) or [1]
    return KVLayout(
        tensors=(TensorSpec("vllm_primary_slot", (1, stride), "int8", 1, False),),
        model_id=model_id,
        block_tokens=tokens[0],
        encoding=kv_encoding(config),
    )
