"""The statistics records of the chain and its fronts, one level each, in one place.

A figure keeps its name from where it is counted to where a front shows it:

* :class:`TierCounts`: what the chain counted for one tier (the same
  decisions under every front), in :class:`ChainStatistics` by tier name;
* :class:`TierReport`: one tier as a front reports it: the tier's own record
  (the CPU tier's ``ManagerStatistics``, the file tier's ``FileTierStatistics``,
  ...), the chain's counts for it, and the bytes and busy time beside them
  (:class:`Busy` times them);
* :class:`FrontStatistics`: a front's snapshot: every tier's
  :class:`TierReport`, the chain's totals, and the front's own counters
  (:class:`FrontCounts`). ``kvtier.FrontStatistics`` and
  ``kvtier.TierReport`` are these.

Figures that mean something under one front only (each field says which):
``dropped``, ``load_shortfalls``, ``abandoned_at_close`` and ``in_flight``
(the Engine's); ``deadline_misses``, ``row_limit_misses``,
``events_published`` and ``events_dropped`` (vLLM's); the CPU tier's
``seconds_in`` / ``seconds_out`` (the Engine's, whose device copies it times).
:mod:`kvtier.metrics` names each figure for Prometheus.
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
    """What the chain counted for one tier (names as in :class:`ChainStatistics`)."""

    lookup_hits: int = 0
    """Keys a lookup got from this tier: the CPU tier's HITs (and, for
    :meth:`~kvtier.chain.Chain.prefix`, its blocks in flight); a lower tier's blocks read for a
    :meth:`~kvtier.chain.Chain.lookup`, or credited to it by :meth:`~kvtier.chain.Chain.prefix`."""
    blocks_in: int = 0
    """Blocks written into it (CPU: from the device; lower: writes and promotions up)."""
    blocks_out: int = 0
    """Blocks read out of it (CPU: to the device; lower: promotions into CPU rows)."""
    read_failures: int = 0
    """Blocks a read from it failed to deliver (each then read from the next tier
    below that holds it, else a miss)."""
    write_failures: int = 0
    """Blocks a write to it failed or could not start."""
    probes: int = 0
    """Keys asked of it (shared tiers)."""
    write_backs: int = 0
    """Blocks handed to it by write-back (evicted from the CPU tier, or at close)."""
    loads_declined: int = 0
    """Blocks it holds that lookups answered as misses because their read would
    have arrived later than recomputing them (the load-or-recompute decision)."""
    read_s_per_block: float | None = None
    """Seconds of reading per block it delivered lately (overlapping reads
    counted once): what a new read of it is expected to cost; None before any."""


@dataclass(frozen=True, slots=True)
class ChainStatistics:
    """A snapshot of the chain's counters."""

    tiers: dict[str, TierCounts]
    """Per tier, by name: ``cpu`` first, then the lower tiers in order."""
    lookups: int
    """Keys looked up."""
    store_refusals: int
    """Blocks a :meth:`~kvtier.chain.Chain.place` could not give a row."""
    deadline_misses: int
    """Lookups answered MISS because a read or probe outlasted the deadline
    (the key's own, or its request's: see :meth:`~kvtier.chain.Chain.lookup`)."""
    row_limit_misses: int
    """Lookups answered MISS because the request's prefix before them already
    needed every CPU row (the rest of it is recomputed)."""
    loads_declined: int
    """Lookups answered MISS because loading the block would have been slower
    than recomputing it (per tier: :attr:`TierCounts.loads_declined`)."""
    recompute_s_per_block: float | None
    """What recomputing one block costs, as set or measured; None: unknown (no
    load is declined)."""
    rows_held_by_writes: int
    """CPU rows pinned now for writes to lower tiers."""


_S = TypeVar("_S", bound=ManagerStatistics | TierStatistics)
"""A tier's own statistics record."""


