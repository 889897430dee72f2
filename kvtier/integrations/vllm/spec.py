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
from dataclasses import asdict
from typing import Any, TypeVar

import numpy as np
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # type: ignore[import-not-found]

from kvtier.config import KVTierConfig
from kvtier.engine import open_file_tier_below
from kvtier.errors import BusyError, ConfigurationError, KVTierError, LayoutError
from kvtier.integrations.vllm.identity import model_identity
from kvtier.integrations.vllm.settings import VLLMSettings, parse_extra_config
from kvtier.layout import KVLayout, TensorSpec
from kvtier.manager import BlockRemoved, ManagerEvent, ResidencyManager, StorePlan
from kvtier.region import CPURegion
from kvtier.tiers.file_tier import FileTier
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


class KVTierOffloadingManager(OffloadingManager):  # type: ignore[misc]
    """The scheduler side: which block is in which row, the file tier below.

    Every method is called by vLLM's scheduler thread, is synchronous and does
    no I/O: file reads and writes are handed to the loop thread.

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
        file_tier: FileTier | None,
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
        self._file = file_tier
        self._cpu = ResidencyManager(
            region.rows, self._config.eviction_policy, tier="cpu", enable_events=enable_events
        )
        self._names: dict[bytes, OffloadKey] = {}
        # Results from the loop thread: ("promoted", keys, ok keys), ("written", keys,
        # failed count), ("events", (), the file tier's events).
        self._results: collections.deque[tuple[str, tuple[bytes, ...], object]]
        self._results = collections.deque()
        self._events: collections.deque[OffloadingEvent] | None = (
            collections.deque() if enable_events else None
        )
        self._event_keys = 0
        self._announced_file: set[bytes] = set()
        self._to_promote: list[bytes] = []
        self._promoting: set[bytes] = set()
        self._writes = 0
        self._closed = False
        self._n: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "lookup_hits",
                "stores",
                "store_refusals",
                "loads",
                "loaded_blocks",
                "promotions",
                "promotion_failures",
                "file_writes",
                "write_through_failures",
                "events_published",
                "events_dropped",
            ),
            0,
        )
        self._last_stats = ""

    @classmethod
    def open(
        cls,
        settings: VLLMSettings,
        layout: KVLayout,
        region: CPURegion,
        *,
        enable_events: bool = False,
    ) -> KVTierOffloadingManager:
        """Open the file tier (if configured) on a loop thread of its own.

        Parameters
        ----------
        settings, layout, region
            The adapter's settings, the row layout, the region mapped whole.
        enable_events
            Record KV cache events for :meth:`take_events` (vLLM's
            ``enable_kv_cache_events``).
        """
        loop = _LoopThread("kvtier-vllm-scheduler")
        file_tier = None
        cfg = settings.config.file_tier
        try:
            if cfg is not None:
                file_tier = loop.run(
                    open_file_tier_below(cfg, layout, region, enable_events=enable_events)
                )
        except BaseException:
            loop.stop()
            region.close()
            raise
        log.info(
            "kvtier: CPU tier of %d rows of %d bytes (cpu_bytes_to_use=%d)",
            region.rows,
            region.row_stride,
            int(settings.config.cpu_bytes_to_use),
        )
        if file_tier is not None and cfg is not None:
            st = file_tier.statistics()
            log.info(
                "kvtier: file tier at %s: %s, queue depth %d, %s I/O, %d bytes of slots, "
                "%d blocks recovered",
                cfg.root,
                st.io_engine,
                st.queue_depth,
                "O_DIRECT" if st.direct_io else "buffered",
                st.capacity_bytes,
                st.recovered_blocks,
            )
        return cls(settings, layout, region, loop, file_tier, enable_events=enable_events)

    # -- vLLM's OffloadingManager -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drain()
        k = self._key(key)
        self._n["lookups"] += 1
        # Through the CPU tier's lookup, so that its hits and misses count what
        # vLLM asked (one key at a time, up to its first miss), as under the Engine.
        if self._cpu.lookup((k,)):
            self._n["lookup_hits"] += 1
            return LookupResult.HIT
        if k in self._promoting:
            return LookupResult.RETRY  # the read may still fail: not a hit yet
        if k in self._cpu:
            return LookupResult.HIT_PENDING  # a store from the device is in flight
        # A membership read of the file tier's index from this thread: atomic
        # under the GIL, and a stale answer only costs a promotion that fails.
        if self._file is not None and self._file.is_ready(k) and k not in self._to_promote:
            self._to_promote.append(k)
            self._names[k] = key
            return LookupResult.RETRY
        if k in self._to_promote:
            return LookupResult.RETRY
        return LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> RowsSpec:
        self._drain()
        ks = [self._key(k) for k in keys]
        plan = self._cpu.prepare_load(ks)
        self._n["loads"] += 1
        self._n["loaded_blocks"] += len(ks)
        return RowsSpec(list(plan.slots))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        ks = [k for k in (self._key(x) for x in keys) if self._cpu.is_ready(k)]
        if ks:
            self._cpu.touch(ks)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._cpu.complete_load([self._key(k) for k in keys])
        self._drain()

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._drain()
        todo: dict[bytes, OffloadKey] = {}
        for key in keys:
            k = self._key(key)
            if k not in self._cpu and k not in self._to_promote:
                todo[k] = key
        if not todo:
            return PrepareStoreOutput(keys_to_store=[], store_spec=RowsSpec([]), evicted_keys=[])
        plan = self._place(list(todo))
        if plan is None:  # every row pinned or being written
            # vLLM keeps these blocks and asks again at its next step.
            self._refused(len(todo), 0)
            return None
        if len(plan.keys) < len(todo):
            # The leading blocks (a prefix: what a later request can hit) are
            # stored; vLLM does not offer this request's others again.
            self._refused(len(todo) - len(plan.keys), len(todo))
        self._n["stores"] += len(plan.keys)
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

    def _place(self, keys: list[bytes]) -> StorePlan | None:
        """Rows for the longest prefix of ``keys`` that fits the CPU tier now."""
        st = self._cpu.statistics()
        n = min(len(keys), st.capacity - st.used + st.evictable)
        while n:
            plan = self._cpu.prepare_store(keys[:n])
            if plan is not None:
                return plan
            n //= 2  # the room counted rows this call's own blocks would free
        return None

    def _refused(self, count: int, offered: int) -> None:
        """Count refused blocks; the first refusal is logged with the sizing rule."""
        first = not self._n["store_refusals"]
        self._n["store_refusals"] += count
        if first:
            rows = self._cpu.capacity
            log.warning(
                "kvtier's CPU tier (%d rows of %d bytes, cpu_bytes_to_use=%d) could not take "
                "%d of the %d blocks one scheduler step offered%s. Give it at least twice the "
                "rows one step stores (max_num_batched_tokens / (block_size x "
                "blocks_per_chunk)): rows held by file writes in flight are not reusable "
                "until the write ends. See docs/vllm.md, 'Sizing the CPU tier'. Logged once; "
                "refusals are counted as store_refusals",
                rows,
                self._region.row_stride,
                int(self._config.cpu_bytes_to_use),
                count,
                offered or count,
                "" if not offered else " (the leading ones were stored)",
            )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        ks = [self._key(k) for k in keys]
        self._cpu.complete_store(ks, success)
        if not success:
            self._forget(ks)
        if success and self._file is not None and ks:
            if self._file.recovering:
                self._n["write_through_failures"] += len(ks)
            else:
                # Pinned until the write is over: the row must not be reused meanwhile.
                plan = self._cpu.prepare_load(ks)
                rows = [self._region.row(s) for s in plan.slots]
                self._writes += 1
                self._loop.soon(self._start_write, tuple(ks), rows)
        self._drain()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._drain()
        if self._to_promote:
            self._start_promotions()
        self._write_statistics()

    def has_pending_work(self) -> bool:
        self._drain()
        return bool(self._promoting or self._to_promote)

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

    def reset_cache(self) -> None:
        self._drain()
        try:
            self._cpu.reset()
        except BusyError:
            log.warning("reset_cache: blocks are being loaded or stored; nothing was reset")
            return
        self._pull_cpu_events()
        self._forget(list(self._names))

    def shutdown(self) -> None:
        """Wait for file writes in flight (30 s at most), close the file tier and region."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 30.0
        while (self._writes or self._promoting) and time.monotonic() < deadline:
            self._drain()
            time.sleep(0.01)
        self._drain()
        self._write_statistics(force=True)
        try:
            if self._file is not None:
                self._loop.run(self._file.aclose(), timeout=60.0)
        finally:
            self._loop.stop()
            self._region.close()

    # -- kvtier's side ------------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """Counters of this manager, the CPU tier's and the file tier's statistics."""
        out: dict[str, Any] = dict(self._n)
        out["cpu"] = asdict(self._cpu.statistics())
        out["file"] = None if self._file is None else asdict(self._file.statistics())
        return out

    def _key(self, key: OffloadKey) -> bytes:
        return offload_key_to_kvtier(bytes(key), self._ns)

    def _forget(self, keys: Iterable[bytes]) -> None:
        """Drop the names of blocks that no tier holds under a name any more."""
        for k in keys:
            if (
                k not in self._cpu
                and k not in self._announced_file
                and k not in self._promoting
                and k not in self._to_promote
            ):
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
            self._translate(self._cpu.take_events(), Medium.CPU)

    def _start_promotions(self) -> None:
        wanted = [k for k in self._to_promote if k not in self._cpu]
        self._to_promote.clear()
        keys = wanted
        plan = self._cpu.prepare_store(keys) if keys else None
        while plan is None and len(keys) > 1:
            keys = keys[: len(keys) // 2]
            plan = self._cpu.prepare_store(keys)
        if plan is not None:
            self._promoting.update(plan.keys)
            self._pull_cpu_events()
            self._forget(plan.evicted)
        # Those left out (no free row) answer MISS at their next lookup.
        self._forget(wanted)
        if plan is None:
            return
        rows = [self._region.row(s) for s in plan.slots]
        self._loop.soon(self._start_read, plan.keys, rows)

    def _drain(self) -> None:
        while self._results:
            what, keys, detail = self._results.popleft()
            if what == "promoted":
                assert isinstance(detail, frozenset)
                good = [k for k in keys if k in detail]
                bad = [k for k in keys if k not in detail]
                if good:
                    self._cpu.complete_store(good, True)
                if bad:
                    self._cpu.complete_store(bad, False)
                    self._forget(bad)
                self._promoting.difference_update(keys)
                self._n["promotions"] += len(good)
                self._n["promotion_failures"] += len(bad)
            elif what == "events":
                assert isinstance(detail, list)
                self._translate(detail, Medium.STORAGE)
            else:
                assert isinstance(detail, int)
                self._cpu.complete_load(keys)
                self._writes -= 1
                self._n["file_writes"] += len(keys) - detail
                self._n["write_through_failures"] += detail
        self._pull_cpu_events()

    # Loop thread only: start I/O, post the outcome to the queue.

    def _post_file_events(self) -> None:
        # The file tier's residency belongs to this thread: its events are taken
        # here, after each operation, and handed over in order with the results.
        assert self._file is not None
        if self._events is not None and (events := self._file.take_events()):
            self._results.append(("events", (), events))

    def _start_read(self, keys: tuple[bytes, ...], rows: list[memoryview]) -> None:
        assert self._file is not None
        try:
            comp = self._file.load(keys, rows)
        except KVTierError as exc:
            log.warning("file tier refused a read of %d blocks: %s", len(keys), exc)
            self._results.append(("promoted", keys, frozenset()))
            return

        def done(c: Completion[Any]) -> None:
            self._post_file_events()
            if (exc := c.exception()) is not None:
                log.warning("file tier read of %d blocks failed: %s", len(keys), exc)
                self._results.append(("promoted", keys, frozenset()))
                return
            result = c.result()
            for key, err in list(result.missing.items())[:3]:
                log.warning("block %s not loaded from the file tier: %s", key.hex(), err)
            self._results.append(("promoted", keys, frozenset(result.loaded)))

        comp.add_done_callback(done)

    def _start_write(self, keys: tuple[bytes, ...], rows: list[memoryview]) -> None:
        assert self._file is not None
        try:
            comp = self._file.store(keys, rows)
        except KVTierError as exc:
            log.warning("file tier refused %d blocks: %s", len(keys), exc)
            self._results.append(("written", keys, len(keys)))
            return
        self._post_file_events()  # the blocks this store evicted

        def done(c: Completion[Any]) -> None:
            self._post_file_events()
            exc = c.exception()
            failed = len(keys) if exc is not None else len(c.result().failed)
            if exc is not None:
                log.warning("file tier write of %d blocks failed: %s", len(keys), exc)
            self._results.append(("written", keys, failed))

        comp.add_done_callback(done)

    def _write_statistics(self, force: bool = False) -> None:
        path = self._settings.statistics_file
        if path is None:
            return
        text = json.dumps(self.statistics(), default=str, sort_keys=True)
        if text == self._last_stats and not force:
            return
        self._last_stats = text
        self._loop.soon(_write_atomic, str(path), text)


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
