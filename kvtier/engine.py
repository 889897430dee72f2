"""The engine: what a serving loop embeds.

It is the asyncio front of the chain of tiers (:class:`~kvtier.chain.Chain`,
the same one the vLLM front drives: which key lives where, which copy is
ready, which row is pinned, the cascade), and of the data plane: the device
copies it runs itself, the tiers below the CPU region (file, cluster) through
the front runtime (:class:`~kvtier.runtime.Runtime`, inline: the chain's
intents carried out and their outcomes settled on this loop). Decisions are made
synchronously, before the first ``await`` of a call, so a ``lookup`` followed
at once by a ``load`` cannot lose a block in between; the bytes move afterwards,
and every state change that depends on the hardware happens in a completion
callback, never after an ``await`` that a cancelled task would skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Self

import numpy as np

from kvtier._native_status import warn_if_missing
from kvtier.chain import (
    Chain,
    Intent,
    LowerTier,
    Outcome,
    ReadDone,
    Write,
)
from kvtier.config import KVTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    ClosedError,
    ConfigurationError,
    InvalidArgumentError,
    LayoutError,
    ProtocolError,
)
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.manager import StorePlan
from kvtier.region import CPURegion
from kvtier.runtime import Busy, FrontCounts, FrontStatistics, Runtime
from kvtier.tiers.base import Refreshable, Tier
from kvtier.tiers.factory import aclose_tiers, open_tiers
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import (
    DeviceTransfer,
    RunsNow,
    check_block_ids,
    open_device_transfer,
)
from kvtier.transfer.io_engine import IOEngine
from kvtier.workers.group import WorkerGroup

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "StoreSummary"]

log = logging.getLogger("kvtier.engine")

BlockIds = Sequence[int] | np.ndarray | Mapping[int, Sequence[int] | np.ndarray]
"""Device block ids: one sequence used by every KV group, or one per group id."""

_Ids = dict[int, np.ndarray]
"""Validated device block ids, per KV group of the layout."""
_Starter = Callable[[], Completion[None]]

INLINE_COPY_BYTES = 256 << 10
"""Copies of at most this many bytes on the CPU backend run on the event loop's
thread instead of crossing to the copier's thread and back.

The hop to the copier's thread and back costs the caller 70-100 us on the
development VM whatever the size (two thread switches, four loop iterations),
more than the whole work of a small request. Up to 256 KiB a copy on the loop
blocks it for no longer than that hop takes (79 us against 79 us of hop at
256 KiB; 110 against 80 at 1 MiB, 320 against 99 at 4 MiB):
``benchmarks/engine_overhead.py --sweep`` measures both sides.
"""


@dataclass(frozen=True, slots=True)
class StoreSummary:
    """What one :meth:`Engine.store` did."""

    stored: int
    """Blocks newly copied into the CPU region."""
    present: int
    """Blocks skipped because some tier already held (or was storing) them."""
    dropped: int
    """Blocks not stored because no row could be freed (all pinned or in flight)."""


@dataclass(slots=True, eq=False)
class _Link:
    """One tier of the chain below the CPU region, and how the engine drives it."""

    name: str
    """``file`` or ``cluster``: the name of its statistics."""
    tier: Tier
    write_back: bool
    """Written when the CPU tier evicts a block (and at close), not at store."""
    promote_up: bool
    """Blocks promoted from this tier are also given to the tiers above it."""


@dataclass(slots=True, eq=False)
class _Job:
    """Bytes on their way into CPU rows (a device store or a file promotion)."""

    keys: tuple[bytes, ...]
    done: Completion[None]
    ok: set[bytes] = field(default_factory=set)
    claims: list[_Load] = field(default_factory=list)
    """Loads waiting for these blocks. Each takes its own (pins them, starts
    their copy) when the job finishes, before ``done`` resolves: nothing else
    runs in between that could evict them (:meth:`Engine._finish`)."""


@dataclass(slots=True, eq=False)
class _Load:
    """One :meth:`Engine.load` under way."""

    index: dict[bytes, int]
    """Position of each key in the call."""
    ids: _Ids
    skip: int
    end: int
    """Where the prefix ends: the first key known to be a miss (else all keys)."""
    todo: list[bytes]
    """Keys not started yet (waiting for rows to be promoted into), in call order."""
    waits: dict[_Job, list[bytes]] = field(default_factory=dict)
    """Jobs in flight (stores, promotions) and the keys this load takes from each."""
    promoted: set[bytes] = field(default_factory=set)
    """Keys this load promoted itself: if the read fails, they are misses."""
    copies: list[Completion[None]] = field(default_factory=list)
    """Its copies to the device, each done once its rows are unpinned."""
    error: BaseException | None = None
    """The first failed copy's error."""


