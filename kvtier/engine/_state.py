"""The engine's state, and what every part of it uses.

:class:`_State` assembles the opened parts (the chain of tiers, the front
runtime that carries its intents out inline), carries out what the chain
decided, and starts the device copies (:data:`INLINE_COPY_BYTES` and smaller on
the loop's thread). The parts of :class:`~kvtier.engine.Engine` (opening and
closing, storing, loading) are its subclasses.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.chain import Busy, FrontCounts, Runtime, chain_for
from kvtier.config import KVTierConfig
from kvtier.engine._jobs import _Ids, _Job, _Link
from kvtier.engine._statistics import EngineCounts
from kvtier.errors import ClosedError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.tiers.base import Tier
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import DeviceTransfer, RunsNow

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


class _State:
    """The Engine's state and what its parts share (the parts are its subclasses)."""

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
        self._links: tuple[_Link, ...] = tuple(
            _Link(name, tier) for (name, _spec), tier in zip(config.chain, tiers, strict=True)
        )
        # The cascade (write-through, write-back on eviction, promotion, a lower
        # tier's failure read from the tier below it, else a miss) is the
        # chain's, as under vLLM; the engine carries its intents out with
        # awaitables (the runtime, inline).
        # (a load waits in the Engine, not in a lookup; the caller computes, so
        # the Engine never sees the recompute cost: only a set one declines)
        self._chain = chain_for(
            config, tiers, region.rows, lookup_deadline_s=math.inf, measure_recompute=False
        )
        self._runtime = Runtime(
            self._chain,
            tiers,
            [link.name for link in self._links],
            region,
            asyncio.get_running_loop(),
            queued=False,
        )
        self._read_jobs: dict[int, _Job] = {}
        """The job of each promotion's read, by the read's sequence number."""
        self._bpc = layout.blocks_per_chunk
        # Every rank's slice of a row moves with each block (one slice in one process).
        self._row_bytes = layout.bytes_per_chunk * region.world_size
        self._inflight: dict[bytes, _Job] = {}
        self._pending: set[Completion[None]] = set()
        self._closed = False
        self._abandoning = False
        """Set once aclose's timeout has passed: no more writes to lower tiers."""
        self._close_task: asyncio.Task[None] | None = None
        self._cpu_busy = Busy()
        """The CPU tier's device copies, timed (the runtime times the lower tiers)."""
        self._counts = FrontCounts()
        """What the engine counts as every front does, beside the chain (:meth:`statistics`)."""
        self._own = EngineCounts()
        """What only the engine counts (:meth:`statistics`' ``front``)."""
        self._runtime.start()  # what the tiers recovered; peers followed

    # -- the chain's intents and outcomes -------------------------------------------------

    def _dispatch(self) -> None:
        """Carry out what the chain decided (writes, reads, probes), each with a completion."""
        self._runtime.dispatch()

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

    def _track(self, c: Completion[None]) -> None:
        self._pending.add(c)
        c.add_done_callback(lambda _c: self._pending.discard(c))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the engine is closed")

    if TYPE_CHECKING:  # defined by the parts (the Engine mixes them in)

        def _finish(self, job: _Job) -> None: ...

        def _abandon(self, keys: Sequence[bytes]) -> None: ...
