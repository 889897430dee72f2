"""The statistics records of the chain and its fronts, one level each, in one place.

A figure keeps one name from where it is counted to its Prometheus series
(:mod:`kvtier.metrics` derives ``kvtier_<name>``, with ``_total`` for a
counter, from the field's name):

* a tier's own record (the CPU tier's ``ManagerStatistics``, the file tier's
  ``FileTierStatistics``, ...): what the tier itself saw;
* :class:`TierCounts`: what the chain counted for one tier (the same
  decisions under every front), in :class:`ChainStatistics` by tier name;
  :class:`TierReport` is its snapshot as a front reports it, with the tier's
  own record, the bytes, and the busy time (:class:`Busy` times it) beside;
* :class:`FrontStatistics`: a front's snapshot: every tier's
  :class:`TierReport`, the figures both fronts count (:class:`FrontCounts`),
  and the front's own record in :attr:`FrontStatistics.front` (the Engine's
  ``kvtier.EngineCounts``; the vLLM front's ``VLLMCounts``), so that no field
  is a zero under the other front. ``kvtier.FrontStatistics`` and
  ``kvtier.TierReport`` are these.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvtier.manager import ManagerStatistics
from kvtier.tiers.base import TierStatistics

__all__ = [
    "Busy",
    "ChainStatistics",
    "FrontCounts",
    "FrontStatistics",
    "TierCounts",
    "TierReport",
]


@dataclass(slots=True)
class TierCounts:
    """What the chain counted for one tier: :class:`TierReport`'s names and meanings."""

    lookup_hits: int = 0
    read_blocks: int = 0
    written_blocks: int = 0
    read_failures: int = 0
    write_failures: int = 0
    write_backs: int = 0
    probes: int = 0
    loads_declined: int = 0
    read_seconds_per_block: float | None = None


@dataclass(frozen=True, slots=True)
class ChainStatistics:
    """A snapshot of the chain's counters."""

    tiers: dict[str, TierCounts]
    """Per tier, by name: ``cpu`` first, then the lower tiers in order."""
    lookups: int
    """Keys looked up."""
    store_refusals: int
    """Blocks a :meth:`~kvtier.chain.Chain.place` could not give a row."""
    lookup_deadline_misses: int
    """Lookups answered MISS because a read or probe outlasted the deadline
    (the key's own, or its request's: see :meth:`~kvtier.chain.Chain.lookup`)."""
    lookup_row_limit_misses: int
    """Lookups answered MISS because the request's prefix before them already
    needed every CPU row, or no row came free for their read within
    ``row_wait_s`` (the rest of it is recomputed)."""
    loads_declined: int
    """Lookups answered MISS because loading the block would have been slower
    than recomputing it (per tier: :attr:`TierCounts.loads_declined`)."""
    recompute_seconds_per_block: float | None
    """What recomputing one block costs, as set (``recompute_s_per_block``) or
    measured; None: unknown (no load is declined)."""
    rows_held_by_writes: int
    """CPU rows pinned now for writes to lower tiers."""


_S = TypeVar("_S", bound=ManagerStatistics | TierStatistics)
"""A tier's own statistics record."""

_F = TypeVar("_F")
"""A front's own record (``kvtier.EngineCounts``, the vLLM front's ``VLLMCounts``)."""


