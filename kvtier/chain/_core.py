"""The chain of tiers, scheduler side: where every block is, and what to do next. No I/O.

A :class:`Chain` is owned by one thread (a serving engine's scheduler) and
answers at once: it holds the CPU tier's residency and, for each tier below
it (file, cluster), the keys that tier holds as far as this instance knows.
It decides the cascade and hands out *intents* for a driver to carry out on
the tiers' own loop; the driver hands their *outcomes* back::

    front (sync)           Chain (this module)                 driver (tiers' loop)
    lookup(key)    ----->  HIT / PENDING / RETRY / MISS (vLLM: reads start here)
    promote(keys)  ----->  rows reserved, reads (the Engine's loads)
    place(keys)    ----->  rows for the leading keys that fit
    stored(keys)   ----->  write-through: rows pinned for the write
                           take_intents() -> [Write, Read, Probe]  --> tier.store / load / refresh
                           settle(outcome) <- [Written, ReadDone, Probed, TierChanged]  <--

What it decides:

* **Write-through.** A block stored from the device is written to every tier
  below that takes stores; its row is pinned *for the write* (not a load)
  until the write ends, so it cannot be evicted and reused meanwhile.
* **Write-back.** A tier with ``write_back`` is given a block only when the
  CPU tier evicts it: the placement that evicted it emits a :class:`Write`
  with ``evicting`` of the victim's row, and the row is not reused (a read
  into it is held; a front's copy waits, :meth:`Chain.evicting_writes`)
  until that write ends; at close, :meth:`Chain.write_back` hands over the
  rest.
* **Promotion.** A lookup of a block that only a lower tier holds reserves a
  CPU row and answers RETRY; the driver reads the block into the row; once
  verified it is a HIT. With ``promote_up``, a block promoted from a tier
  also goes to the tiers above that tier (a cluster hit lands on the file
  tier too).
* **Probing a shared tier.** A tier other instances write (the cluster tier)
  may hold blocks this instance never saw: a lookup of a key that no tier is
  known to hold asks it (RETRY), in one batch per scheduler step.
* **A lower tier's failure falls through, then is a miss.** A block a read
  did not deliver (vanished, damaged, its row reused, the tier refusing) is
  dropped from that tier, and read into the same CPU row from the next tier
  below it that holds it (a :class:`Read` that ``follows`` the first); only
  when no tier below holds it, or its wait is past ``lookup_deadline_s``, is
  it a miss (the lookup answers MISS, never an error). A lookup that has
  waited on a read or a probe past ``lookup_deadline_s`` answers MISS: a
  stalled tier never holds a request (the read goes on, and its block serves
  a later request).

The chain holds the CPU tier's residency, places rows, and issues and
settles the reads and writes; its parts are objects it owns, each in a module
of its own: the reads in flight and their fall-through
(:class:`~kvtier.chain._reads.Reads`), the writes and the rows they pin
(:class:`~kvtier.chain._writes.Writes`), the fronts' lookups and the waits they start
(:class:`~kvtier.chain._lookups.Lookups`), whether a lower tier's block is
worth loading at all (:class:`~kvtier.chain._decision.LoadDecision`), the
per-request deadlines and row limit (:class:`~kvtier.chain._deadlines.Deadlines`),
and what write-back tiers are owed (:class:`~kvtier.chain._write_back.WriteBack`).

Both fronts drive it through the runtime (:class:`~kvtier.chain.Runtime`),
which carries the intents out and settles their outcomes; each intent carries
a sequence number (``seq``), and its outcome names the intent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtier.chain._deadlines import Deadlines
from kvtier.chain._decision import LoadDecision
from kvtier.chain._lookups import Lookups
from kvtier.chain._lower import Lower
from kvtier.chain._messages import (
    Intent,
    LowerTier,
    Outcome,
    Probe,
    Probed,
    Read,
    ReadDone,
    Write,
    Written,
)
from kvtier.chain._reads import Reads
from kvtier.chain._statistics import ChainStatistics, TierCounts
from kvtier.chain._write_back import WriteBack
from kvtier.chain._writes import Writes
from kvtier.manager import ResidencyManager, StorePlan

__all__ = ["Chain"]


class Chain:
    """The CPU tier and the tiers below it, scheduler side (see the module docstring).

    Parameters
    ----------
    rows
        The CPU region's rows: the CPU tier's residency (one slot per row) is
        the chain's own, made here, and only the chain changes it.
    lower
        The tiers below it, highest first.
    lookup_deadline_s
        How long a lookup may answer RETRY for one block before it answers
        MISS.
    probe_ttl_s
        How long a shared tier's "absent" answer stands before a lookup asks
        again (another instance may have stored the block since).
    known_limit
        Keys remembered per shared tier (the oldest are forgotten).
    policy
        The CPU tier's eviction policy (``"lru"``, ``"arc"``).
    enable_events
        Record the CPU tier's residency events (:meth:`take_cpu_events`).
    decline_slow_loads, recompute_s_per_block, measure_recompute
        Whether a lookup declines a lower tier's block that would arrive later
        than recomputing it; what recomputing a block costs, in seconds; whether
        to measure it from :meth:`place` to :meth:`stored` (vLLM's stores follow
        the compute): :class:`~kvtier.chain._decision.LoadDecision`.
    row_limit
        The most leading keys of one request that a lookup may answer other
        than MISS: by default the CPU tier's rows (a request's prefix must fit
        them); a front with a CPU tier of its own above the chain passes its
        size (:meth:`read_into`).
    row_wait_s, hold_s, keep_s
        How long a lookup's read may wait for a CPU row to come free before the
        lookup answers MISS (:class:`~kvtier.chain._lookups.Lookups`); how long
        a block a lookup's read delivered stays pinned for the request waiting
        on it, unless that request loads it first (at most
        ``lookup_deadline_s``); how long it is kept for that request after
        that while placements find rows elsewhere: it is the last a placement
        takes (:class:`~kvtier.chain._reads.Reads`). A small CPU tier then
        never holds a request for rows it cannot get soon, nor evicts a
        promotion before its request has it, and a request the engine revisits
        seconds later still finds it.
    clock
        Monotonic seconds (tests pass their own).

    Notes
    -----
    Not thread-safe: one thread owns it. A driver's outcomes are handed back
    through :meth:`settle` on that thread.
    """

    def __init__(
        self,
        rows: int,
        lower: Sequence[LowerTier],
        *,
        lookup_deadline_s: float = 2.0,
        probe_ttl_s: float = 1.0,
        known_limit: int = 1 << 20,
        policy: str = "lru",
        enable_events: bool = False,
        decline_slow_loads: bool = True,
        recompute_s_per_block: float | None = None,
        measure_recompute: bool = False,
        row_limit: int | None = None,
        row_wait_s: float = 0.1,
        hold_s: float = 2.0,
        keep_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu = cpu = ResidencyManager(rows, policy, tier="cpu", enable_events=enable_events)
        self._cpu_counts = TierCounts()
        # A tier of this instance's own is known exactly; a shared one is bounded.
        self._lower = [Lower(s, known_limit if s.shared else 1 << 62) for s in lower]
        self._decision = LoadDecision(
            [spec.name for spec in lower],
            enabled=decline_slow_loads,
            recompute_s_per_block=recompute_s_per_block,
            measure_recompute=measure_recompute,
            clock=clock,
        )
        self._deadlines = Deadlines(
            lookup_deadline_s, cpu.capacity if row_limit is None else row_limit, clock
        )
        self._lookups = lookups = Lookups(
            cpu,
            self._cpu_counts,
            self._lower,
            self._decision,
            self._deadlines,
            probe_ttl_s=probe_ttl_s,
            row_wait_s=row_wait_s,
            clock=clock,
        )
        self._write_back = WriteBack(cpu, self._lower, self._next)
        self._writes_back = any(spec.write_back for spec in lower)
        self._deadline = lookup_deadline_s
        self._clock = clock
        self._intents: list[Intent] = []
        self._seq = 0
        self._reads = Reads(
            cpu,
            self._lower,
            lookups,
            self._decision,
            self._write_back,
            self._intents,
            self._next,
            deadline_s=lookup_deadline_s,
            hold_s=min(hold_s, lookup_deadline_s),
            keep_s=keep_s,
            clock=clock,
        )
        self._writes = Writes(
            cpu, self._lower, self._write_back, self._reads.issue, self._intents, self._next
        )
        self._refusals = 0
        # What the fronts ask, on their hot paths: answered by the residency and
        # the parts themselves (no second call through the chain).
        self.is_ready = cpu.is_ready
        """Whether a key is ready in a CPU row (loadable now)."""
        self.holds = cpu.__contains__
        """Whether a key holds a CPU row in any state (``key in chain``)."""
        self.pins = cpu.pins
        """How many loads and writes hold a key's CPU row now."""
        self.touch = cpu.touch
        """Mark ready CPU blocks recently used (keys not ready there are left alone)."""
        self.capacity = cpu.capacity
        """Rows of the CPU tier."""
        self.cpu_statistics = cpu.statistics
        """The CPU tier's residency: rows used, ready, pinned, evictable; evictions."""
        self.take_cpu_events = cpu.take_events
        """The CPU tier's residency events since the last call (``enable_events``)."""
        self.lookup = lookups.lookup
        """Where a key can be served from now, key by key (vLLM's): :meth:`Lookups.lookup
        <kvtier.chain._lookups.Lookups.lookup>`."""
        self.locate = lookups.locate
        """Whether a lower tier can serve a key, for a front with a CPU tier of its own
        (its reads go into its own slots): :meth:`Lookups.locate
        <kvtier.chain._lookups.Lookups.locate>`."""
        self.prefix = lookups.prefix
        """The longest prefix some tier can serve, at once (the Engine's):
        :meth:`Lookups.prefix <kvtier.chain._lookups.Lookups.prefix>`."""
        self.known = lookups.known
        """:meth:`Lookups.known <kvtier.chain._lookups.Lookups.known>`."""
        self.lower_of = lookups.lower_of
        """The highest lower tier known to hold a key, or None (no side effect)."""
        self.is_waiting = lookups.is_waiting
        """Whether a lookup of a key waits on a read or a probe."""
        self.forget_request = lookups.forget_request
        """A request looks nothing up any more (it finished)."""
        self.evicting_writes = self._write_back.waits_for
        """The write-backs the rows of a plan wait for (their evicted blocks)."""
        self.abandon = self._write_back.abandon
        """Forget what write-back tiers were still to be given (a close's timeout); how many."""

    # -- stores and loads through the CPU rows ---------------------------------------------

    def place(self, keys: Sequence[bytes], keep: Sequence[bytes] = ()) -> StorePlan | None:
        """CPU rows for the longest prefix of the new ``keys`` that fits now, or None.

        ``keys`` are not in the CPU tier (both fronts leave those out before
        they call, so it is not looked at again here); refused keys are counted.
        Unless a lower tier takes what the CPU tier evicts (:attr:`streams`),
        ready blocks of ``keep`` are not evicted to make room: a request must
        not evict its own prefix for its tail when an evicted block is gone.
        The rows of blocks it evicts that a write-back tier still lacks are
        not free until :meth:`evicting_writes` of the plan end.
        """
        todo = list(keys)
        if not todo:
            return None
        held = [k for k in keep if self._cpu.is_ready(k)] if keep and not self.streams else []
        if held:
            held = list(self._cpu.prepare_load(held).keys)  # shielded from eviction meanwhile
        try:
            plan = self._place(todo)
        finally:
            if held:
                self._cpu.complete_load(held)
        if plan is not None and self._decision.measuring:
            self._decision.placed(plan.keys)
        self._refusals += len(todo) - (0 if plan is None else len(plan.keys))
        return plan

    def stored(self, keys: Sequence[bytes], ok: bool, *, write_down: bool = True) -> None:
        """The device copy into the rows of ``keys`` ended; write them through if ``ok``.

        ``write_down=False`` publishes them in the CPU tier only (a front that
        has stopped writing to the tiers below: a close past its timeout).
        """
        if not keys:
            return
        if self._decision.measuring:
            self._decision.computed(keys, ok)
        self._cpu.complete_store(keys, ok)
        if ok:
            self._lookups.delivered(keys)  # a request's PENDING wait on them ended
            self._cpu_counts.written_blocks += len(keys)
            if write_down:
                self._writes.down(keys, range(len(self._lower)), store=True)

    def reset(self) -> None:
        """Forget every block of the CPU tier (vLLM's ``reset_cache``); the blocks held
        for waiting requests go too.

        Raises
        ------
        BusyError
            Blocks are being loaded or stored (nothing is reset).
        """
        self._reads.release()
        self._cpu.reset()

    def pin_for_device_load(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Pin ready blocks for a copy to the device; their rows."""
        plan = self._cpu.prepare_load(keys)
        self._reads.loaded(keys)  # pinned by the load now: the holds for it end
        self._cpu_counts.read_blocks += len(keys)
        return plan.slots

    def unpin_device_load(self, keys: Sequence[bytes]) -> None:
        """The copy to the device of ``keys`` ended."""
        self._cpu.complete_load(keys)

    def promote(self, keys: Sequence[bytes]) -> list[Read]:
        """Reserve CPU rows for a window of the leading ``keys`` and read them from the
        lower tiers that hold them; the reads, one per tier (each settles with its
        :class:`ReadDone`; one may wait for a write-back of its rows first).

        The window is every key when the free or evictable rows take them all;
        past that, at most half the CPU tier, so that one window is read while
        the one before is copied to the device (a load streams through the
        rows); none when no row is free. Keys in the CPU tier already, or in
        no lower tier, are left out. With ``promote_up``, what arrives also
        goes to the tiers above its own.
        """
        lower_of = self.lower_of
        todo = [k for k in keys if k not in self._cpu and lower_of(k) is not None]
        room = self._room(len(todo)) if todo else 0
        if not room:
            return []
        if len(todo) > room:
            todo = todo[: min(room, max(1, self.capacity // 2))]
        plan = self._place(todo)
        if plan is None:
            return []
        return self._reads.start(plan.keys, plan.slots, lower_of)

    def follow_ups(self, read: Read) -> tuple[Read, ...]:
        """The reads that carry on ``read``'s undelivered blocks from lower tiers.

        Made when ``read``'s :class:`ReadDone` was settled: each block the
        tier did not deliver, held by a tier below it, is read from the
        highest such tier into the row it already had (the row stays
        reserved: not ready, not evictable), in one :class:`Read` per tier,
        each with ``follows`` set to ``read.seq``. A front that waits on
        ``read``'s blocks (the Engine's loads) asks right after that outcome
        and waits on these for the blocks they carry; the blocks of ``read``
        that are in neither ``loaded`` nor these reads are misses. Empty when
        every block was delivered, or none is held below (or their wait is
        past ``lookup_deadline_s``), or once one of these reads has settled.
        """
        return self._reads.follow_ups(read)

    # -- a front's own CPU tier above the chain --------------------------------------------

    def write_from(self, keys: Sequence[bytes], rows: Sequence[int]) -> list[Write]:
        """Write blocks from slots of a front's own CPU tier to every tier below that
        takes stores and lacks them; the writes (each settles with :class:`Written`).

        For a front whose CPU tier is another engine's (:mod:`kvtier.below`): its
        slots (``rows``, one per key) hold the blocks and stay stable until each
        write settles; the chain pins nothing. Write-back tiers are written at
        once too: that CPU tier evicts without telling the chain. Empty when
        every tier holds every key already.
        """
        return self._writes.given(keys, rows)

    def read_into(
        self, keys: Sequence[bytes], rows: Sequence[int]
    ) -> tuple[list[Read], tuple[bytes, ...]]:
        """Read blocks into slots of a front's own CPU tier, each from the highest
        tier known to hold it: the reads (one per tier, each settling with
        :class:`ReadDone`), and the keys no tier is known to hold (misses now).

        A block a read does not deliver falls through to the tiers below that
        hold it, into the same slot (:meth:`follow_ups`), within
        ``lookup_deadline_s`` of its first read. Nothing enters the chain's
        CPU tier, and nothing is promoted up (the slot is the front's once the
        reads settle).
        """
        tier_of = self.lower_of
        held: list[bytes] = []
        slots: list[int] = []
        missing: list[bytes] = []
        for k, r in zip(keys, rows, strict=True):  # one look per key: a front's hot path
            if tier_of(k) is None:
                missing.append(k)
            else:
                held.append(k)
                slots.append(r)
        return self._reads.start(held, slots, tier_of, given=True), tuple(missing)

    def probe(self, index: int, keys: Sequence[bytes]) -> Probe:
        """Ask lower tier ``index`` which of ``keys`` it holds: the :class:`Probe` queued."""
        self._lower[index].counts.probes += len(keys)
        probe = Probe(index, tuple(keys), self._next())
        self._intents.append(probe)
        return probe

    # -- the CPU tier, as the fronts see it -----------------------------------------------

    @property
    def streams(self) -> bool:
        """A lower tier takes what the CPU tier evicts now (one takes stores and is
        not recovering): a store larger than the CPU tier can stream through it."""
        return any(t.spec.takes_stores and not t.recovering for t in self._lower)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` holds a CPU row, in any state (being written included)."""
        return key in self._cpu

    # -- write-back -----------------------------------------------------------------------

    def write_back(self) -> int:
        """Hand every write-back tier the ready blocks it lacks (at close); how many."""
        return self._writes.at_close()

    def recovering(self, index: int) -> None:
        """Lower tier ``index`` refuses writes until its recovery ends (a
        :class:`TierChanged` with ``recovered``); meanwhile the blocks it is owed stay
        pinned in their CPU rows (:class:`~kvtier.chain._write_back.WriteBack`): stores
        find fewer rows to evict (a refusal is a recompute later; a lost block is not)."""
        self._lower[index].recovering = True

    # -- intents and outcomes -------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Lookups wait on reads or probes, or reads, probes or writes are in flight."""
        return bool(
            self._lookups.busy or self._intents or self._writes.pinned or self._write_back.busy
        )

    def take_intents(self) -> list[Intent]:
        """What to carry out now: writes, reads into reserved rows, probes."""
        lookups = self._lookups
        self._reads.expire()
        if not (self._intents or lookups.due):
            return []  # most calls: a store with nothing below, a step with nothing new
        self._start_reads()
        for i, keys in lookups.probes_due():
            self._lower[i].counts.probes += len(keys)
            self._intents.append(Probe(i, keys, self._next()))
        out = self._intents[:]
        self._intents.clear()  # the one list the parts append to
        return out

    def settle(self, outcome: Outcome) -> None:
        """Apply an outcome a driver handed back."""
        if isinstance(outcome, Written):
            self._writes.settle(outcome)
        elif isinstance(outcome, ReadDone):
            promoted = self._reads.settle(outcome)
            if promoted:  # a promotion from a tier that promotes up
                self._writes.down(promoted, range(outcome.intent.tier), store=False)
        elif isinstance(outcome, Probed):
            self._lookups.probed(outcome)
        else:
            tier = self._lower[outcome.tier]
            tier.learn(outcome.added)
            tier.forget(outcome.removed)
            self._write_back.orphaned(outcome.tier, outcome.removed)
            if outcome.recovered and tier.recovering:
                tier.recovering = False
                self._write_back.recovered(outcome.tier)

    def statistics(self) -> ChainStatistics:
        """A snapshot of the counters."""
        decision, deadlines = self._decision, self._deadlines
        tiers = {"cpu": replace(self._cpu_counts)}  # copies: the snapshot does not move
        for i, t in enumerate(self._lower):
            tiers[t.spec.name] = replace(
                t.counts,
                loads_declined=decision.declined_from(i),
                read_seconds_per_block=decision.s_per_block(i),
            )
        return ChainStatistics(
            tiers=tiers,
            lookups=self._lookups.count,
            store_refusals=self._refusals,
            lookup_deadline_misses=deadlines.late,
            lookup_row_limit_misses=deadlines.row_limited,
            loads_declined=decision.declined,
            recompute_seconds_per_block=decision.recompute_s_per_block,
            rows_held_by_writes=self._writes.pinned,
        )

    # -- reads ---------------------------------------------------------------------------

    def _start_reads(self) -> None:
        """Rows for the reads lookups wait on, and the reads into them."""
        lookups = self._lookups
        wanted = lookups.reads_due()
        if not wanted:
            return
        plan = self._place([k for k, _t in wanted])
        placed = set() if plan is None else set(plan.keys)
        lookups.unplaced([k for k, _t in wanted if k not in placed])
        if plan is None:
            return
        lookups.issued(plan.keys)
        # Its blocks are lookup hits of that tier.
        self._reads.start(plan.keys, plan.slots, dict(wanted).__getitem__, for_lookup=True)

    # -- rows ----------------------------------------------------------------------------

    def _room(self, need: int = 0) -> int:
        """How many new blocks the CPU tier takes now (free or evictable rows); short
        of ``need``, kept blocks past their firm hold give up their rows."""
        reads = self._reads
        reads.expire()  # holds past keep_s free their rows first
        st = self._cpu.statistics()
        room = st.capacity - st.used + st.evictable
        if room < need and reads.yield_holds(need - room):
            st = self._cpu.statistics()
            room = st.capacity - st.used + st.evictable
        return room

    def _place(self, keys: list[bytes]) -> StorePlan | None:
        n = min(len(keys), self._room(len(keys)))
        while n:
            plan = self._cpu.prepare_store(keys[:n])
            if plan is not None:
                if plan.evicted and self._writes_back:
                    self._intents.extend(self._write_back.evicted(plan))
                return plan
            n //= 2  # the room counted rows this call's own keys would need to free
        return None

    def _next(self) -> int:
        self._seq += 1
        return self._seq
