"""kvtier behind vLLM's ``OffloadingSpec``: the only module of kvtier that imports vLLM.

vLLM (0.32) runs its scheduler (EngineCore) and its workers in separate
processes. Each side gets its own half here::

    EngineCore process (vLLM's scheduler thread)       worker process, rank r
      KVTierOffloadingManager                            KVTierOffloadingWorker
        ResidencyManager over the CPU rows (sync)          DeviceTransfer (kvtier's CPU or
        FileTier on a loop thread of its own                CUDA copier) on a loop thread
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

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Collection, Coroutine, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-not-found]

from kvtier.chain import (
    Answer,
    Chain,
    Intent,
    LowerTier,
    Outcome,
    Read,
    ReadDone,
    TierChanged,
    Write,
    Written,
)
from kvtier.config import KVTierConfig
from kvtier.errors import BusyError, ConfigurationError, LayoutError
from kvtier.integrations.vllm.identity import model_identity
from kvtier.integrations.vllm.settings import VLLMSettings, parse_extra_config
from kvtier.layout import KVLayout, TensorSpec
from kvtier.manager import BlockRemoved, ManagerEvent, ResidencyManager
from kvtier.metrics import (
    DEADLINE_MISSES,
    EVENTS_DROPPED,
    EVENTS_PUBLISHED,
    LOOKUPS,
    METRICS,
    READ_DURATION,
    WRITE_DURATION,
    DeltaReporter,
    MetricSpec,
    Samples,
    TierMetrics,
    as_json,
    samples,
    tier_metrics,
)
from kvtier.region import CPURegion
from kvtier.tier_driver import TierDriver
from kvtier.tiers.base import Announces, Recovers, Tier
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import DeviceTransfer, open_device_transfer

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

log = logging.getLogger("kvtier.integrations.vllm")

T = TypeVar("T")

_PERSON = b"kvtier.vllm.v1"

MAX_PENDING_EVENT_KEYS = 1 << 16
"""Keys of KV cache events kept for :meth:`KVTierOffloadingManager.take_events`.

vLLM takes them every scheduler step, which keeps the queue short; when nobody
takes them the oldest events are dropped (counted as ``events_dropped``)."""

_FILE_OWNER = "kvtier-file"


class RowsSpec(BlockIDsLoadStoreSpec):  # type: ignore[misc]
    """Where offloaded blocks are: rows of kvtier's CPU region (``block_ids``)."""


def offload_key_to_kvtier(key: bytes, namespace: bytes) -> bytes:
    """kvtier's 16-byte key for vLLM's ``OffloadKey`` (block hash + group) in ``namespace``.

    The namespace is the layout fingerprint: two models, KV dtypes, block
    sizes or world sizes sharing a file tier never hit each other's blocks.
    """
    h = hashlib.blake2b(namespace, digest_size=16, person=_PERSON)
    h.update(key)
    return h.digest()


