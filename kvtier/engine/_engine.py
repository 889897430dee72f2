"""The :class:`Engine`: the public calls, its parts mixed in (:mod:`kvtier.engine`)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal, Self

from kvtier.chain import FrontStatistics
from kvtier.config import KVTierConfig
from kvtier.engine._jobs import BlockIds
from kvtier.engine._load import _Loading
from kvtier.engine._open import _Opening
from kvtier.engine._statistics import EngineCounts
from kvtier.engine._store import StoreSummary, _Storing
from kvtier.errors import InvalidArgumentError
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.tiers.base import Refreshable
from kvtier.transfer.device import DeviceTransfer
from kvtier.transfer.io_engine import IOEngine
from kvtier.workers.group import WorkerGroup

if TYPE_CHECKING:
    import torch


__all__ = ["Engine"]


class Engine(_Opening, _Storing, _Loading):
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
    logged; it never touches the CPU tier's ready blocks. A block a lower
    tier fails to deliver during a load is first read from the next tier
    below that holds it: the load falls short only when none does.
    """

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
        return await cls._open(
            config,
            layout,
            kv_caches,
            workers=workers,
            worker_timeout=worker_timeout,
            backend=backend,
            io_engine=io_engine,
            wrap_transfer=wrap_transfer,
        )

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
            each is counted in ``EngineCounts.abandoned_at_close`` and a
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
        return await self._store(keys, device_block_ids)

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
        return await self._load(keys, device_block_ids, skip)

    # -- statistics ----------------------------------------------------------------------

    def statistics(self) -> FrontStatistics[EngineCounts]:
        """A consistent snapshot of every tier's state and traffic, and the engine's counters
        (its own in ``front``: :class:`~kvtier.EngineCounts`)."""
        own = replace(self._own, in_flight=len(self._pending))
        return self._runtime.statistics(self._counts, lambda _chain: own, cpu_busy=self._cpu_busy)