@dataclass(frozen=True, slots=True)
class TierReport(Generic[_S]):
    """One tier of the chain, as a front reports it: its own record, and what moved through it.

    The counters are the chain's (the same decisions under both fronts), with
    their bytes and the time the tier was busy beside them. The CPU tier's
    traffic is device <-> CPU rows (``in``: stores, ``out``: loads); a lower
    tier's (file, cluster) is CPU rows <-> that tier (``in``: write-through,
    write-back and promotions from a tier below; ``out``: promotions into CPU
    rows).
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
    blocks_in: int = 0
    """Blocks written into the tier (completed): device blocks copied into CPU
    rows; CPU rows written to a lower tier (through, back, or promoted up)."""
    blocks_out: int = 0
    """Blocks read out of the tier: CPU rows pinned for a copy to the device
    (loads); a lower tier's blocks read and verified into CPU rows (promotions)."""
    bytes_in: int = 0
    """Payload bytes of ``blocks_in`` (a CPU row's, every rank's slice)."""
    bytes_out: int = 0
    """Payload bytes of ``blocks_out``."""
    seconds_in: float = 0.0
    """Time during which at least one write into the tier ran (overlapping jobs
    count once), so that ``bytes_in / seconds_in`` is the throughput while busy.
    A lower tier's: from each write's start to its outcome, under both fronts;
    the CPU tier's: the Engine's device copies (0 under vLLM, whose workers copy)."""
    seconds_out: float = 0.0
    """The same for reads out of the tier."""
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
    read_s_per_block: float | None = None
    """Seconds of reading per block this lower tier delivered lately (what the
    chain expects a new read to cost); None before any."""

    @property
    def gbps_in(self) -> float:
        """Throughput into this tier while it was busy, in GB/s (0 with no traffic)."""
        return self.bytes_in / self.seconds_in / 1e9 if self.seconds_in else 0.0

    @property
    def gbps_out(self) -> float:
        """Throughput out of this tier while it was busy, in GB/s (0 with no traffic)."""
        return self.bytes_out / self.seconds_out / 1e9 if self.seconds_out else 0.0


@dataclass(frozen=True, slots=True)
class FrontStatistics:
    """A snapshot of a front: every tier, and the front's own counters beside them.

    ``Engine.statistics()`` and the vLLM front's ``statistics()`` return it;
    the vLLM front's ``statistics_file`` is its :func:`dataclasses.asdict`
    (with the metrics' totals under ``metrics``). Each figure has one name;
    a figure that only one front has is 0 under the other (each says which).
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
    dropped: int
    """Blocks an Engine store gave up on: no row could be freed (Engine only)."""
    load_shortfalls: int
    """Blocks an Engine load had promised but could not deliver (an I/O or
    integrity failure, a block vanished from a shared tier, a node down, and
    no tier below the one that failed held it; Engine only)."""
    deadline_misses: int
    """Lookups answered as misses because a lower tier's read or probe, or the
    request's wait, outlasted ``lookup_deadline_s`` (vLLM only)."""
    row_limit_misses: int
    """Lookups answered as misses because the request's prefix before them
    already needed every CPU row (vLLM only)."""
    loads_declined: int
    """Lookups answered as misses because reading the block from a lower tier
    would have ended after recomputing it (per tier: ``loads_declined``)."""
    recompute_s_per_block: float | None
    """What recomputing one block costs, as set or measured; None: unknown."""
    rows_held_by_writes: int
    """CPU rows pinned now for writes to lower tiers."""
    abandoned_at_close: int
    """Blocks :meth:`~kvtier.Engine.aclose` did not write to the lower tiers
    because its timeout passed first (logged; Engine only)."""
    in_flight: int
    """Engine jobs (device copies, promotions) running now (Engine only)."""
    events_published: int
    """Keys announced in KV cache events (vLLM only)."""
    events_dropped: int
    """Keys of KV cache events dropped because nobody took them (vLLM only)."""


@dataclass(slots=True)
class FrontCounts:
    """What a front counts itself, beside the chain: :class:`FrontStatistics`'s names."""

    lookup_misses: int = 0
    stores: int = 0
    loads: int = 0
    dropped: int = 0
    load_shortfalls: int = 0
    abandoned_at_close: int = 0
    events_published: int = 0
    events_dropped: int = 0


@dataclass(slots=True)
class Busy:
    """Time during which at least one job ran, each way (overlapping jobs count once)."""

    seconds_in: float = 0.0
    seconds_out: float = 0.0
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
                self.seconds_in += busy
            else:
                self.seconds_out += busy