class Engine:
    """Tiered KV block storage for one serving instance (the scheduler side).

    The device copies run in this process (``kv_caches``), or in one worker
    process per tensor-parallel rank (``workers=``, :mod:`kvtier.workers`).

    Open it with :meth:`open`; close it with :meth:`aclose` or ``async with``::

        async with await Engine.open(config, layout, kv_caches) as engine:
            keys = chain_keys(tokens, engine.block_tokens, engine.namespace)
            hits = engine.lookup(keys)
            loaded = await engine.load(keys[:hits], device_block_ids)
            await engine.store(keys, device_block_ids)

    Notes
    -----
    *Tiers.* Stores copy device blocks into rows of the CPU region; with a file
    tier, ``write_through`` also writes them to files (awaited by :meth:`flush`),
    ``write_back`` writes a row to its file only when the CPU tier evicts it.
    Loads copy CPU rows to the device; a block only on file is first promoted
    into a CPU row, once, however many loads ask for it at the same time.
    Stores and loads of more blocks than the CPU tier has rows stream through
    them, awaiting room (:meth:`store`, :meth:`load`).

    *Pinning.* A block being loaded is pinned in its tier until the copy that
    reads it has finished; a pinned block is never evicted. A block being
    written is not readable: :meth:`lookup` counts a block whose store is in
    flight in this engine, and a :meth:`load` of it waits for that store.

    *Cancellation.* Cancelling a task awaiting :meth:`store` or :meth:`load`
    never leaves a block pinned, and rows stay reserved until the hardware is
    done with them. A cancelled store publishes nothing, since the caller may
    reuse its device blocks at once. A cancelled load leaves its device blocks
    in an unspecified state.

    *Threads.* On the CPU backend a copy of at most
    :data:`INLINE_COPY_BYTES` runs on the event loop's thread (crossing to
    the copier's thread and back would cost more); larger ones, and every
    CUDA copy, run on the copier's threads. Each :meth:`store` and
    :meth:`load` lets other tasks run at least once either way.

    *Failures.* A failure in a tier of the chain (the file tier full, an I/O
    error, a checksum mismatch, a cluster node down, a value vanished)
    degrades to a miss or a skipped write, counted in :meth:`statistics` and
    logged; it never touches the CPU tier's ready blocks.
    """

    def __init__(
        self,
        config: KVTierConfig,
        layout: KVLayout,
        region: CPURegion,
        transfer: DeviceTransfer,
        tiers: Sequence[Tier],
    ) -> None:
        """Assemble opened parts; use :meth:`open` instead.

        ``tiers`` are the opened tiers of ``config.chain``, in its order.
        """
        self._config = config
        self._layout = layout
        self._region = region
        self._xfer = transfer
        # Small copies run on this thread (:meth:`_copy`). Only on the CPU
        # backend: a CUDA copy waits for the work queued on the caller's stream
        # (a forward pass), which must never block the loop.
        self._run_now = (
            transfer.run_now
            if transfer.backend == "cpu" and isinstance(transfer, RunsNow)
            else None
        )
        specs = config.chain
        if len(specs) != len(tiers):  # pragma: no cover - open builds one from the other
            raise ProtocolError(f"{len(tiers)} tiers opened for a chain of {len(specs)}")
        self._links: tuple[_Link, ...] = tuple(
            _Link(
                name,
                tier,
                write_back=spec.write_policy == "write_back",
                promote_up=i > 0 and spec.promotes_up,
            )
            for i, ((name, spec), tier) in enumerate(zip(specs, tiers, strict=True))
        )
        # The cascade (write-through, write-back on eviction, promotion, a lower
        # tier's failure as a miss) is the chain's, as under vLLM; the engine
        # carries its intents out with awaitables (the runtime, inline).
        self._chain = Chain(
            region.rows,
            [
                LowerTier(
                    link.name,
                    shared=link.tier.shared,
                    promote_up=link.promote_up,
                    write_back=link.write_back,
                )
                for link in self._links
            ],
            lookup_deadline_s=math.inf,
            policy=config.eviction_policy,
            decline_slow_loads=config.decline_slow_loads
            or config.recompute_s_per_block is not None,
            # The caller computes: the Engine never sees it, so only a set cost declines.
            recompute_s_per_block=config.recompute_s_per_block,
        )
        self._runtime = Runtime(
            self._chain,
            tiers,
            [link.name for link in self._links],
            region,
            asyncio.get_running_loop(),
            queued=False,
            on_start=self._began,
            on_outcome=self._outcome,
        )
        self._read_jobs: dict[int, _Job] = {}
        """The job of each promotion's read, by the read's sequence number."""
        self._bpc = layout.blocks_per_chunk
        # Every rank's slice of a row moves with each block (one slice in one process).
        self._row_bytes = layout.bytes_per_chunk * region.world_size
        self._inflight: dict[bytes, _Job] = {}
        self._pending: set[Completion[None]] = set()
        self._writes: set[Completion[None]] = set()
        """Writes to lower tiers in flight."""
        self._closed = False
        self._abandoning = False
        """Set once aclose's timeout has passed: no more writes to lower tiers."""
        self._close_task: asyncio.Task[None] | None = None
        self._cpu_busy = Busy()
        """The CPU tier's device copies, timed (the runtime times the lower tiers)."""
        self._counts = FrontCounts()
        """What the engine counts itself, beside the chain (:meth:`statistics`)."""
        self._runtime.start()  # what the tiers recovered; peers followed

    # -- the chain's intents and outcomes -------------------------------------------------

    def _dispatch(self) -> None:
        """Carry out what the chain decided (writes, reads, probes), each with a completion."""
        self._runtime.dispatch()

    def _began(self, intent: Intent) -> None:
        """An intent goes to its tier (the runtime's ``on_start``): writes are tracked
        (a close waits for them)."""
        if isinstance(intent, Write) and (done := self._runtime.completion(intent)) is not None:
            self._writes.add(done)
            done.add_done_callback(self._writes.discard)

    def _outcome(self, outcome: Outcome) -> None:
        """An intent's outcome, once the chain has it (the runtime's ``on_outcome``)."""
        if isinstance(outcome, ReadDone):
            self._read_done(outcome)

    def _read_done(self, done: ReadDone) -> None:
        """A promotion's read ended: the chain made its blocks ready (or misses)."""
        read = done.intent
        good = [k for k in read.keys if k in done.loaded]
        job = self._read_jobs.pop(read.seq, None)
        if job is None:  # pragma: no cover - every read is the engine's
            return
        job.ok.update(good)
        for k in read.keys:
            if self._inflight.get(k) is job:
                del self._inflight[k]
        self._finish(job)  # the loads waiting take their blocks before anything else runs

    # -- opening and closing ------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        config: KVTierConfig,
        layout: KVLayout,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | None = None,
        *,
        workers: WorkerGroup | None = None,
        worker_timeout: float = 60.0,
        backend: Literal["auto", "cpu", "cuda"] = "auto",
        io_engine: IOEngine | None = None,
        wrap_transfer: Callable[[DeviceTransfer], DeviceTransfer] | None = None,
    ) -> Engine:
        """Map the CPU region, open the tiers below it and the device copier (or the workers).

        Parameters
        ----------
        config
            The instance configuration.
        layout
            The layout of ``kv_caches`` (:meth:`KVLayout.from_tensors`); with
            ``workers``, the layout of one rank (``tp_size`` = world size; the
            rank does not matter): keys and the file tier cover whole rows.
        kv_caches
            The serving engine's KV tensors, in the layout's order; None with
            ``workers`` (the tensors live in the worker processes).
        workers
            The scheduler side of a split instance
            (:meth:`kvtier.workers.WorkerGroup.bind`): the engine creates the
            shared CPU region mapped whole (every rank's slice), waits for one
            worker per rank to register and attach it, sends every copy job to
            all of them, and closes the group with itself.
        worker_timeout
            Seconds to wait for every rank to register and attach.
        backend
            Device copier: ``cuda`` streams, ``cpu`` threads, or ``auto``
            (in-process only; each worker picks its own).
        io_engine
            An I/O engine for the file tier to share (the engine does not close
            it); by default the file tier opens its own from the configuration.
            The tiers of ``config.chain`` open in order, and those opened
            before a failure are closed again.
        wrap_transfer
            Called with the device copier; the engine uses what it returns.
            For instrumentation and fault injection
            (:class:`kvtier.testing.faults.FaultyDeviceTransfer`).

        Raises
        ------
        ConfigurationError
            When ``config`` and ``layout`` disagree (``blocks_per_chunk``), or
            ``config.world_size`` is not 1 without ``workers`` (not the
            group's and the layout's world size with them), or with a cluster
            tier but without the ``redis`` client (``kvtier[cluster]``).
        LayoutError
            For a layout with ``tp_size > 1`` without ``workers``: one engine
            per tensor-parallel rank would share the file tier's namespace.
        InvalidArgumentError
            ``kv_caches`` missing without ``workers``, or given with them.
        WorkerError
            Not every rank registered and attached within ``worker_timeout``.
        CapacityError
            When the CPU budget is below one row.
        TierIOError, DirectIOUnsupportedError
            When the file tier's root cannot be used, or no node of the
            cluster tier answers (or it refuses the credentials).

        Notes
        -----
        Everything opened before a failure is closed again before the error
        propagates. A compiled part of kvtier that is not built is warned of
        once per process (:class:`~kvtier._native_status.NativeExtensionWarning`).
        """
        warn_if_missing()  # slower fallbacks say so at first use, not silently
        _check_chunking(config, layout)
        if workers is not None:
            return await cls._open_split(
                config, layout, kv_caches, workers, worker_timeout, io_engine, wrap_transfer
            )
        if kv_caches is None:
            raise InvalidArgumentError("kv_caches is required (or workers= for a split instance)")
        if config.world_size != 1:
            raise ConfigurationError(
                "Engine drives one worker; for world_size > 1 open a shared CPURegion per "
                "worker (kvtier.region) and drive it directly"
            )
        if layout.tp_size != 1:
            # A block key and the file tier's namespace cover a whole row, every
            # rank's slice: one Engine per rank would store one slice under keys
            # that every rank shares, and serve it to the others.
            raise LayoutError(
                f"the layout is rank {layout.tp_rank} of tp_size={layout.tp_size}, but Engine "
                "holds one worker's whole row: engines of several ranks would share one "
                "namespace and load each other's slices. Open it with the layout of one "
                "worker that holds every rank's KV (tp_size=1)"
            )
        alignment = config.row_alignment
        region = CPURegion.create(layout, int(config.cpu_bytes_to_use), alignment=alignment)
        transfer: DeviceTransfer | None = None
        try:
            transfer = open_device_transfer(
                layout, kv_caches, region.tensor_views(), backend=backend
            )
            if wrap_transfer is not None:
                transfer = wrap_transfer(transfer)
            tiers = await open_tiers(config, layout, region, io_engine=io_engine)
        except BaseException:
            if transfer is not None:
                await transfer.aclose()
            region.close()
            raise
        return cls(config, layout, region, transfer, tiers)

    @classmethod
    async def _open_split(
        cls,
        config: KVTierConfig,
        layout: KVLayout,
        kv_caches: object,
        workers: WorkerGroup,
        worker_timeout: float,
        io_engine: IOEngine | None,
        wrap_transfer: Callable[[DeviceTransfer], DeviceTransfer] | None,
    ) -> Engine:
        """The scheduler of a split instance: the region whole, copies by the workers."""
        try:
            if kv_caches is not None:
                raise InvalidArgumentError(
                    "with workers=, the KV tensors live in the worker processes: pass no kv_caches"
                )
            world = workers.world_size
            _check_chunking(config, layout)
            if config.world_size != world or layout.tp_size != world:
                raise ConfigurationError(
                    f"the worker group has {world} ranks, config.world_size is "
                    f"{config.world_size} and the layout's tp_size is {layout.tp_size}: all "
                    "three must agree"
                )
            if isinstance(worker_timeout, bool) or not isinstance(worker_timeout, int | float):
                raise InvalidArgumentError(
                    f"worker_timeout must be a number, got {worker_timeout!r}"
                )
            name = config.shared_region_name or f"i{workers.instance.hex()}"
            alignment = config.row_alignment
            budget = int(config.cpu_bytes_to_use)
            region = await asyncio.to_thread(
                CPURegion.create,
                layout,
                budget,
                world_size=world,
                rank=None,
                shared_name=name,
                instance=workers.instance,
                alignment=alignment,
            )
        except BaseException:
            await workers.aclose()
            raise
        transfer: DeviceTransfer = workers
        try:
            await workers.start(layout, region, budget, float(worker_timeout))
            if wrap_transfer is not None:
                transfer = wrap_transfer(transfer)
            tiers = await open_tiers(config, layout, region, io_engine=io_engine)
        except BaseException:
            await transfer.aclose()
            region.close()
            raise
        return cls(config, layout, region, transfer, tiers)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # A deadline on draining, not on the call: past it, aclose still releases all.
    async def aclose(self, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        """Finish the work in flight, then release every resource. Idempotent.

        Parameters
        ----------
        timeout
            Seconds to wait for stores, loads and writes to lower tiers in
            flight, and for the write-through and write-back they lead to.
            Past it, blocks not yet handed to the lower tiers are abandoned:
            each is counted in ``FrontStatistics.abandoned_at_close`` and a
            warning names how many. Writes already handed to a tier, and
            copies handed to hardware, are still waited for before memory is
            unmapped.

        Raises
        ------
        InvalidArgumentError
            When ``timeout`` is not a number ``>= 0``; the engine stays open.

        Notes
        -----
        New calls raise :class:`~kvtier.errors.ClosedError` from the start of
        the close, but what is already running goes on: a store whose copy
        completes during the close is still written through. Each
        ``write_back`` tier is given the blocks whose only copy is their CPU
        row (within ``timeout``), so a clean close loses nothing.
        Concurrent calls share one close; every caller returns when it is
        done.
        """
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidArgumentError(f"timeout must be a number of seconds, got {timeout!r}")
        if not timeout >= 0:  # also NaN
            raise InvalidArgumentError(f"timeout must be >= 0, got {timeout}")
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._close(float(timeout)))
        await asyncio.shield(self._close_task)

    async def _close(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await self._settle_until(deadline)
        if time.monotonic() < deadline:
            # Each write-back tier is given the blocks whose only copy is their row.
            self._chain.write_back()
            self._dispatch()
        await self._settle_until(deadline)
        # From here on nothing new goes to a lower tier: what a copy still
        # running would write through, and what is still dirty, is abandoned.
        self._abandoning = True
        self._runtime.stop_writes()
        if left := self._chain.abandon():
            self._counts.abandoned_at_close += left
            log.warning(
                "aclose: %d blocks not written to the lower tiers (timeout reached); "
                "they are lost with the CPU region",
                left,
            )
        late = [c for c in self._unfinished() if c not in self._writes]
        if late:
            log.warning("aclose: %d jobs still running after %.1fs", len(late), seconds)
        self._runtime.cancel_seeding()
        self._abandon_count(self._runtime.abandoned)
        try:
            # The copier and the ring wait for what they handed to hardware, so the
            # region is unmapped only after nothing can touch it any more.
            await self._xfer.aclose()
            links = self._links
            await aclose_tiers([link.tier for link in links], [link.name for link in links])
        finally:
            self._region.close()

    def _abandon(self, keys: Sequence[bytes]) -> None:
        """Count and report blocks that aclose will not write to the lower tiers."""
        self._abandon_count(len(keys))

    def _abandon_count(self, count: int) -> None:
        if count:
            self._counts.abandoned_at_close += count
            log.warning(
                "aclose: %d blocks not written to the lower tiers (timeout reached); "
                "they are lost with the CPU region",
                count,
            )

    def _unfinished(self) -> list[Completion[None]]:
        """Every tracked completion not done yet (copies, promotions, tier writes)."""
        jobs = {j.done for j in self._inflight.values()}
        return [c for c in (*self._writes, *jobs, *self._pending) if not c.done()]

    async def _settle_until(self, deadline: float) -> bool:
        """Wait until nothing tracked is running, or ``deadline``; True when idle.

        Only what is not done yet is awaited: awaiting a done completion does
        not yield, and a done write leaves its set only when its callback has
        run, so waiting on those would spin without letting the callback run.
        Work that ends starts more (a store's copy, its write-through): the
        loop looks again until nothing is left. Every tracked completion
        resolves after the state changes of its step (rows unpinned, blocks
        completed), so nothing is left to run once none is pending.
        """
        while pending := self._unfinished():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await _wait(pending, seconds=None if math.isinf(left) else left)
        return True

    # -- properties ---------------------------------------------------------------------

    @property
    def layout(self) -> KVLayout:
        """The KV layout this engine stores."""
        return self._layout

    @property
    def config(self) -> KVTierConfig:
        """The configuration it was opened with."""
        return self._config

    @property
    def block_tokens(self) -> int:
        """Tokens per offloaded block: pass it to :func:`kvtier.chain_keys`."""
        return self._layout.offload_block_tokens

    @property
    def namespace(self) -> bytes:
        """The key namespace of this layout: pass it to :func:`kvtier.chain_keys`."""
        return self._layout.namespace

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has been called."""
        return self._closed

    # -- lookup -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` loadable from some tier.

        Never blocks and does no I/O. The keys are looked for in the CPU
        tier, then in each tier of the chain in order (file, cluster); a
        block whose store or promotion is in flight in this engine counts: a
        :meth:`load` of it waits for it. A shared tier answers from what this
        instance knows (the cluster tier's presence set): :meth:`refresh`
        asks it first.

        Raises
        ------
        InvalidArgumentError
            For keys that are not distinct 16-byte ``bytes``.
        ClosedError
            After :meth:`aclose`.
        """
        self._check_open()
        check_keys(keys)
        # The chain walks the tiers and credits each; the first key ends up most
        # recently used, so prefixes outlive tails.
        n = self._chain.prefix(keys, self._inflight)
        self._counts.lookup_misses += len(keys) - n
        return n

    async def refresh(self, keys: Sequence[bytes]) -> int:
        """:meth:`lookup`, after asking the shared tiers about the keys no tier knows.

        Each tier of the chain that can learn what peers stored (the cluster
        tier: one pipelined ``EXISTS`` per node) is asked about the keys past
        the prefix that the CPU tier and the tiers above it hold; then the
        lookup is counted as :meth:`lookup` counts it. Without such a tier it
        is :meth:`lookup`.

        Raises
        ------
        InvalidArgumentError
            For keys that are not distinct 16-byte ``bytes``.
        ClosedError
            After :meth:`aclose`.

        Notes
        -----
        A node that fails to answer leaves its keys unknown: no error. Costs
        about one round trip (1-2 ms for a 32-key request on loopback); call
        it once per request where peers' blocks matter, and :meth:`lookup`
        on the hot path otherwise. Cancelling the caller abandons the
        answer, never a transfer.
        """
        self._check_open()
        check_keys(keys)
        known = 0
        for i, link in enumerate(self._links):
            if isinstance(link.tier, Refreshable):
                known = self._chain.known(keys, known, i, self._inflight)
                if known < len(keys):
                    probe = self._chain.probe(i, keys[known:])
                    self._dispatch()
                    if (done := self._runtime.completion(probe)) is not None:
                        await done
                    self._check_open()
        return self.lookup(keys)

    # -- store --------------------------------------------------------------------------

    async def store(self, keys: Sequence[bytes], device_block_ids: BlockIds) -> StoreSummary:
        """Copy device blocks into the CPU tier (and the file tier, by policy).

        Parameters
        ----------
        keys
            One key per offloaded block.
        device_block_ids
            ``len(keys) * blocks_per_chunk`` device block ids (per KV group, or
            one sequence for all groups), in key order.

        Returns
        -------
        StoreSummary
            How many blocks were stored, already present, or dropped for room.

        Raises
        ------
        InvalidArgumentError
            For bad keys, or block ids of the wrong count, out of range,
            duplicated, or missing a KV group. Nothing is changed.
        TransferError
            When a device copy fails; the blocks of that copy do not become
            visible.
        ClosedError
            After :meth:`aclose`.

        Notes
        -----
        Returns once every block is in a CPU row; under ``write_through`` the
        file writes go on in the background (:meth:`flush` waits for them).
        The device blocks must not change until this returns.

        *More blocks than the CPU tier can take at once.* With a lower tier
        that accepts stores (file or cluster), the blocks stream through the
        CPU rows: as many as there is room for are copied, their rows reach
        the lower tiers (written through, or written back when evicted), and
        the rows are reused for the next ones; the call waits for room
        meanwhile instead of dropping. The CPU tier keeps the last blocks, the
        lower tiers all of them. Without one (no lower tier, or only a file
        tier still recovering) the leading blocks that fit are stored and the
        rest are dropped: a prefix is what a later request can hit.

        *Cancellation.* The blocks whose copy is running when the awaiting
        task is cancelled are discarded once the copy has finished (the
        caller may reuse the device blocks at once); those of earlier copies
        of the same call had finished and stay stored.
        """
        self._check_open()
        check_keys(keys)
        ids = check_block_ids(self._layout, device_block_ids, len(keys) * self._bpc, unique=True)
        self._counts.stores += 1
        # A key already in the CPU tier (ready or being written) needs no copy; one
        # only in a lower tier is copied anyway: it is hot now, and that tier's
        # write skips it.
        chain = self._chain
        todo, present, stored = list(keys), 0, 0
        stream = chain.streams
        while todo:
            # Looked at again each round: another store may have taken some meanwhile.
            holds = chain.holds
            fresh = [k for k in todo if not holds(k)]
            present += len(todo) - len(fresh)
            todo = fresh
            # The chain places the leading keys that the free or evictable rows
            # take; without a tier that takes what it evicts, never by evicting
            # this call's own prefix for its tail.
            own = () if len(todo) == len(keys) else keys
            plan = chain.place(todo, keep=own) if todo else None
            if plan is None:
                # Backpressure: rows held by copies, loads and file writes free up
                # when those end; waiting beats dropping blocks that fit a moment
                # later. With nothing running, no row will free up.
                if not todo or not await self._wait_for_rows():
                    break
                self._check_open()
                continue
            if len(plan.keys) == len(keys):  # all of them, in call order: the ids as given
                chosen = ids
            else:
                index = {k: i for i, k in enumerate(keys)}
                chosen = _chunk_ids(ids, [index[k] for k in plan.keys], self._bpc)
            await self._copy_in(plan, chosen)
            stored += len(plan.keys)
            placed = set(plan.keys)
            todo = [k for k in todo if k not in placed]
            if not stream:
                break  # no lower tier: reusing rows would evict this call's own prefix
        self._counts.dropped += len(todo)
        return StoreSummary(stored, present, len(todo))

    async def _copy_in(self, plan: StorePlan, chosen: _Ids) -> None:
        """Copy device blocks into the rows of ``plan``; publish them when done."""
        job = _Job(plan.keys, Completion())
        cancelled = False
        inflight = self._inflight
        for k in plan.keys:
            inflight[k] = job
        self._cpu_busy.begin(True)

        def copied(c: Completion[None]) -> None:
            ok = c.exception() is None and not cancelled
            self._cpu_busy.end(True)
            # Ready in the CPU tier, and written through (or marked for write-back).
            self._chain.stored(plan.keys, ok, write_down=not self._abandoning)
            for k in plan.keys:
                self._inflight.pop(k, None)
            try:
                if ok:
                    job.ok.update(plan.keys)
                    if self._abandoning and self._links:
                        self._abandon(plan.keys)
                    self._dispatch()
            finally:
                self._finish(job)

        copy = self._after_claim(plan, lambda: self._copy(True, plan.slots, chosen))
        if copy.done():
            # Copied on this thread (or refused at once): one turn of the loop,
            # as a copy on the copier's thread gives, so that the call is still
            # a point where other tasks run and a cancellation lands; a
            # cancelled store publishes nothing, as with a copy in flight.
            self._pending.add(job.done)
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                copied(copy)
                self._pending.discard(job.done)
            copy.result()  # its error, if any
            return
        copy.add_done_callback(copied)
        self._track(job.done)
        try:
            await copy
        except asyncio.CancelledError:
            cancelled = True
            raise

    def _copy(
        self, store: bool, slots: Sequence[int], ids: _Ids, skip: int = 0
    ) -> Completion[None]:
        """Start a device copy: on this thread when it is small (done on return).

        Up to :data:`INLINE_COPY_BYTES` on the CPU backend the copy runs
        here and the completion is done when this returns; else it goes to
        the copier's thread. Either way a refusal or a failed copy here
        raises (callers go through :func:`_guarded`).
        """
        run_now = self._run_now
        if run_now is not None and len(slots) * self._row_bytes <= INLINE_COPY_BYTES:
            # A second copying thread beside the copier's own: the CPU
            # copier's small requests share nothing (its helper threads serve
            # requests of 4 MiB and more only), and this one ends before any
            # other work of the loop starts.
            run_now(store, slots, ids, skip)
            done: Completion[None] = Completion()
            done.set_result(None)
            return done
        if store:
            return self._xfer.store(ids, slots)
        return self._xfer.load(slots, ids, skip)

    async def _wait_for_rows(self) -> bool:
        """Wait until some work that holds CPU rows ends; False when none is running."""
        running = [c for c in (*self._writes, *self._pending) if not c.done()]
        if running:
            await _wait(running, first=True)
        return bool(running)

    def _after_claim(self, plan: StorePlan, start: _Starter) -> Completion[None]:
        """Run ``start`` once the rows of ``plan`` may be overwritten.

        A victim whose row was its only copy is written back first (the
        chain's :meth:`~kvtier.chain.Chain.evicting_writes`); otherwise the
        rows are free at once.
        """
        writes = self._chain.evicting_writes(plan)
        if writes:
            self._dispatch()
        pending = [d for w in writes if (d := self._runtime.completion(w)) is not None]
        if not pending:
            return _guarded(start)
        out: Completion[None] = Completion()
        left = [len(pending)]

        def go(_c: Completion[None]) -> None:
            left[0] -= 1
            if left[0]:
                return
            inner = _guarded(start)
            inner.add_done_callback(
                lambda c: out.set_exception(e) if (e := c.exception()) else out.set_result(None)
            )

        for written in pending:
            written.add_done_callback(go)
        return out

    async def flush(self) -> None:
        """Wait until all work started so far has finished (or failed).

        That is every device copy, promotion and write to a lower tier, including those
        of tasks that were cancelled while awaiting :meth:`store` or
        :meth:`load`.

        Raises
        ------
        ClosedError
            After :meth:`aclose`.

        Notes
        -----
        After cancelling a load, the device blocks it named may still be
        written until its copy finishes: await ``flush()`` before handing
        those blocks to other work.
        """
        self._check_open()
        await self._settle_until(math.inf)

    # -- load ---------------------------------------------------------------------------

    async def load(self, keys: Sequence[bytes], device_block_ids: BlockIds, skip: int = 0) -> int:
        """Copy stored blocks to the device; return how many leading blocks arrived.

        Parameters
        ----------
        keys
            Keys of the offloaded blocks, in prefix order (usually
            ``keys[:engine.lookup(keys)]``).
        device_block_ids
            ``len(keys) * blocks_per_chunk - skip`` destination device block ids.
        skip
            Sub-blocks of the first offloaded block not to load (already on
            the device), ``0 <= skip < blocks_per_chunk``.

        Returns
        -------
        int
            The number of leading keys whose bytes are now on the device. A
            load is a prefix: the first block that cannot be loaded ends it,
            and that block and those after it are misses that the caller
            recomputes (their device blocks may have been written meanwhile).
            It is ``len(keys)`` unless a tier failed under the load (an I/O
            error, a checksum mismatch, a block that vanished from a shared
            tier, a cluster node down), or a block left every tier between
            the call and its turn (evicted by other work). However many blocks
            that is, the size of the CPU tier does not cut it short.

        Raises
        ------
        BlockNotFoundError
            When a key is in no tier at the time of the call. Nothing is changed.
        InvalidArgumentError
            For bad keys, ``skip`` or block ids. Nothing is changed.
        TransferError
            When a copy to the device fails; raised once every copy this call
            started has ended.
        ClosedError
            After :meth:`aclose`; also when the engine closes while this load
            still has blocks to promote.

        Notes
        -----
        *More blocks than the CPU tier can take at once.* Every block reaches
        the device through a CPU row. The blocks ready in the CPU tier are
        pinned and copied at once, before the call first yields; the others
        are promoted from the highest tier of the chain that has them, in key
        order, in windows that fit the free or evictable rows, and each window
        is copied to the device as soon as it is read, its rows released when
        the copy ends (the blocks stay in the CPU tier as long as the eviction
        policy keeps them). Meanwhile the call awaits room (back-pressure)
        instead of cutting the prefix short: ``lookup`` reporting N blocks,
        then a load of those N delivers N when nothing changed in between.
        Concurrent loads and stores share the rows without deadlock: a row is
        only ever held by work that runs on hardware and ends by itself.

        *Pinning and cancellation.* Every block read is pinned until the copy
        reading it has finished, also when the awaiting task is cancelled. A
        cancelled load's copies still run to their end and write the device
        blocks (:meth:`flush` waits for them), and the promotions it started
        still complete into CPU rows; nothing new starts.
        """
        self._check_open()
        check_keys(keys)
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip < self._bpc:
            raise InvalidArgumentError(f"skip must be an int in [0, {self._bpc}), got {skip!r}")
        if skip and not keys:
            raise InvalidArgumentError("skip needs at least one key")
        ids = check_block_ids(
            self._layout, device_block_ids, len(keys) * self._bpc - skip, unique=True
        )
        self._counts.loads += 1
        if not keys:
            return 0
        chain, inflight = self._chain, self._inflight
        ready = True  # every key ready in the CPU tier (none in flight)
        for k in keys:
            if k in inflight:
                ready = False
            elif not chain.is_ready(k):
                ready = False
                if chain.lower_of(k) is None:
                    raise BlockNotFoundError(f"block {k.hex()} is in no tier")
        chain.touch(keys)
        index = {k: i for i, k in enumerate(keys)}
        st = _Load(index, ids, skip, len(keys), [] if ready else list(keys))
        try:
            # The first round runs before the first await: what is ready now is
            # pinned and its copy started, so a lookup just before cannot lose it.
            if ready:
                self._deliver(st, list(keys))  # the first round, known to start them all
            else:
                while self._load_round(st):
                    await self._load_wait(st)
            if copies := [c for c in st.copies if not c.done()]:
                await _wait(copies)
            else:
                # Copied on this thread: one turn of the loop, as a copy on the
                # copier's thread gives (other tasks run, a cancellation lands).
                await asyncio.sleep(0)
        finally:
            for job in st.waits:
                job.claims.remove(st)
            st.waits.clear()
        if st.error is not None:
            raise st.error
        if st.end < len(keys):
            self._counts.load_shortfalls += len(keys) - st.end
        return st.end

    def _load_round(self, st: _Load) -> bool:
        """Start what a load can start now; True while it has something to wait for.

        Synchronous: nothing changes between a look at a block and the pin or
        the promotion that acts on it.
        """
        if st.error is not None:
            return False
        if st.todo and self._closed:
            raise ClosedError("the engine closed during the load")
        ready: list[bytes] = []
        promote: list[bytes] = []
        for k in st.todo:
            if st.index[k] >= st.end:
                break  # past a miss: nothing more to start
            job = self._inflight.get(k)
            if job is not None:
                self._wait_on(st, job, [k])
            elif self._chain.is_ready(k):
                ready.append(k)
            elif self._chain.lower_of(k) is not None:
                promote.append(k)
            else:
                st.end = min(st.end, st.index[k])  # it left every tier since the call
                break
        if ready:
            self._deliver(st, ready)  # pinned before a promotion below could evict them
        st.todo = self._promote_some(st, promote)
        return bool(st.todo) or any(st.index[k] < st.end for ks in st.waits.values() for k in ks)

    async def _load_wait(self, st: _Load) -> None:
        """Wait until a copy or a job of the load ends, or, while it needs rows, any work."""
        running = [c for c in st.copies if not c.done()]
        running += [job.done for job in st.waits if not job.done.done()]
        if st.todo:
            # Every row that is not free is held by a copy, a promotion, a store
            # or a tier write in flight; the first to end may free one.
            running += [c for c in (*self._writes, *self._pending) if not c.done()]
        if running:
            await _wait(running, first=True)
        elif st.todo:  # pragma: no cover - a row held by nothing running is a leaked pin
            log.error("load: no CPU row frees up for %d blocks; they are misses", len(st.todo))
            st.end = min(st.end, st.index[st.todo[0]])
            st.todo.clear()

    def _promote_some(self, st: _Load, todo: list[bytes]) -> list[bytes]:
        """Promote the leading keys of ``todo`` that rows can take (in the chain's
        windows); the rest."""
        while todo:
            placed: set[bytes] = set()
            for read in self._chain.promote(todo):
                job = _Job(read.keys, Completion())
                self._read_jobs[read.seq] = job
                for k in read.keys:
                    self._inflight[k] = job
                self._track(job.done)
                placed.update(read.keys)
                st.promoted.update(read.keys)
                self._wait_on(st, job, read.keys)
            if not placed:
                break
            self._dispatch()
            todo = [k for k in todo if k not in placed]
        return todo

    def _wait_on(self, st: _Load, job: _Job, keys: Sequence[bytes]) -> None:
        """The load takes ``keys`` from ``job`` when it finishes (:meth:`_claim`)."""
        mine = st.waits.get(job)
        if mine is None:
            mine = st.waits[job] = []
            job.claims.append(st)
        mine.extend(keys)

    def _claim(self, st: _Load, job: _Job) -> None:
        """``job`` has finished: pin the blocks the load waits for and copy them.

        Runs in the job's completion callback right after its blocks became
        ready, so nothing can evict them before they are pinned.
        """
        got: list[bytes] = []
        retry: list[bytes] = []
        for k in st.waits.pop(job, []):
            if k in job.ok and self._chain.is_ready(k):
                got.append(k)
            elif k in st.promoted:
                st.end = min(st.end, st.index[k])  # its read failed: a miss ends the prefix
            else:
                retry.append(k)  # another call's store or promotion failed: look again
        if retry:
            st.todo = sorted({*st.todo, *retry}, key=st.index.__getitem__)
        got = [k for k in got if st.index[k] < st.end]
        if got:
            self._deliver(st, got)

    def _deliver(self, st: _Load, keys: list[bytes]) -> None:
        """Pin ready blocks of a load and start their copy; unpinned when it ends."""
        if len(keys) == len(st.index):  # every key of the load: its ids as given
            keys, ids, skip = list(st.index), st.ids, st.skip
        else:
            keys.sort(key=st.index.__getitem__)
            where = [st.index[k] for k in keys]
            ids = _window_ids(st.ids, where, self._bpc, st.skip)
            skip = st.skip if where[0] == 0 else 0
        slots = self._chain.pin_for_device_load(keys)
        self._cpu_busy.begin(False)
        copy = _guarded(lambda: self._copy(False, slots, ids, skip))
        if copy.done():  # copied on this thread: unpinned before anything else runs
            self._loaded(st, keys, copy)
            return
        # What flush waits for: done only after the rows are unpinned, not when
        # the copy is (its done callbacks run a loop iteration later).
        settled: Completion[None] = Completion()

        def copied(c: Completion[None]) -> None:
            try:
                self._loaded(st, keys, c)
            finally:
                settled.set_result(None)  # never leave flush waiting

        copy.add_done_callback(copied)
        self._track(settled)
        st.copies.append(settled)

    def _loaded(self, st: _Load, keys: list[bytes], copy: Completion[None]) -> None:
        """A copy of a load ended: unpin its rows, count it, keep its error."""
        self._chain.unpin_device_load(keys)
        exc = copy.exception()
        self._cpu_busy.end(False)
        if exc is not None and st.error is None:
            st.error = exc

    def _finish(self, job: _Job) -> None:
        """Hand the blocks of a finished job to the loads waiting for them; resolve it."""
        claims, job.claims = job.claims, []
        try:
            for st in claims:
                self._claim(st, job)
        finally:
            job.done.set_result(None)

    # -- statistics and helpers ---------------------------------------------------------

    def statistics(self) -> FrontStatistics:
        """A consistent snapshot of every tier's state and traffic, and the engine's counters."""
        return self._runtime.statistics(
            self._counts,
            [link.tier.statistics() for link in self._links],
            cpu_busy=self._cpu_busy,
            in_flight=len(self._pending),
        )

    def _track(self, c: Completion[None]) -> None:
        self._pending.add(c)
        c.add_done_callback(lambda _c: self._pending.discard(c))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")


def _check_chunking(config: KVTierConfig, layout: KVLayout) -> None:
    if config.blocks_per_chunk != layout.blocks_per_chunk:
        raise ConfigurationError(
            f"config.blocks_per_chunk is {config.blocks_per_chunk} but the layout was "
            f"built with blocks_per_chunk={layout.blocks_per_chunk}"
        )


def _guarded(start: _Starter) -> Completion[None]:
    """``start()``, with a synchronous failure turned into a failed completion.

    The callers' done callbacks then roll back state on one path, whether the
    submit or the hardware failed.
    """
    try:
        return start()
    except Exception as exc:
        failed: Completion[None] = Completion()
        failed.set_exception(exc)
        return failed


async def _settle(c: Completion[None]) -> None:
    """Wait for ``c`` without raising its error."""
    with contextlib.suppress(Exception):
        await c


async def _wait(
    pending: list[Completion[None]], *, seconds: float | None = None, first: bool = False
) -> None:
    """Wait until every one (or, with ``first``, any one) of ``pending`` is done,
    or ``seconds``; their errors are not raised."""
    waits = [asyncio.ensure_future(_settle(c)) for c in pending]
    try:
        await asyncio.wait(
            waits,
            timeout=seconds,
            return_when=asyncio.FIRST_COMPLETED if first else asyncio.ALL_COMPLETED,
        )
    finally:
        for w in waits:  # what is left is only a watcher: the work itself goes on
            w.cancel()


def _chunk_ids(ids: _Ids, chunks: list[int], bpc: int) -> _Ids:
    """The device ids of the chosen offloaded blocks, in the chosen order."""
    sel = (np.asarray(chunks, dtype=np.int64)[:, None] * bpc + np.arange(bpc)).ravel()
    return {g: a[sel] for g, a in ids.items()}


def _window_ids(ids: _Ids, where: list[int], bpc: int, skip: int) -> _Ids:
    """The device ids of the offloaded blocks at positions ``where`` (ascending) of a load.

    The first block of the load has ``bpc - skip`` ids, every other ``bpc``.
    """
    at = (np.asarray(where, dtype=np.int64)[:, None] * bpc + np.arange(bpc) - skip).ravel()
    at = at[at >= 0]
    return {g: a[at] for g, a in ids.items()}
