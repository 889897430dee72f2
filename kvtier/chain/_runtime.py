"""The one runtime every front calls: between a chain's decisions and its tiers.

Every front drives one :class:`~kvtier.chain.Chain` the same way; this module
is that way, written once. A :class:`Runtime` takes the chain's intents,
numbers nothing itself (every intent carries the chain's sequence number, and
its outcome names the intent), carries them out on the tiers' event loop
through a :class:`~kvtier.chain._driver.TierDriver`, and hands the outcomes
back to the chain on the thread that owns it. It also seeds the chain with
what a tier recovered at open (:class:`~kvtier.tiers.base.Recovers`) and
follows what other instances write to a shared tier
(:class:`~kvtier.tiers.base.Watched`)::

    owner thread (the chain's)                       the tiers' loop
    dispatch(): chain.take_intents() ------------->  driver.carry_out(intent)
                                                     ... tier I/O ...
    chain.settle(outcome)                     <----  outcome (inline: at once;
                                                     queued: until drain())

Values flow one way: a front calls the runtime and gets values back; the
runtime never calls into a front. Two ways to hand outcomes back, one code path:

* **inline** (the :class:`~kvtier.engine.Engine`): the chain, the front and
  the tiers share one event loop; an outcome is settled as it arrives. Each
  intent has a :class:`Settlement`, the value the front asks for
  (:meth:`Runtime.expect`, :meth:`Runtime.completion`, :meth:`Runtime.writes`):
  awaitable, and handing the outcome on the moment the chain has settled it.
* **queued** (the vLLM front): the chain lives on vLLM's scheduler thread,
  which never waits; outcomes (and peers' changes, folded per key) are
  queued on the loop thread, and :meth:`Runtime.drain`, called at the start
  of every scheduler call, settles them and returns what it settled
  (:class:`Settled`: each outcome with how long its intent took) in order
  with each tier's own residency events (:class:`TierEvents`). Each tier's
  statistics record is taken on its loop after each of its calls
  (:meth:`Runtime.tier_statistics`).

It also times each lower tier's reads and writes (:class:`~kvtier.chain.Busy`)
and makes the one statistics record every front returns
(:meth:`Runtime.statistics`, a :class:`~kvtier.chain.FrontStatistics`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from kvtier.chain._core import Chain
from kvtier.chain._driver import TierDriver
from kvtier.chain._messages import (
    Intent,
    LowerTier,
    Outcome,
    Probe,
    Probed,
    Read,
    ReadDone,
    TierChanged,
    Write,
    Written,
)
from kvtier.chain._statistics import Busy, FrontCounts, FrontStatistics, TierCounts, TierReport
from kvtier.config import KVTierConfig
from kvtier.errors import ProtocolError
from kvtier.manager import ManagerEvent, ManagerStatistics
from kvtier.region import Rows
from kvtier.tiers.base import Announces, Recovers, Tier, TierStatistics, Watched
from kvtier.transfer.completion import Completion

__all__ = ["Arrivals", "Runtime", "Settled", "Settlement", "TierEvents", "chain_for"]

if TYPE_CHECKING:
    from kvtier.chain._statistics import ChainStatistics

_SEED_TIMEOUT_S = 60.0

_O = TypeVar("_O", Written, ReadDone, Probed)
_F = TypeVar("_F")
"""A front's own statistics record."""