@dataclass(frozen=True, slots=True)
class TierReport(Generic[_S]):
    """One tier of the chain, as a front reports it: its own record, and what moved through it.

    Each field but :attr:`statistics` is the series ``kvtier_<field>{tier=...}``
    (``_total`` added to a counter's). The counters are the chain's (the same
    decisions under both fronts). The CPU tier's traffic is device <-> CPU
    rows (written: stores, read: loads); a lower tier's (file, cluster) is CPU
    rows <-> that tier (written: write-through, write-back and promotions from
    a tier below; read: promotions into CPU rows).
    """

    statistics: _S
    """The tier's own record: the CPU tier's residency (``ManagerStatistics``:
    capacity, used, ready, pinned, evictable, evictions; its ``hits`` and
    ``misses`` are the residency manager's own), the file tier's
    ``FileTierStatistics``, the cluster tier's ``ClusterTierStatistics``
    (occupancy, verification, recovery, faults: what the tier itself saw).
    In :attr:`FrontStatistics.tiers` its type is per name, so ``Any`` there:
    ``cpu: TierReport[ManagerStatistics] = st.tiers["cpu"]`` names it."""
    lookup_hits: int = 0
    """Looked-up keys this tier served. The Engine's :meth:`~kvtier.Engine.lookup`
    credits the CPU tier with a key ready there or whose store or promotion is
    in flight, else the first lower tier that holds it; under vLLM, the CPU
    tier's hits and the blocks a lower tier's read delivered for a lookup."""
    read_blocks: int = 0
    """Blocks read out of the tier: CPU rows pinned for a copy to the device
    (loads); a lower tier's blocks read and verified into CPU rows (promotions)."""
    read_bytes: int = 0
    """Payload bytes of ``read_blocks`` (a CPU row's, every rank's slice)."""
    written_blocks: int = 0
    """Blocks written into the tier (completed): device blocks copied into CPU
    rows; CPU rows written to a lower tier (through, back, or promoted up)."""
    written_bytes: int = 0
    """Payload bytes of ``written_blocks``."""
    read_busy_seconds: float = 0.0
    """Time during which at least one read out of the tier ran (overlapping
    jobs count once), so that ``read_bytes / read_busy_seconds`` is the
    throughput while busy. A lower tier's: from each read's start to its
    outcome, under both fronts; the CPU tier's: the Engine's device copies
    (0 under vLLM, whose workers copy)."""
    write_busy_seconds: float = 0.0
    """The same for writes into the tier."""
    read_failures: int = 0
    """Blocks a read from this lower tier did not deliver (absent, vanished,
    damaged, an I/O error, the tier refusing the read): each is read from the
    next tier below that holds it (counted there too), else it is a miss."""
    write_failures: int = 0
    """Blocks whose write into this lower tier failed or could not start (an I/O
    error, no room, the tier still recovering, a close past its timeout)."""
    write_backs: int = 0
    """Blocks handed to this write-back tier (evicted from the CPU tier, or at
    close), one per block it lacked."""
    probes: int = 0
    """Keys asked of this shared tier (which of them it holds)."""
    loads_declined: int = 0
    """Blocks of this lower tier that lookups answered as misses because their
    read would have ended after recomputing them (``decline_slow_loads``)."""
    read_seconds_per_block: float | None = None
    """Seconds of reading per block this lower tier delivered lately (overlapping
    reads counted once): what the chain expects a new read to cost; None before any."""

    @property
    def read_gbps(self) -> float:
        """Throughput out of this tier while it was busy, in GB/s (0 with no traffic)."""
        return self.read_bytes / self.read_busy_seconds / 1e9 if self.read_busy_seconds else 0.0

    @property
    def write_gbps(self) -> float:
        """Throughput into this tier while it was busy, in GB/s (0 with no traffic)."""
        return (
            self.written_bytes / self.write_busy_seconds / 1e9 if self.write_busy_seconds else 0.0
        )


@dataclass(frozen=True, slots=True)
class FrontStatistics(Generic[_F]):
    """A snapshot of a front: every tier, the figures every front counts, and its own.

    ``Engine.statistics()`` and the vLLM front's ``statistics()`` return it;
    the vLLM front's ``statistics_file`` is its :func:`dataclasses.asdict`
    (with the metrics' totals under ``metrics``). Each field but
    :attr:`tiers` and :attr:`front` is the series ``kvtier_<field>``
    (``_total`` added to a counter's); so is each field of :attr:`front`.
    """

    tiers: Mapping[str, TierReport[Any]]
    """Every tier by name (``cpu``, then the chain's lower tiers in order):
    ``tiers["file"].statistics.quarantined``, ``tiers["cpu"].lookup_hits``."""
    lookups: int
    """Keys looked up: every key of an Engine :meth:`~kvtier.Engine.lookup`;
    under vLLM every lookup call (a key asked again at a later step counts again)."""
    lookup_misses: int
    """Lookups no tier served: the Engine's keys past the loadable prefix (with
    every tier's ``lookup_hits`` they add up to ``lookups``); under vLLM the
    lookups answered as a miss."""
    stores: int
    """Store calls: :meth:`~kvtier.Engine.store`; under vLLM, ``prepare_store``
    calls that placed blocks (one copy job each)."""
    loads: int
    """Load calls: :meth:`~kvtier.Engine.load`; under vLLM, ``prepare_load`` calls."""
    store_refusals: int
    """Blocks the CPU tier had no row for when offered (every row pinned or held
    by writes), counted each time: vLLM offers them again at its next step, an
    Engine store awaits room."""
    recompute_seconds_per_block: float | None
    """What recomputing one block costs, as set (``recompute_s_per_block``) or
    measured; None: unknown. Each tier's ``read_seconds_per_block`` is set against it."""
    rows_held_by_writes: int
    """CPU rows pinned now for writes to lower tiers."""
    front: _F
    """The front's own record: what only this front counts (the Engine's
    ``kvtier.EngineCounts``; the vLLM front's ``VLLMCounts``)."""


@dataclass(slots=True)
class FrontCounts:
    """What every front counts itself, beside the chain: :class:`FrontStatistics`'s names."""

    lookup_misses: int = 0
    stores: int = 0
    loads: int = 0


@dataclass(slots=True)
class Busy:
    """Time during which at least one job ran, each way (overlapping jobs count once)."""

    write_seconds: float = 0.0
    read_seconds: float = 0.0
    _active: list[int] = field(default_factory=lambda: [0, 0])  # [in, out]
    _since: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def begin(self, into: bool) -> None:
        """A job moving bytes into (or out of) the tier starts."""
        i = 0 if into else 1
        if self._active[i] == 0:
            self._since[i] = time.perf_counter()
        self._active[i] += 1

    def end(self, into: bool) -> None:
        """That job ended."""
        i = 0 if into else 1
        self._active[i] -= 1
        if self._active[i] == 0:
            busy = time.perf_counter() - self._since[i]
            if into:
                self.write_seconds += busy
            else:
                self.read_seconds += busy
