"""kvtier behind vLLM's ``OffloadingSpec``: the spec, and how its two sides meet.

vLLM (0.32) runs its scheduler (EngineCore) and its workers in separate
processes. Each side gets its own half, in a module of its own
(:mod:`.manager`, :mod:`.worker`; what both use is :mod:`._common`)::

    EngineCore process (vLLM's scheduler thread)       worker process, rank r
      KVTierOffloadingManager                            KVTierOffloadingWorker
        kvtier.chain over the CPU rows (sync)              DeviceTransfer (kvtier's CPU or
        the lower tiers on a loop thread of its own         CUDA copier) on a loop thread
        CPURegion mapped whole (rank=None)                  CPURegion(rank=r), same file
           |  prepare_store / prepare_load -> RowsSpec (row ids)   |
           |  ---- vLLM's connector metadata (job id, specs) ----> | submit_store / submit_load
           |  <--- vLLM's KVConnectorOutput (finished job ids) ----| get_finished
           |  complete_store -> write-through on the loop thread    |
                   shared /dev/shm region, row = [rank 0 | rank 1 | ... | pad]

*The channel.* vLLM already carries every job from its scheduler to its
workers, in step with the model's forward pass, and every completion back;
kvtier adds no second channel (its :class:`~kvtier.workers.WorkerGroup` is for
serving loops that have none). The bytes cross through the shared CPU region,
which both sides create-or-join under a name and instance token derived from
vLLM's ``engine_id``, with a geometry (the namespace included) computed on
both sides from the same ``OffloadingConfig``.

*Threads.* vLLM calls the manager synchronously from its scheduler loop. The
CPU tier's residency (pure Python, no I/O) is owned by that thread. The file
tier lives on an asyncio loop in a thread of its own: the manager hands it
work with ``call_soon_threadsafe`` and gets results back through a
thread-safe queue that it drains at the start of every call; it never waits
for it (except in :meth:`KVTierOffloadingManager.shutdown`).

*Failed loads.* vLLM 0.32 asserts that every transfer succeeds, so a load
that kvtier cannot serve must never reach a worker. The only fallible reads
(the file tier: I/O errors, checksum mismatches) happen inside ``lookup``: a
block found only on file is promoted into a CPU row while ``lookup`` answers
``RETRY`` (vLLM asks again at a later step); once the read is verified the
answer is ``HIT``, and if it failed the block is gone from both tiers and the
answer is ``MISS``, so vLLM recomputes it. A worker-side copy (CPU row to KV
tensor, a memcpy or a CUDA copy) has no failure that vLLM could recover from.

*KV cache events.* When vLLM publishes KV cache events (``kv_events_config``
with ``enable_kv_cache_events``), :meth:`KVTierOffloadingManager.take_events`
yields vLLM's ``OffloadingEvent``: keys that became loadable in the CPU tier
(medium ``CPU``) or were written through to the file tier (``STORAGE``, local,
ownership ``"kvtier-file"``), and keys evicted or removed from either. vLLM
turns them into ``BlockStored`` / ``BlockRemoved`` for KV-aware routers. The
events wait in a queue bounded to :data:`MAX_PENDING_EVENT_KEYS` keys: vLLM
takes them every scheduler step; if nobody does, the oldest are dropped and
counted (``events_dropped``), never an unbounded backlog. With events off
nothing is recorded.

*KV cache groups.* A hybrid model (sliding-window and full-attention layers)
has one KV cache group per attention kind. vLLM's keys carry the group, its
``GPULoadStoreSpec`` lists the block ids group after group (``group_sizes``)
with each group's first logical block (``block_indices``), and the rows of
the CPU spec follow in the same order, one per offloaded block. Every group's
layers live in the same canonical tensors (vLLM's hybrid allocator gives
each tensor one layer of every group), and a block id belongs to one group at
a time, so a row holds a block's page of every tensor whatever its group.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-not-found]

from kvtier._native_status import warn_if_missing
from kvtier.integrations.vllm._common import (
    RowsSpec,
    _region_identity,
    follow_vllm_logging,
    offload_key_to_kvtier,
    row_layout,
)
from kvtier.integrations.vllm.manager import (
    CONFIG_INFO_KEYS,
    MAX_PENDING_EVENT_KEYS,
    KVTierOffloadingManager,
)
from kvtier.integrations.vllm.settings import VLLMSettings, parse_extra_config
from kvtier.integrations.vllm.statistics import VLLM_METRICS
from kvtier.integrations.vllm.worker import KVTierOffloadingWorker, group_segments
from kvtier.metrics import (
    METRICS,
    MetricSpec,
)
from kvtier.region import CPURegion

__all__ = [
    "MAX_PENDING_EVENT_KEYS",
    "KVTierOffloadingManager",
    "KVTierOffloadingSpec",
    "KVTierOffloadingWorker",
    "RowsSpec",
    "follow_vllm_logging",
    "group_segments",
    "offload_key_to_kvtier",
]


class KVTierOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's ``OffloadingSpec`` backed by kvtier's CPU region and file tier.

    Parameters
    ----------
    config
        vLLM's ``OffloadingConfig``; ``extra_config`` is
        ``kv_connector_extra_config`` (see
        :func:`kvtier.integrations.vllm.settings.parse_extra_config`).

    Raises
    ------
    ConfigurationError
        For unknown or invalid keys, at start-up, in every process.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        follow_vllm_logging()
        warn_if_missing(python_warning=False)  # in vLLM's log: slower fallbacks say so
        self.settings: VLLMSettings = parse_extra_config(
            dict(config.extra_config),
            blocks_per_chunk=config.cache.blocks_per_chunk,
            world_size=config.parallel.world_size,
        )
        self.layout = row_layout(config, config.parallel.rank, self.settings.model_revision)
        self._manager: KVTierOffloadingManager | None = None
        self._worker: KVTierOffloadingWorker | None = None

    def _region(self, rank: int | None) -> CPURegion:
        name, instance = _region_identity(self.config.engine_id)
        cfg = self.settings.config
        return CPURegion.create(
            self.layout,
            int(cfg.cpu_bytes_to_use),
            world_size=self.config.parallel.world_size,
            rank=rank,
            shared_name=name,
            instance=instance,
            # vLLM builds its workers' KV caches (get_worker) before its
            # scheduler (get_manager): the workers must keep the region's name
            # for the scheduler, or it would map a second region of its own.
            holder=rank is not None,
            alignment=cfg.row_alignment,
        )

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of ``vllm:kv_offload_config_info`` kvtier fills (vLLM 0.33 asks).

        :meth:`KVTierOffloadingManager.config_info` gives their values; vLLM
        0.32 calls neither.
        """
        return CONFIG_INFO_KEYS

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """kvtier's metrics (:mod:`kvtier.metrics`, those of the vLLM front, and its own
        record's: :mod:`.statistics`), in vLLM's terms.

        vLLM's front-end process creates each under the name given (no
        ``vllm:`` prefix is added) with its ``model_name`` and ``engine``
        labels before kvtier's own (``tier``); the manager's :meth:`get_stats
        <KVTierOffloadingManager.get_stats>` reports their values.
        """
        return {
            spec.name: metric_metadata(spec)
            for spec in (*METRICS, *VLLM_METRICS)
            if "vllm" in spec.fronts
        }

    def get_manager(self) -> KVTierOffloadingManager:
        """The scheduler side (EngineCore process): residency, file tier."""
        if self._manager is None:
            self._manager = KVTierOffloadingManager.open(
                self.settings,
                self.layout,
                self._region(None),
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> KVTierOffloadingWorker:
        """The data plane of one worker process: copies between its KV tensors and rows."""
        if self._worker is None:
            self._worker = KVTierOffloadingWorker.open(
                self.layout, self._region(self.config.parallel.rank), kv_caches
            )
        return self._worker


def metric_metadata(spec: MetricSpec) -> OffloadingMetricMetadata:
    if spec.kind == "counter":
        return OffloadingCounterMetadata(spec.documentation, spec.labelnames)
    if spec.kind == "gauge":
        return OffloadingGaugeMetadata(spec.documentation, spec.labelnames)
    return OffloadingHistogramMetadata(spec.documentation, spec.labelnames, spec.buckets)