class Settlement(Completion[None], Generic[_O]):
    """An intent's outcome, settled by an inline runtime (the Engine's).

    Awaitable: done once the chain has settled the outcome. :meth:`then`
    hands the outcome on at that very moment, before anything else runs on
    the loop (the done callbacks of a completion run a loop turn later, when
    a store may already have evicted the blocks a read just made ready).
    """

    __slots__ = ("_then",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._then: list[Callable[[_O], object]] = []

    def then(self, take: Callable[[_O], object]) -> None:
        """Hand the outcome to ``take`` once the chain has settled it (in order of asking)."""
        self._then.append(take)

    def _settle(self, outcome: _O) -> None:
        try:
            for take in self._then:
                take(outcome)
        finally:
            self.set_result(None)


@dataclass(frozen=True, slots=True)
class Settled:
    """An outcome the chain settled: what a queued runtime's :meth:`Runtime.drain` returns."""

    outcome: Outcome
    seconds: float | None = None
    """How long its tier call took, from its start to its outcome on the tiers'
    loop (reads and writes); None for the others, and for a write dropped after
    :meth:`Runtime.stop_writes` (never carried out)."""


@dataclass(frozen=True, slots=True)
class TierEvents:
    """A tier's own residency events, taken on its loop right after one of its calls
    (a queued runtime's ``events_from``), in order with the outcomes."""

    tier: int
    """The tier's index in the chain's lower tiers."""
    events: tuple[ManagerEvent, ...]


class Arrivals:
    """How many outcomes a queued runtime has queued; threads may wait for the next one.

    The tiers' loop counts each outcome it queues; a front's thread that waits
    for an outcome (SGLang's storage threads wait for their transfers) notes
    :attr:`count`, drains, and if what it waits for is not there yet, waits
    for the count to move past what it noted.
    """

    __slots__ = ("_cond", "count")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self.count = 0
        """Outcomes queued so far."""

    def arrived(self) -> None:
        """The tiers' loop queued an outcome."""
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_past(self, count: int, timeout: float | None) -> bool:
        """Wait until :attr:`count` moves past ``count``; False if ``timeout`` ends first."""
        with self._cond:
            return self._cond.wait_for(lambda: self.count != count, timeout)


class Runtime:
    """Carries a chain's intents out on its tiers' loop; settles their outcomes on the chain.

    Parameters
    ----------
    chain
        The chain; called only on its owner's thread.
    tiers, names
        The open tiers below the CPU region, in the chain's order, and their names.
    region
        The rows the intents name: the CPU region, or the slots of a front's
        own CPU tier (:class:`~kvtier.region.ForeignRows`).
    loop
        The event loop that owns the tiers.
    queued
        False: the owner runs on ``loop`` (outcomes settled at once). True:
        the owner is another thread (outcomes queued until :meth:`drain`).
    events_from
        Queued: the index of a tier whose own residency events
        (:class:`~kvtier.tiers.base.Announces`) are taken after each of its
        calls and returned by :meth:`drain` (:class:`TierEvents`); None: none.

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
        region: Rows,
        loop: asyncio.AbstractEventLoop,
        *,
        queued: bool,
        events_from: int | None = None,
    ) -> None:
        self.chain = chain
        self.tiers = list(tiers)
        self.names = list(names)
        self._loop = loop
        self._queued = queued
        self._events_from = events_from
        self.arrivals = Arrivals()
        """Queued: counts the outcomes queued for :meth:`drain` (a front whose
        threads wait for outcomes waits on it, then drains)."""
        self._driver = TierDriver(tiers, names, region, self._arrived)
        self._busy = [Busy() for _ in self.tiers]
        """Each lower tier's reads and writes, timed on the tiers' loop."""
        self._started: dict[int, float] = {}
        """Loop: when each read's and write's tier call began, by seq."""
        self._row_bytes = region.slice_bytes * region.world_size
        self._done: dict[int, Settlement[Any]] = {}
        """Inline: the settlement of each intent not settled yet, by seq."""
        self._writing: dict[int, Settlement[Any]] = {}
        """Inline: the settlements of the writes carried out and not settled yet."""
        # Queued: filled on the loop thread, drained on the owner's. Deque
        # append and popleft are atomic: the two threads need no lock for it.
        self._queue: collections.deque[Settled | TierEvents] = collections.deque()
        self._peer_lock = threading.Lock()
        self._peer_changes: dict[int, dict[bytes, bool]] = {}
        """Queued: peers' changes folded per key (an idle owner drains nothing,
        and a queue of every change would grow with the peers' traffic)."""
        self._records: list[Any] = []
        """Queued: each tier's latest statistics record, taken on the loop."""
        self._writes_stopped = False
        self._seeding: set[Future[None] | asyncio.Future[None]] = set()
        self.abandoned = 0
        """Blocks of writes dropped after :meth:`stop_writes`."""

    # -- owner thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Seed the chain with what the tiers recovered, and follow peers' writes.

        A tier still recovering in the background holds its write-back blocks
        in their rows (:meth:`Chain.recovering <kvtier.chain.Chain.recovering>`)
        until its recovery ends. Queued: blocks until the tiers' loop has taken
        the calls.
        """
        if self._queued:  # each record is taken where its tier runs
            self._records = self._on_loop(_records(self.tiers))
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
            done = self._done
            for intent in intents:
                settlement = done.get(intent.seq)
                if settlement is None:
                    settlement = done[intent.seq] = Settlement(self._loop)
                if isinstance(intent, Write):
                    self._writing[intent.seq] = settlement
            self._carry_out(intents)
            out.extend(intents)
            intents = self.chain.take_intents()
        return out

    @overload
    def expect(self, intent: Read) -> Settlement[ReadDone]: ...
    @overload
    def expect(self, intent: Write) -> Settlement[Written]: ...
    @overload
    def expect(self, intent: Probe) -> Settlement[Probed]: ...
    def expect(self, intent: Intent) -> Settlement[Any]:
        """Inline: the settlement of an intent the chain just handed out (by
        :meth:`~kvtier.chain.Chain.promote`, :meth:`~kvtier.chain.Chain.follow_ups`,
        :meth:`~kvtier.chain.Chain.probe`), asked before it is settled.

        Raises
        ------
        ProtocolError
            Queued: outcomes come back from :meth:`drain`.
        """
        if self._queued:
            raise ProtocolError("a queued runtime hands outcomes back from drain()")
        settlement = self._done.get(intent.seq)
        if settlement is None:
            settlement = self._done[intent.seq] = Settlement(self._loop)
        return settlement

    def completion(self, intent: Intent) -> Completion[None] | None:
        """Inline: done once ``intent``'s outcome is settled; None once it is (or queued)."""
        return self._done.get(intent.seq)

    def writes(self) -> tuple[Completion[None], ...]:
        """Inline: the writes to lower tiers in flight, each done once settled."""
        return tuple(self._writing.values())

    def drain(self) -> list[Settled | TierEvents]:
        """Queued: settle what the loop handed back, in order; what was settled (peers'
        changes first), with the tiers' events in order between the outcomes."""
        chain, queue = self.chain, self._queue
        out: list[Settled | TierEvents] = []
        if self._peer_changes:
            with self._peer_lock:
                changes, self._peer_changes = self._peer_changes, {}
            for index, keys in changes.items():
                change = TierChanged(
                    index,
                    added=tuple(k for k, there in keys.items() if there),
                    removed=tuple(k for k, there in keys.items() if not there),
                )
                chain.settle(change)
                out.append(Settled(change))
        while queue:
            item = queue.popleft()
            if isinstance(item, Settled):
                self._settle(item.outcome)
            out.append(item)
        return out

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

    def tier_statistics(self) -> list[Any]:
        """Each lower tier's own statistics record, in order: taken now (inline), or
        the latest taken on the tiers' loop after each of its calls (queued)."""
        if self._queued:
            return list(self._records)
        return [tier.statistics() for tier in self.tiers]

    def statistics(
        self,
        counts: FrontCounts,
        front: Callable[[ChainStatistics], _F],
        *,
        cpu_busy: Busy | None = None,
    ) -> FrontStatistics[_F]:
        """The front's statistics now: the chain's counts per tier, their bytes and busy
        time, each tier's own record (:meth:`tier_statistics`), the figures every front
        counts (``counts``), and the front's own record: ``front`` makes it from the
        chain's snapshot (the vLLM front's takes the lookups its deadlines missed).

        ``cpu_busy`` times the CPU tier's device copies, where the front runs them.
        """
        chain = self.chain.statistics()
        counted = chain.tiers
        cpu = self._report(self.chain.cpu_statistics(), counted["cpu"], cpu_busy)
        tiers: dict[str, TierReport[Any]] = {"cpu": cpu}
        records = self.tier_statistics()
        for name, record, busy in zip(self.names, records, self._busy, strict=True):
            tiers[name] = self._report(record, counted[name], busy)
        return FrontStatistics(
            tiers=tiers,
            lookups=chain.lookups,
            lookup_misses=counts.lookup_misses,
            stores=counts.stores,
            loads=counts.loads,
            store_refusals=chain.store_refusals,
            recompute_seconds_per_block=chain.recompute_seconds_per_block,
            rows_held_by_writes=chain.rows_held_by_writes,
            front=front(chain),
        )

    def _report(
        self, own: ManagerStatistics | TierStatistics, n: TierCounts, busy: Busy | None
    ) -> TierReport[Any]:
        row = self._row_bytes
        return TierReport(
            own,
            lookup_hits=n.lookup_hits,
            read_blocks=n.read_blocks,
            read_bytes=n.read_blocks * row,
            written_blocks=n.written_blocks,
            written_bytes=n.written_blocks * row,
            read_busy_seconds=busy.read_seconds if busy is not None else 0.0,
            write_busy_seconds=busy.write_seconds if busy is not None else 0.0,
            read_failures=n.read_failures,
            write_failures=n.write_failures,
            write_backs=n.write_backs,
            probes=n.probes,
            loads_declined=n.loads_declined,
            read_seconds_per_block=n.read_seconds_per_block,
        )

    # -- the tiers' loop ------------------------------------------------------------------

    def _carry_out(self, intents: list[Intent]) -> None:
        for intent in intents:
            if self._writes_stopped and isinstance(intent, Write):
                self.abandoned += len(intent.keys)
                self._post(Written(intent, frozenset()), None)  # never started: not timed
                continue
            if isinstance(intent, Write | Read):
                self._started[intent.seq] = time.perf_counter()
                self._busy[intent.tier].begin(isinstance(intent, Write))
            self._driver.carry_out(intent)

    def _arrived(self, outcome: Written | ReadDone | Probed) -> None:
        """An outcome from the driver: timed, then settled or queued; then, queued,
        what its tier's call changed is taken on this loop."""
        seconds = None
        if isinstance(outcome, Written | ReadDone):
            self._busy[outcome.intent.tier].end(isinstance(outcome, Written))
            start = self._started.pop(outcome.intent.seq, None)
            if start is not None:
                seconds = time.perf_counter() - start
        self._post(outcome, seconds)
        if self._queued:
            self._after_call(outcome.intent.tier)

    def _post(self, outcome: Outcome, seconds: float | None) -> None:
        if self._queued:
            self._queue.append(Settled(outcome, seconds))
            self.arrivals.arrived()
        else:
            self._settle(outcome)

    def _after_call(self, index: int) -> None:
        """Queued: tier ``index``'s record, and its own events, taken where it runs."""
        tier = self.tiers[index]
        # The owner's thread reads the record whole (one reference, replaced at
        # once): never the tier's state mid-update.
        self._records[index] = tier.statistics()
        if (
            index == self._events_from
            and isinstance(tier, Announces)
            and (events := tier.take_events())
        ):
            self._queue.append(TierEvents(index, tuple(events)))

    def _peers_callback(self, index: int) -> _Changed:
        def changed(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
            if not self._queued:
                self.chain.settle(TierChanged(index, added=tuple(added), removed=tuple(removed)))
                return
            self._after_call(index)
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
        found = tuple(tier.take_recovered_keys())
        self._post(TierChanged(index, added=found, recovered=True), None)
        if self._queued:
            self._after_call(index)

    # -- inside ---------------------------------------------------------------------------

    def _settle(self, outcome: Outcome) -> None:
        """Owner's thread: the chain first, then who waits for the outcome."""
        self.chain.settle(outcome)
        if isinstance(outcome, TierChanged):
            return
        seq = outcome.intent.seq
        settlement = self._done.pop(seq, None)
        try:
            if settlement is not None:
                self._writing.pop(seq, None)
                settlement._settle(outcome)
        finally:
            if not self._queued:
                # What the outcome led to (promote_up writes, reads held behind a
                # write-back, reads that follow a failed one) goes out now.
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
    row_limit: int | None = None,
) -> Chain:
    """The chain of ``config`` over its open ``tiers`` (as the factory opened them), for
    any front: each lower tier's role from its config (write policy, promotion
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
    row_limit
        The most leading keys of one request a lookup may serve (default
        ``rows``): a front with a CPU tier of its own passes that tier's size.
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
        row_limit=row_limit,
    )


async def _records(tiers: Sequence[Tier]) -> list[Any]:
    return [tier.statistics() for tier in tiers]


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
