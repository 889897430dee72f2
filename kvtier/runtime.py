"""The one front runtime: between a :class:`~kvtier.chain.Chain`'s decisions and its tiers.

Both fronts drive one chain the same way; this module is that way, written
once. A :class:`Runtime` takes the chain's intents, numbers nothing itself
(every intent carries the chain's sequence number, and its outcome names the
intent), carries them out on the tiers' event loop through a
:class:`~kvtier.tier_driver.TierDriver`, and hands the outcomes back to the
chain on the thread that owns it. It also seeds the chain with what a tier
recovered at open (:class:`~kvtier.tiers.base.Recovers`) and follows what
other instances write to a shared tier (:class:`~kvtier.tiers.base.Watched`)::

    owner thread (the chain's)                    the tiers' loop
    dispatch(): chain.take_intents() ----------->  driver.carry_out(intent)
                                                   ... tier I/O ...
    chain.settle(outcome), on_outcome(outcome) <-  outcome (same loop: at once;
                                                   else queued until drain())

Two ways to hand outcomes back, one code path:

* **inline** (the :class:`~kvtier.engine.Engine`): the chain, the front and
  the tiers share one event loop; an outcome is settled as it arrives, and
  each intent has a :class:`~kvtier.transfer.completion.Completion` that the
  front may await (:meth:`Runtime.completion`).
* **queued** (the vLLM front): the chain lives on vLLM's scheduler thread,
  which never waits; outcomes (and peers' changes, folded per key) are
  queued on the loop thread and settled by :meth:`Runtime.drain` at the
  start of every scheduler call.

It also times each lower tier's reads and writes (:class:`Busy`) and makes
the one statistics record both fronts return (:meth:`Runtime.statistics`):
a :class:`TierReport` per tier, the chain's counts with the bytes and busy
time beside them and the tier's own record, and the front's own counters
(:class:`FrontCounts`) beside those, in a :class:`FrontStatistics`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvtier.chain import (
    Chain,
    Intent,
    LowerTier,
    Outcome,
    Read,
    ReadDone,
    TierChanged,
    TierCounts,
    Write,
    Written,
)
from kvtier.config import KVTierConfig
from kvtier.errors import ProtocolError
from kvtier.manager import ManagerStatistics
from kvtier.region import CPURegion
from kvtier.tier_driver import TierDriver
from kvtier.tiers.base import Recovers, Tier, TierStatistics, Watched
from kvtier.transfer.completion import Completion

__all__ = ["Busy", "FrontCounts", "FrontStatistics", "Runtime", "TierReport", "chain_for"]

_SEED_TIMEOUT_S = 60.0


# -- statistics -------------------------------------------------------------------------


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


class Runtime:
    """Carries a chain's intents out on its tiers' loop; settles their outcomes on the chain.

    Parameters
    ----------
    chain
        The chain; called only on its owner's thread.
    tiers, names
        The open tiers below the CPU region, in the chain's order, and their names.
    region
        The CPU region whose rows the intents name.
    loop
        The event loop that owns the tiers.
    queued
        False: the owner runs on ``loop`` (outcomes settled at once). True:
        the owner is another thread (outcomes queued until :meth:`drain`).
    on_start
        Called on the loop as each intent is carried out (e.g. to track it; the
        runtime times the tiers itself, :meth:`statistics`).
    on_end
        Called on the loop as each intent's outcome arrives, before it is
        settled or queued (e.g. to time it).
    on_outcome
        Called on the owner's thread after the chain settled an outcome of an
        intent (not for :class:`~kvtier.chain.TierChanged`).
    on_tier_call
        Called on the loop after each outcome, with the tier's index (e.g. to
        take a statistics snapshot or the tier's own events, :meth:`hand_over`).
    on_handed
        Called on the owner's thread, in order with the outcomes, for each
        object :meth:`hand_over` queued.

    Notes
    -----
    Every intent gets exactly one outcome, also when a tier refuses it or
    :meth:`stop_writes` was called (a write then "fails" at once, and its
    pins go): the chain's pins are only ever released through outcomes.
    """

    def __init__(
        self,
        chain: Chain,
        tiers: Sequence[Tier],
        names: Sequence[str],
        region: CPURegion,
        loop: asyncio.AbstractEventLoop,
        *,
        queued: bool,
        on_start: Callable[[Intent], None] | None = None,
        on_end: Callable[[Outcome], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        on_tier_call: Callable[[int], None] | None = None,
        on_handed: Callable[[Any], None] | None = None,
    ) -> None:
        self.chain = chain
        self.tiers = list(tiers)
        self.names = list(names)
        self._loop = loop
        self._queued = queued
        self._on_start = on_start
        self._on_end = on_end
        self._on_outcome = on_outcome
        self._on_handed = on_handed
        self._on_tier_call = on_tier_call
        self._driver = TierDriver(tiers, names, region, self._arrived, on_tier_call)
        self._busy = [Busy() for _ in self.tiers]
        """Each lower tier's reads and writes, timed on the tiers' loop."""
        self._row_bytes = region.slice_bytes * region.world_size
        self._done: dict[int, Completion[None]] = {}
        """Inline: the completion of each intent carried out and not settled yet, by seq."""
        # Queued: filled on the loop thread, drained on the owner's. Deque
        # append and popleft are atomic: the two threads need no lock for it.
        self._queue: collections.deque[Any] = collections.deque()
        self._peer_lock = threading.Lock()
        self._peer_changes: dict[int, dict[bytes, bool]] = {}
        """Queued: peers' changes folded per key (an idle owner drains nothing,
        and a queue of every change would grow with the peers' traffic)."""
        self._writes_stopped = False
        self._seeding: set[Future[None] | asyncio.Future[None]] = set()
        self.abandoned = 0
        """Blocks of writes dropped after :meth:`stop_writes`."""
        self._dropped: set[int] = set()

    # -- owner thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Seed the chain with what the tiers recovered, and follow peers' writes.

        A tier still recovering in the background holds its write-back blocks
        in their rows (:meth:`Chain.recovering`) until its recovery ends.
        Queued: blocks until the tiers' loop has taken the calls.
        """
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, Recovers):
                if tier.recovering:  # its blocks join the chain once the scan ends
                    self.chain.recovering(i)
                    self._spawn(self._seed(i, tier))
                else:  # found at open: known before the first lookup
                    keys = self._on_loop(_recovered(tier))
                    self.chain.settle(TierChanged(i, added=tuple(keys)))
            if isinstance(tier, Watched):
                self._on_loop(_watch(tier, self._peers_callback(i)))

    def dispatch(self) -> list[Intent]:
        """Carry out what the chain decided now (writes, reads, probes); those intents."""
        intents = self.chain.take_intents()
        if not intents:
            return intents
        if self._queued:
            self._loop.call_soon_threadsafe(self._carry_out, intents)
            return intents
        out = []
        while intents:  # an outcome settled at once may lead to more
            for intent in intents:
                self._done[intent.seq] = Completion()
            self._carry_out(intents)
            out.extend(intents)
            intents = self.chain.take_intents()
        return out

    def completion(self, intent: Intent) -> Completion[None] | None:
        """Inline: done once ``intent``'s outcome is settled; None once it is (or queued)."""
        return self._done.get(intent.seq)

    def drain(self) -> bool:
        """Queued: settle what the loop handed back, in order; whether anything was."""
        chain, queue = self.chain, self._queue
        changed = False
        if self._peer_changes:
            with self._peer_lock:
                changes, self._peer_changes = self._peer_changes, {}
            for index, keys in changes.items():
                chain.settle(
                    TierChanged(
                        index,
                        added=tuple(k for k, there in keys.items() if there),
                        removed=tuple(k for k, there in keys.items() if not there),
                    )
                )
            changed = True
        while queue:
            item = queue.popleft()
            changed = True
            if isinstance(item, _Handed):
                if self._on_handed is not None:
                    self._on_handed(item.value)
            else:
                self._settle(item)
        return changed

    def stop_writes(self) -> None:
        """From now on no write goes to a lower tier (a close past its timeout).

        Writes still to carry out end at once as failed: their pins go, their
        blocks are counted in :attr:`abandoned`.
        """
        self._writes_stopped = True

    def cancel_seeding(self) -> None:
        """Stop waiting for recoveries (at close)."""
        for task in list(self._seeding):
            task.cancel()

    def statistics(
        self,
        counts: FrontCounts,
        records: Sequence[TierStatistics],
        *,
        cpu_busy: Busy | None = None,
        in_flight: int = 0,
    ) -> FrontStatistics:
        """The front's statistics now: the chain's counts per tier, their bytes and busy
        time, each tier's own record, and the front's ``counts``.

        ``records`` are the lower tiers' own records, in order (taken where the
        tiers run); ``cpu_busy`` times the CPU tier's device copies, where the
        front runs them.
        """
        chain = self.chain.statistics()
        counted = chain.tiers
        cpu = self._report(self.chain.cpu_statistics(), counted["cpu"], cpu_busy)
        tiers: dict[str, TierReport[Any]] = {"cpu": cpu}
        for name, record, busy in zip(self.names, records, self._busy, strict=True):
            tiers[name] = self._report(record, counted[name], busy)
        return FrontStatistics(
            tiers=tiers,
            lookups=chain.lookups,
            lookup_misses=counts.lookup_misses,
            stores=counts.stores,
            loads=counts.loads,
            store_refusals=chain.store_refusals,
            dropped=counts.dropped,
            load_shortfalls=counts.load_shortfalls,
            deadline_misses=chain.deadline_misses,
            row_limit_misses=chain.row_limit_misses,
            loads_declined=chain.loads_declined,
            recompute_s_per_block=chain.recompute_s_per_block,
            rows_held_by_writes=chain.rows_held_by_writes,
            abandoned_at_close=counts.abandoned_at_close,
            in_flight=in_flight,
            events_published=counts.events_published,
            events_dropped=counts.events_dropped,
        )

    def _report(
        self, own: ManagerStatistics | TierStatistics, n: TierCounts, busy: Busy | None
    ) -> TierReport[Any]:
        row = self._row_bytes
        return TierReport(
            own,
            lookup_hits=n.lookup_hits,
            blocks_in=n.blocks_in,
            blocks_out=n.blocks_out,
            bytes_in=n.blocks_in * row,
            bytes_out=n.blocks_out * row,
            seconds_in=busy.seconds_in if busy is not None else 0.0,
            seconds_out=busy.seconds_out if busy is not None else 0.0,
            read_failures=n.read_failures,
            write_failures=n.write_failures,
            write_backs=n.write_backs,
            probes=n.probes,
            loads_declined=n.loads_declined,
            read_s_per_block=n.read_s_per_block,
        )

    # -- the tiers' loop ------------------------------------------------------------------

    def hand_over(self, value: object) -> None:
        """Queue ``value`` for :attr:`on_handed`, in order with the outcomes (loop thread)."""
        self._queue.append(_Handed(value))

    def _carry_out(self, intents: list[Intent]) -> None:
        for intent in intents:
            if self._writes_stopped and isinstance(intent, Write):
                self.abandoned += len(intent.keys)
                self._dropped.add(intent.seq)
                self._post(Written(intent, frozenset()))  # never started: not timed
                continue
            if self._on_start is not None:
                self._on_start(intent)
            if isinstance(intent, Write | Read):
                self._busy[intent.tier].begin(isinstance(intent, Write))
            self._driver.carry_out(intent)

    def _arrived(self, outcome: Outcome) -> None:
        """An outcome from the driver: timed, then settled or queued."""
        if isinstance(outcome, Written | ReadDone):
            self._busy[outcome.intent.tier].end(isinstance(outcome, Written))
        if self._on_end is not None and not isinstance(outcome, TierChanged):
            self._on_end(outcome)
        self._post(outcome)

    def _post(self, outcome: Outcome) -> None:
        if self._queued:
            self._queue.append(outcome)
        else:
            self._settle(outcome)

    def _peers_callback(self, index: int) -> _Changed:
        def changed(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
            if self._on_tier_call is not None:
                self._on_tier_call(index)
            if not self._queued:
                self.chain.settle(TierChanged(index, added=tuple(added), removed=tuple(removed)))
                return
            with self._peer_lock:
                keys = self._peer_changes.setdefault(index, {})
                for k in removed:
                    keys[k] = False
                for k in added:
                    keys[k] = True

        return changed

    async def _seed(self, index: int, tier: Recovers) -> None:
        # A failed recovery leaves the tier empty (it logs why): it takes writes again.
        with contextlib.suppress(Exception):
            await tier.wait_recovered()
        self._driver.seed(index, tier.take_recovered_keys())
        if self._on_tier_call is not None:
            self._on_tier_call(index)

    # -- inside ---------------------------------------------------------------------------

    def _settle(self, outcome: Outcome) -> None:
        """Owner's thread: the chain first, then the front, then who waits for it."""
        self.chain.settle(outcome)
        if isinstance(outcome, TierChanged):
            return
        seq = outcome.intent.seq
        done = self._done.pop(seq, None)
        try:
            if seq in self._dropped:  # never carried out: nothing for the front to count
                self._dropped.discard(seq)
            elif self._on_outcome is not None:
                self._on_outcome(outcome)
        finally:
            if done is not None:
                done.set_result(None)
            if not self._queued:
                # What the outcome led to (promote_up writes, reads held behind a
                # write-back) goes out now.
                self.dispatch()

    def _spawn(self, coro: Any) -> None:
        task: Future[None] | asyncio.Future[None]
        if self._queued:  # cancelling this future cancels the task on the loop
            task = asyncio.run_coroutine_threadsafe(coro, self._loop)
        else:
            task = asyncio.ensure_future(coro, loop=self._loop)
        self._seeding.add(task)
        task.add_done_callback(self._seeding.discard)

    def _on_loop(self, coro: Any) -> Any:
        """Run ``coro`` on the tiers' loop and return its result (queued: blocking)."""
        if not self._queued:
            # Inline: the owner is on the loop, and these are quick, synchronous calls.
            return _run_now(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_SEED_TIMEOUT_S)


def chain_for(
    config: KVTierConfig,
    tiers: Sequence[Tier],
    rows: int,
    *,
    lookup_deadline_s: float,
    measure_recompute: bool,
    enable_events: bool = False,
) -> Chain:
    """The chain of ``config`` over its open ``tiers`` (as the factory opened them), for
    either front: each lower tier's role from its config (write policy, promotion
    up) and from the tier (shared), the CPU tier of ``rows`` rows and its policy, the
    load-or-recompute decision.

    Parameters
    ----------
    lookup_deadline_s
        How long a lookup may wait on a lower tier (vLLM's; the Engine waits in
        its own load instead: ``math.inf``).
    measure_recompute
        Whether the front's stores follow the compute that made the blocks
        (vLLM's), so that the recompute cost can be measured from them.
    """
    specs = config.chain
    if len(specs) != len(tiers):  # pragma: no cover - the factory opens one per spec
        raise ProtocolError(f"{len(tiers)} tiers opened for a chain of {len(specs)}")
    return Chain(
        rows,
        [
            LowerTier(
                name,
                shared=tier.shared,
                promote_up=i > 0 and spec.promotes_up,
                write_back=spec.write_policy == "write_back",
            )
            for i, ((name, spec), tier) in enumerate(zip(specs, tiers, strict=True))
        ],
        lookup_deadline_s=lookup_deadline_s,
        policy=config.eviction_policy,
        enable_events=enable_events,
        decline_slow_loads=config.decline_slow_loads or config.recompute_s_per_block is not None,
        recompute_s_per_block=config.recompute_s_per_block,
        measure_recompute=measure_recompute,
    )


class _Handed:
    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


async def _recovered(tier: Recovers) -> list[bytes]:
    return tier.take_recovered_keys()


_Changed = Callable[[Sequence[bytes], Sequence[bytes]], None]


async def _watch(tier: Watched, callback: _Changed) -> None:
    tier.watch(callback)


def _run_now(coro: Any) -> Any:
    """Run a coroutine that never suspends, synchronously (it must not await anything pending)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a runtime call on the owner's loop suspended")  # pragma: no cover