def row_layout(config: OffloadingConfig, rank: int = 0, revision: str | None = None) -> KVLayout:
    """The layout of one worker's slice of a row, computed alike on both sides.

    One row holds ``blocks_per_chunk`` device blocks of every layer of the
    worker (vLLM's ``worker_kv_bytes_per_block`` each). The model id carries
    what vLLM says makes bytes incompatible: the model's identity (its config
    and weights, or the ``revision`` the user names: see
    :func:`~kvtier.integrations.vllm.identity.model_identity`; never the path
    it was loaded from), KV dtype, KV cache layout, the layers of each KV
    cache group, tokens per hash.

    Raises
    ------
    ConfigurationError
        For no KV cache group, groups of different block sizes, or several
        groups with ``blocks_per_chunk > 1`` (see Notes).

    Notes
    -----
    With several groups (hybrid models), vLLM stores a sliding-window group's
    chunk without the blocks that left the window, so with ``blocks_per_chunk
    > 1`` a store may fill part of a row; kvtier's copier moves whole rows, so
    several groups need ``blocks_per_chunk == 1`` (vLLM's default).
    """
    groups = config.groups
    bpc = config.cache.blocks_per_chunk
    if not groups:
        raise ConfigurationError("vLLM gave kvtier no KV cache group to offload")
    sizes = sorted({g.tokens_per_block for g in groups})
    if len(sizes) > 1:
        raise ConfigurationError(
            f"kvtier needs one block size for every KV cache group; this model's "
            f"groups have {sizes} tokens per block"
        )
    if len(groups) > 1 and bpc != 1:
        raise ConfigurationError(
            f"this model has {len(groups)} KV cache groups (a hybrid model); kvtier "
            f"offloads it with blocks_per_chunk = 1 only, got {bpc}: vLLM stores a "
            "sliding-window chunk without its freed blocks, a part of a row, and "
            "kvtier copies whole rows (remove block_size / blocks_per_chunk from "
            "kv_connector_extra_config)"
        )
    model_id = json.dumps(
        {
            "integration": "vllm",
            "model": hashlib.blake2b(
                json.dumps(model_identity(config.model.name, revision), sort_keys=True).encode(),
                digest_size=16,
            ).hexdigest(),
            "kv_dtype": config.model.dtype,
            "kv_cache_layout": config.kv_cache_layout,
            # One group keeps its former id, so file tiers written before stay valid.
            "layers": (
                list(groups[0].layer_names)
                if len(groups) == 1
                else [list(g.layer_names) for g in groups]
            ),
            "tokens_per_hash": config.cache.tokens_per_hash,
        },
        sort_keys=True,
    )
    page = TensorSpec(
        name="vllm_page",
        shape=(bpc, config.worker_kv_bytes_per_block),
        dtype="int8",
        itemsize=1,
        kv_first=False,
    )
    return KVLayout(
        tensors=(page,),
        model_id=model_id,
        block_tokens=sizes[0],
        blocks_per_chunk=bpc,
        tp_rank=rank,
        tp_size=config.parallel.world_size,
    )


def follow_vllm_logging() -> None:
    """Send kvtier's log records through vLLM's handlers, at vLLM's level.

    vLLM configures its ``vllm`` logger only (its own handler and format: the
    process name, pid, level and time; ``VLLM_LOGGING_LEVEL``), so kvtier's
    records would otherwise reach Python's last-resort handler: warnings
    bare, INFO (the I/O engine, queue depth, recovery) never. Left alone when
    the user configured the ``kvtier`` logger (handlers or a level of its own)
    or turned vLLM's logging configuration off (no handlers on ``vllm``).
    """
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False  # as vLLM's own: no second copy through the root logger


def _region_identity(engine_id: str) -> tuple[str, bytes]:
    digest = hashlib.blake2b(engine_id.encode(), digest_size=32, person=_PERSON).digest()
    return f"vllm-{digest[:12].hex()}", digest[16:]


class _LoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (start-up and shutdown only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def soon(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the loop thread; never blocks."""
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self.loop.close()


def group_segments(
    gpu: GPULoadStoreSpec, rows: LoadStoreSpec, bpc: int, *, store: bool
) -> list[tuple[np.ndarray, list[int], int]]:
    """Cut one vLLM transfer into ``(device block ids, rows, skip)``, one per KV cache group.

    vLLM lists the device blocks group after group (``group_sizes``), with the
    logical index of each group's first block (``block_indices``), and the
    rows in the same order: a group of ``n`` blocks starting ``skip = index %
    bpc`` blocks into its first row spans ``ceil((n + skip) / bpc)`` rows.

    Raises
    ------
    LayoutError
        When the counts do not add up, or a store would fill part of a row
        (kvtier's copier stores whole rows).
    """
    ids = np.asarray(gpu.block_ids, dtype=np.int64)
    row_ids = [int(r) for r in np.asarray(rows.block_ids)]
    out: list[tuple[np.ndarray, list[int], int]] = []
    at = row = 0
    for n, first in zip(gpu.group_sizes, gpu.block_indices, strict=True):
        if not n:
            continue
        skip = int(first) % bpc
        count = -(-(int(n) + skip) // bpc)
        if store and (skip or int(n) != count * bpc):
            raise LayoutError(
                f"vLLM stores {n} blocks from logical block {first} into {count} rows of "
                f"{bpc} blocks: kvtier stores whole rows only"
            )
        out.append((ids[at : at + n], row_ids[row : row + count], skip))
        at += int(n)
        row += count
    if at != len(ids) or row != len(row_ids):
        raise LayoutError(
            f"vLLM's transfer names {len(ids)} device blocks and {len(row_ids)} rows; its "
            f"groups ({list(gpu.group_sizes)} blocks) cover {at} and {row}"
        )
    return out


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """Make ``stream`` this thread's current CUDA stream (None: leave it)."""
    if stream is None:
        yield
        return
    import torch  # pragma: no cover - needs a GPU

    with torch.cuda.stream(stream):  # pragma: no cover
        yield


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
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """kvtier's metrics (:mod:`kvtier.metrics`, those of the vLLM front), in vLLM's terms.

        vLLM's front-end process creates each under the name given (no
        ``vllm:`` prefix is added) with its ``model_name`` and ``engine``
        labels before kvtier's own (``tier``); the manager's :meth:`get_stats
        <KVTierOffloadingManager.get_stats>` reports their values.
        """
        return {spec.name: _metadata(spec) for spec in METRICS if "vllm" in spec.fronts}

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


def _metadata(spec: MetricSpec) -> OffloadingMetricMetadata:
    if spec.kind == "counter":
        return OffloadingCounterMetadata(spec.documentation, spec.labelnames)
    if spec.kind == "gauge":
        return OffloadingGaugeMetadata(spec.documentation, spec.labelnames)
    return OffloadingHistogramMetadata(spec.documentation, spec.labelnames, spec.buckets)


class KVTierOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """The scheduler side: vLLM's calls translated onto kvtier's chain of tiers.

    Every method is called by vLLM's scheduler thread, is synchronous and does
    no I/O. Where every block is and what to do next is the
    :class:`~kvtier.chain.Chain`'s (the same decisions whatever the front);
    this class translates vLLM's keys and answers, carries the chain's intents
    to kvtier's loop thread (a :class:`~kvtier.tier_driver.TierDriver` runs
    them on the tiers) and hands their outcomes back to the chain through a
    queue it drains at the start of every call. It never waits for I/O
    (except in :meth:`shutdown`).

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
        loop: _LoopThread,
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
        self._chain = Chain(
            ResidencyManager(
                region.rows, self._config.eviction_policy, tier="cpu", enable_events=enable_events
            ),
            [
                LowerTier(spec.name, shared=tier.shared, promote_up=i > 0 and spec.promotes_up)
                for i, (spec, tier) in enumerate(zip(specs, tiers, strict=True))
            ],
            lookup_deadline_s=settings.lookup_deadline_s,
        )
        # The file tier (the one tier of this instance's own) announces KV events.
        self._event_tier = self._tier_names.index("file") if "file" in self._tier_names else -1
        self._names: dict[bytes, OffloadKey] = {}
        # Filled on the loop thread, drained on vLLM's: deque append and popleft
        # are atomic, so the two threads need no lock.
        self._outcomes: collections.deque[Outcome | _TierEvents] = collections.deque()
        self._events: collections.deque[OffloadingEvent] | None = (
            collections.deque() if enable_events else None
        )
        self._event_keys = 0
        self._announced_file: set[bytes] = set()
        self._closed = False
        self._n: dict[str, int] = dict.fromkeys(
            ("stores", "loads", "loaded_blocks", "events_published", "events_dropped"), 0
        )
        self._last_stats = ""
        # kvtier's metrics for vLLM (get_stats): totals turned into increases,
        # and how long each tier's jobs took.
        self._reporter = DeltaReporter()
        self._row_bytes = region.slice_bytes * region.world_size
        # Whether a figure may have changed since the last get_stats: most
        # steps (decoding) change none, and then cost no snapshot at all.
        self._changed = True
        self._driver = TierDriver(
            tiers, self._tier_names, region, self._post_outcome, self._after_tier_call
        )
        for i, tier in enumerate(tiers):
            if not isinstance(tier, Recovers):
                continue
            if tier.recovering:  # the scan goes on: its blocks join when it ends
                loop.soon(self._seed, i, tier)
            else:  # found at open: known before vLLM's first lookup
                keys = loop.run(_recovered(tier))
                self._chain.settle(TierChanged(i, added=tuple(keys)))

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
        loop = _LoopThread("kvtier-vllm-scheduler")
        tiers: list[Tier] = []
        try:
            for _name, spec in settings.config.chain:
                tiers.append(loop.run(spec.open_below(layout, region, enable_events=enable_events)))
        except BaseException:
            for tier in reversed(tiers):
                with contextlib.suppress(Exception):
                    loop.run(tier.aclose(), timeout=60.0)
            loop.stop()
            region.close()
            raise
        log.info(
            "kvtier: CPU tier of %d rows of %d bytes (cpu_bytes_to_use=%d)",
            region.rows,
            region.row_stride,
            int(settings.config.cpu_bytes_to_use),
        )
        for (name, _spec), tier in zip(settings.config.chain, tiers, strict=True):
            log.info("kvtier: %s tier: %s", name, _describe(tier))
        return cls(settings, layout, region, loop, tiers, enable_events=enable_events)

    # -- vLLM's OffloadingManager -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain()
        k = self._key(key)
        self._changed = True
        answer = self._chain.lookup(k)
        if answer is Answer.RETRY:
            self._names[k] = key  # announced in the CPU tier once promoted
        return _ANSWERS[answer]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> RowsSpec:
        self._drain()
        ks = [self._key(k) for k in keys]
        slots = self._chain.pin_for_device_load(ks)
        self._reporter.began((False, frozenset(ks)))
        self._changed = True
        self._n["loads"] += 1
        self._n["loaded_blocks"] += len(ks)
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
        cpu = self._chain.cpu
        todo: dict[bytes, OffloadKey] = {}
        for key in keys:
            k = self._key(key)
            if k not in cpu:
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
        self._n["stores"] += len(plan.keys)
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
        self._reporter.report(self._metrics(), stats)
        return None if stats.is_empty() else stats

    def reset_cache(self) -> None:
        self._drain()
        self._changed = True
        try:
            self._chain.cpu.reset()
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
        try:
            for name, tier in reversed(list(zip(self._tier_names, self._tiers, strict=True))):
                try:
                    self._loop.run(tier.aclose(), timeout=60.0)
                except Exception:
                    log.exception("closing kvtier's %s tier failed", name)
        finally:
            self._loop.stop()
            self._region.close()

    # -- kvtier's side ------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """Counters of this front and of the chain, and every tier's own statistics.

        ``tiers`` maps each tier's name (``cpu``, then the lower tiers in
        order) to the chain's counts for it; ``cpu`` and each lower tier's
        name (``file``, ``cluster``) to that tier's own record. The flat
        counters keep their names of earlier releases. ``metrics`` holds the
        totals of kvtier's Prometheus metrics under their names (metric name,
        then label values joined by commas: see :func:`kvtier.metrics.as_json`).
        """
        chain = self._chain.statistics()
        lower = [chain.tiers[name] for name in self._tier_names]
        out: dict[str, Any] = dict(self._n)
        out.update(
            lookups=chain.lookups,
            lookup_hits=chain.tiers["cpu"].lookup_hits,
            store_refusals=chain.store_refusals,
            deadline_misses=chain.deadline_misses,
            promotions=sum(t.blocks_out for t in lower),
            promotion_failures=sum(t.read_failures for t in lower),
            file_writes=chain.tiers["file"].blocks_in if "file" in chain.tiers else 0,
            write_through_failures=sum(t.write_failures for t in lower),
            rows_held_by_writes=chain.rows_held_by_writes,
            tiers={name: asdict(counts) for name, counts in chain.tiers.items()},
            cpu=asdict(self._chain.cpu.statistics()),
            metrics=as_json(self._metrics()),
        )
        out["file"] = None
        for name, tier in zip(self._tier_names, self._tiers, strict=True):
            # A snapshot of counters another thread updates: each field is read
            # atomically under the GIL; the record as a whole may be a step stale.
            out[name] = asdict(tier.statistics())  # type: ignore[call-overload]
        return out

    def _metrics(self) -> Samples:
        """Every metric of this front now, as totals (docs/operations.md, "Metrics")."""
        chain = self._chain.statistics()
        counts = chain.tiers
        tiers: dict[str, TierMetrics] = {
            "cpu": tier_metrics(
                self._chain.cpu.statistics(),
                counts["cpu"],
                row_bytes=self._row_bytes,
                store_refusals=chain.store_refusals,
            )
        }
        for name, tier in zip(self._tier_names, self._tiers, strict=True):
            # A record of counters the loop thread updates, read from this one as
            # statistics() does: each field atomically under the GIL.
            c = counts[name]
            tiers[name] = tier_metrics(
                tier.statistics(),
                c,
                row_bytes=self._row_bytes,
                read_failures=c.read_failures,
                write_failures=c.write_failures,
            )
        return samples(
            tiers,
            {
                (LOOKUPS.name, ()): chain.lookups,
                (DEADLINE_MISSES.name, ()): chain.deadline_misses,
                (EVENTS_PUBLISHED.name, ()): self._n["events_published"],
                (EVENTS_DROPPED.name, ()): self._n["events_dropped"],
            },
        )

    def _key(self, key: OffloadKey) -> bytes:
        return offload_key_to_kvtier(bytes(key), self._ns)

    def _refused(self, count: int, offered: int) -> None:
        """Log the first refusal with the sizing rule (the chain counts them)."""
        if self._chain.statistics().store_refusals != count:
            return
        log.warning(
            "kvtier's CPU tier (%d rows of %d bytes, cpu_bytes_to_use=%d) could not take "
            "%d of the %d blocks one scheduler step offered%s. Give it at least twice the "
            "rows one step stores (max_num_batched_tokens / (block_size x "
            "blocks_per_chunk)): rows held by tier writes in flight are not reusable "
            "until the write ends. See docs/vllm.md, 'Sizing the CPU tier'. Logged once; "
            "refusals are counted as store_refusals",
            self._chain.cpu.capacity,
            self._region.row_stride,
            int(self._config.cpu_bytes_to_use),
            count,
            offered or count,
            "" if not offered else " (the leading ones were stored)",
        )

    def _forget(self, keys: Iterable[bytes]) -> None:
        """Drop the names of blocks that no tier holds under a name any more."""
        cpu, chain = self._chain.cpu, self._chain
        for k in keys:
            if k not in cpu and k not in self._announced_file and not chain.is_waiting(k):
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
        self._n["events_published"] += len(names)
        self._event_keys += len(names)
        while self._event_keys > MAX_PENDING_EVENT_KEYS and len(events) > 1:
            old = events.popleft()
            self._event_keys -= len(old.keys)
            if not self._n["events_dropped"]:
                log.warning(
                    "kvtier's KV cache events are not being taken: dropping the oldest "
                    "(more than %d keys queued)",
                    MAX_PENDING_EVENT_KEYS,
                )
            self._n["events_dropped"] += len(old.keys)

    def _translate(self, events: Iterable[ManagerEvent], medium: Medium) -> None:
        for ev in events:
            removed = isinstance(ev, BlockRemoved)
            self._publish(list(ev.keys), medium, removed)
            if removed:
                self._forget(ev.keys)

    def _pull_cpu_events(self) -> None:
        if self._events is not None:
            self._translate(self._chain.cpu.take_events(), Medium.CPU)

    def _dispatch(self) -> None:
        """Hand the chain's intents to the loop thread (one wake-up for all of them)."""
        intents = self._chain.take_intents()
        if intents:
            self._loop.soon(self._carry_out, intents)

    def _drain(self) -> None:
        """Apply what the loop thread handed back, in order: outcomes, the file tier's events."""
        outcomes, chain = self._outcomes, self._chain
        while outcomes:
            item = outcomes.popleft()
            self._changed = True
            if isinstance(item, _TierEvents):
                self._translate(item.events, Medium.STORAGE)
                continue
            chain.settle(item)
            if isinstance(item, ReadDone):
                self._forget([k for k in item.intent.keys if k not in item.loaded])
        self._pull_cpu_events()

    # Loop thread only.

    def _carry_out(self, intents: list[Intent]) -> None:
        for intent in intents:
            if isinstance(intent, Write | Read):  # timed until their outcome is posted
                self._reporter.began(id(intent))
            self._driver.carry_out(intent)

    def _post_outcome(self, outcome: Outcome) -> None:
        if isinstance(outcome, Written | ReadDone):
            metric = WRITE_DURATION if isinstance(outcome, Written) else READ_DURATION
            name = self._tier_names[outcome.intent.tier]
            self._reporter.ended(id(outcome.intent), metric, name)
        self._outcomes.append(outcome)

    def _after_tier_call(self, index: int) -> None:
        # The file tier's residency belongs to this thread: its events are taken
        # here, after each operation, and handed over with the outcome.
        if index == self._event_tier and self._events is not None:
            tier = self._tiers[index]
            if isinstance(tier, Announces) and (events := tier.take_events()):
                self._outcomes.append(_TierEvents(events))

    async def _seed_async(self, index: int, tier: Recovers) -> None:
        await tier.wait_recovered()
        self._driver.seed(index, tier.take_recovered_keys())

    def _seed(self, index: int, tier: Recovers) -> None:
        self._loop.loop.create_task(self._seed_async(index, tier))

    def _write_statistics(self, force: bool = False) -> None:
        path = self._settings.statistics_file
        if path is None:
            return
        text = json.dumps(self.statistics(), default=str, sort_keys=True)
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


def _describe(tier: Tier) -> str:
    """One line on an open tier for the start-up log: what its record says of its set-up."""
    record = asdict(tier.statistics())  # type: ignore[call-overload]
    shown = ("io_engine", "queue_depth", "direct_io", "capacity_bytes", "recovered_blocks")
    return ", ".join(f"{k} {record[k]}" for k in shown if k in record) or "open"


@dataclass(frozen=True, slots=True)
class _TierEvents:
    """The file tier's residency events of one operation, handed over in order with it."""

    events: list[ManagerEvent]


async def _recovered(tier: Recovers) -> list[bytes]:
    return tier.take_recovered_keys()


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write kvtier statistics to %s: %s", path, exc)


class KVTierOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    """One worker's data plane: kvtier's copier between vLLM's KV tensors and its rows.

    ``submit_*`` never blocks: the copy is started on a loop thread of the
    worker's own, and its completion is collected by :meth:`get_finished`.

    On CUDA (KV tensors on a GPU) the copier is kvtier's CUDA backend
    (:func:`~kvtier.transfer.device.open_device_transfer` chooses it by the
    tensors' device). It orders each copy after the work queued on the
    submitting thread's current stream; the copy is submitted from the loop
    thread, so that thread is given the stream that was current in vLLM's
    thread at ``submit_*`` (where vLLM's own CPU offloading worker waits).
    """

    def __init__(
        self, layout: KVLayout, region: CPURegion, transfer: DeviceTransfer, loop: _LoopThread
    ) -> None:
        """Use :meth:`open`."""
        self._layout = layout
        self._region = region
        self._xfer = transfer
        self._loop = loop
        self._bpc = layout.blocks_per_chunk
        self._lock = threading.Condition()
        self._finished: list[TransferResult] = []
        self._done_ids: set[int] = set()
        self._closed = False
        self._cuda = transfer.backend == "cuda"

    @classmethod
    def open(
        cls, row: KVLayout, region: CPURegion, kv_caches: CanonicalKVCaches
    ) -> KVTierOffloadingWorker:
        """Describe vLLM's canonical tensors, check they fill a row slice, start the copier.

        Raises
        ------
        LayoutError
            The tensors' pages do not add up to vLLM's ``worker_kv_bytes_per_block``
            (e.g. packed layouts), or a tensor is not contiguous.
        """
        loop: _LoopThread | None = None
        try:
            tensors = [t.tensor for t in kv_caches.tensors]
            layout = KVLayout.from_tensors(
                tensors,
                model_id=row.model_id,
                block_tokens=row.block_tokens,
                blocks_per_chunk=row.blocks_per_chunk,
                kv_first=False,
                tp_rank=row.tp_rank,
                tp_size=row.tp_size,
            )
            if layout.bytes_per_chunk != row.bytes_per_chunk:
                raise LayoutError(
                    f"vLLM's KV tensors hold {layout.bytes_per_block} bytes per block, but its "
                    f"offloading config says {row.bytes_per_block}: this KV layout is not "
                    "supported by kvtier"
                )
            (whole,) = region.tensor_views()
            views = []
            for i, t in enumerate(layout.tensors):
                off = layout.tensor_offset(i)
                views.append(whole[:, off : off + t.bytes_per_block * layout.blocks_per_chunk])
            transfer = open_device_transfer(layout, tensors, views)
            loop = _LoopThread(f"kvtier-vllm-worker-{row.tp_rank}")
        except BaseException:
            region.close()
            raise
        return cls(layout, region, transfer, loop)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._submit(job_id, True, src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._submit(job_id, False, dst_spec, src_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        with self._lock:
            self._lock.wait_for(lambda: job_ids <= self._done_ids or self._closed)

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._loop.run(self._xfer.aclose(), timeout=60.0)
        finally:
            self._loop.stop()
            self._region.close()
            with self._lock:
                self._closed = True
                self._lock.notify_all()

    def _submit(self, job: int, store: bool, gpu: GPULoadStoreSpec, rows: LoadStoreSpec) -> None:
        t0 = time.perf_counter()
        ids = np.asarray(gpu.block_ids, dtype=np.int64)
        nbytes = len(ids) * self._layout.bytes_per_block
        stream = None
        if self._cuda:  # pragma: no cover - needs a GPU
            import torch

            stream = torch.cuda.current_stream()
        self._loop.soon(self._start, job, store, gpu, rows, stream, nbytes, t0)

    def _start(
        self,
        job: int,
        store: bool,
        gpu: GPULoadStoreSpec,
        rows: LoadStoreSpec,
        stream: Any,
        nbytes: int,
        t0: float,
    ) -> None:
        try:
            parts = group_segments(gpu, rows, self._bpc, store=store)
            comps = []
            with _on_stream(stream):
                for ids, part_rows, skip in parts:
                    group = {g: ids for g in self._layout.groups}
                    comps.append(
                        self._xfer.store(group, part_rows)
                        if store
                        else self._xfer.load(part_rows, group, skip)
                    )
        except Exception:
            # Segments already queued still copy; the job fails (vLLM then
            # treats its blocks as lost) and nothing reuses them meanwhile.
            log.exception("kvtier could not start job %d", job)
            self._finish(job, False, nbytes, t0)
            return
        if not comps:
            self._finish(job, True, nbytes, t0)
            return
        left = [len(comps)]
        failed: list[BaseException] = []

        def done(c: Completion[None]) -> None:
            if (exc := c.exception()) is not None:
                failed.append(exc)
            left[0] -= 1
            if left[0]:
                return
            if failed:
                log.error("kvtier job %d failed: %s", job, failed[0])
            self._finish(job, not failed, nbytes, t0)

        for comp in comps:
            comp.add_done_callback(done)

    def _finish(self, job: int, ok: bool, nbytes: int, t0: float) -> None:
        with self._lock:
            self._finished.append(TransferResult(job, ok, nbytes, time.perf_counter() - t0))
            self._done_ids.add(job)
            self._lock.notify_all()
