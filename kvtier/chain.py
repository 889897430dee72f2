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

Both fronts drive it. The :class:`~kvtier.engine.Engine` owns it on its
event loop, with the tiers on the same loop, and turns intents into
awaitables; the vLLM front (:mod:`kvtier.integrations.vllm`) drives it from
vLLM's scheduler thread, with the tiers on kvtier's loop thread. Either way
the front runtime (:class:`~kvtier.runtime.Runtime`) carries the intents
out and settles their outcomes; each intent carries a sequence number
(``seq``), and its outcome names the intent.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvtier.manager import ManagerEvent, ManagerStatistics, ResidencyManager, StorePlan

__all__ = [
    "Answer",
    "Chain",
    "ChainStatistics",
    "LowerTier",
    "Probe",
    "Probed",
    "Read",
    "ReadDone",
    "TierChanged",
    "TierCounts",
    "Write",
    "Written",
]

log = logging.getLogger("kvtier.chain")

REMEASURE_S = 10.0
"""A lower tier unread this long gets a request's first block read, declined or not,
so that the load-or-recompute decision measures it again (:meth:`Chain.worth_loading`)."""


class Answer(enum.Enum):
    """What :meth:`Chain.lookup` says of one block."""

    HIT = "hit"
    """Ready in a CPU row: load it now."""
    PENDING = "pending"
    """Its store from the device is in flight: it will be a hit."""
    RETRY = "retry"
    """A lower tier is being read or asked: ask again at a later step."""
    MISS = "miss"
    """No tier can serve it (or not in time): recompute it."""


@dataclass(frozen=True, slots=True)
class LowerTier:
    """A tier below the CPU region, as the chain sees it (no object of the tier itself)."""

    name: str
    """``"file"``, ``"cluster"``: its name in statistics and logs."""
    shared: bool = False
    """Other instances write it too: keys this instance does not know are probed."""
    takes_stores: bool = True
    """Blocks stored from the device are written through to it."""
    promote_up: bool = False
    """A block promoted from it also goes to the tiers above it."""
    write_back: bool = False
    """A block stored from the device reaches it only when the CPU tier evicts
    it (:class:`Write` with ``evicting``) or at close (:meth:`Chain.write_back`),
    not at once. For fronts that can hold a row's reuse until that write ends
    (the Engine); vLLM's synchronous ``prepare_store`` cannot."""


# -- intents and outcomes ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    """Write the blocks of these CPU rows to a tier; the rows stay pinned until :class:`Written`."""

    tier: int
    """Index of the tier in the chain's lower tiers."""
    keys: tuple[bytes, ...]
    rows: tuple[int, ...]
    """CPU row of each key."""
    evicting: bool = False
    """A write-back of blocks the CPU tier just evicted: their rows already
    belong to the blocks placed in them, which must not be copied in until
    this write ends (:meth:`Chain.evicting_writes`); no pin is held."""
    seq: int = 0
    """The chain's number for this intent (unique per chain): its outcome names
    the intent, and a front matches the two by this number."""


@dataclass(frozen=True, slots=True)
class Read:
    """Read blocks from a tier into reserved CPU rows (a promotion)."""

    tier: int
    keys: tuple[bytes, ...]
    rows: tuple[int, ...]
    """CPU row of each key."""
    seq: int = 0
    """As :attr:`Write.seq`."""
    follows: int = 0
    """The ``seq`` of the read whose undelivered blocks this one reads from a
    lower tier, into the same rows (see :meth:`Chain.follow_ups`); 0 for a
    first read."""


@dataclass(frozen=True, slots=True)
class Probe:
    """Ask a shared tier which of these keys it holds (no rows involved)."""

    tier: int
    keys: tuple[bytes, ...]
    seq: int = 0
    """As :attr:`Write.seq`."""


Intent = Write | Read | Probe


@dataclass(frozen=True, slots=True)
class Written:
    """The outcome of a :class:`Write`."""

    intent: Write
    stored: frozenset[bytes]
    """Keys the tier now holds (written, or already there)."""
    evicted: tuple[bytes, ...] = ()
    """Keys the tier evicted to make room."""


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The outcome of a :class:`Read`."""

    intent: Read
    loaded: frozenset[bytes]
    """Keys whose rows now hold their verified bytes; the others are misses."""


@dataclass(frozen=True, slots=True)
class Probed:
    """The outcome of a :class:`Probe`."""

    intent: Probe
    present: frozenset[bytes]
    """Keys the tier holds (a hint: one may vanish before it is read)."""


@dataclass(frozen=True, slots=True)
class TierChanged:
    """A tier's residency changed on its own: recovery found blocks, or it dropped some."""

    tier: int
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    recovered: bool = False
    """Its recovery at open ended (``added`` is what it found): it takes writes
    again (see :meth:`Chain.recovering`)."""


Outcome = Written | ReadDone | Probed | TierChanged


# -- statistics ----------------------------------------------------------------------------


@dataclass(slots=True)
class TierCounts:
    """What the chain counted for one tier (names as in :class:`ChainStatistics`)."""

    lookup_hits: int = 0
    """Keys a lookup got from this tier: the CPU tier's HITs (and, for
    :meth:`Chain.prefix`, its blocks in flight); a lower tier's blocks read for a
    :meth:`Chain.lookup`, or credited to it by :meth:`Chain.prefix`."""
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
    have arrived later than recomputing them (see :meth:`Chain.worth_loading`)."""
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
    """Blocks a :meth:`Chain.place` could not give a row."""
    deadline_misses: int
    """Lookups answered MISS because a read or probe outlasted the deadline
    (the key's own, or its request's: see :meth:`Chain.lookup`)."""
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


@dataclass(slots=True)
class _Waiting:
    """A key a lookup is waiting on: read or probed since ``since``."""

    since: float
    tier: int = -1
    """The tier it is read from; -1 while probed."""
    read: bool = False
    issued: bool = False
    """Its read or probe went to the driver (else it waits for a row)."""


@dataclass(slots=True)
class _Request:
    """One request's lookups (a front that names its requests: vLLM)."""

    seen: dict[bytes, None] = field(default_factory=dict)
    """Keys looked up in its current pass over its prefix."""
    since: float | None = None
    """When its current wait began (its first RETRY or PENDING), or None."""
    deferred: bool = False
    """Its current pass answered RETRY or PENDING somewhere."""
    last: float = 0.0
    """When it last looked a key up."""
    from_lower: dict[int, int] = field(default_factory=dict)
    """Blocks of its current pass to be read from each lower tier."""


@dataclass(slots=True)
class _Lower:
    spec: LowerTier
    known: dict[bytes, None] = field(default_factory=dict)
    """Keys it holds as far as this instance knows (insertion order: oldest first)."""
    counts: TierCounts = field(default_factory=TierCounts)
    absent: dict[bytes, float] = field(default_factory=dict)
    """Shared tiers: keys a probe found absent, and when (oldest first)."""
    dirty: dict[bytes, None] = field(default_factory=dict)
    """Write-back tiers: ready CPU blocks it has not been given yet."""
    recovering: bool = False
    """Its recovery at open goes on: it refuses writes until it ends."""
    held: dict[bytes, None] = field(default_factory=dict)
    """Write-back tiers while recovering: dirty blocks pinned in their CPU rows
    (an eviction would hand them to a write the tier refuses: lost)."""
    reading: int = 0
    """Reads of it in flight."""
    queued: int = 0
    """Blocks of those reads."""
    since: float = 0.0
    """When its current busy period (some read in flight) began."""
    period_blocks: int = 0
    """Blocks delivered in the current busy period."""
    busy: float = 0.0
    """Decayed sum of its busy periods' seconds..."""
    delivered: float = 0.0
    """... and of the blocks they delivered: ``busy / delivered`` is its cost per block."""
    idle_since: float = 0.0
    """When its last busy period ended (a tier declined is not read: see REMEASURE_S)."""

    def s_per_block(self) -> float | None:
        return self.busy / self.delivered if self.delivered else None

    def learn(self, keys: Iterable[bytes], limit: int) -> None:
        known = self.known
        for k in keys:
            known.pop(k, None)
            known[k] = None
            self.absent.pop(k, None)
        # A shared tier's keys come from every instance: what this one
        # remembers is bounded, the oldest forgotten (a later probe finds them).
        while len(known) > limit:
            del known[next(iter(known))]

    def forget(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.known.pop(k, None)


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
        than recomputing it (:meth:`worth_loading`); what recomputing a block
        costs, in seconds; and, without that, whether to measure it from the
        time between :meth:`place` and :meth:`stored` (a front whose stores
        follow the compute that made the blocks: vLLM's).
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu = cpu = ResidencyManager(rows, policy, tier="cpu", enable_events=enable_events)
        # The two questions the fronts ask per key on their hot paths, answered
        # by the residency itself (no second call through the chain).
        self.is_ready: Callable[[bytes], bool] = cpu.is_ready
        """Whether a key is ready in a CPU row (loadable now)."""
        self.holds: Callable[[object], bool] = cpu.__contains__
        """Whether a key holds a CPU row in any state (``key in chain``)."""
        self._lower = [_Lower(spec) for spec in lower]
        self._deadline = lookup_deadline_s
        self._probe_ttl = probe_ttl_s
        self._known_limit = known_limit
        self._clock = clock
        self._cpu_counts = TierCounts()
        self._waiting: dict[bytes, _Waiting] = {}
        self._to_read: dict[bytes, int] = {}  # key -> tier, in lookup order
        self._to_probe: dict[int, dict[bytes, None]] = {}
        self._intents: list[Intent] = []
        self._write_pins: dict[bytes, int] = {}
        self._evicting: dict[int, Write] = {}
        """CPU rows whose evicted block is being written back, and that write."""
        self._deferred: list[Read] = []
        """Reads into rows whose evicted block is still being written back."""
        self._read_since: dict[int, float] = {}
        """Reads in flight: when the first read of their blocks was issued (a
        read that follows another keeps that one's time: one deadline per block)."""
        self._follow_ups: dict[int, tuple[Read, ...]] = {}
        """Reads whose undelivered blocks went on to lower tiers, and those reads
        (:meth:`follow_ups`), until one of those settles."""
        self._rows = cpu.capacity
        self._requests: dict[object, _Request] = {}
        """Requests looking up, least recently active first."""
        self._forget_after = max(60.0, 10 * lookup_deadline_s)
        self._decide = decline_slow_loads
        self._recompute = recompute_s_per_block
        self._placed: dict[bytes, float] | None = (
            {} if measure_recompute and recompute_s_per_block is None else None
        )
        """Measuring: when each key was placed (its compute's step began)."""
        self._declined = 0
        self._logged_declined = False
        self._measured: float | None = None
        self._seq = 0
        self._lookup_reads: set[int] = set()
        """Reads that :meth:`lookup` started (vLLM's): a block they deliver is a lookup hit."""
        self._lookups = 0
        self._refusals = 0
        self._late = 0
        self._row_limited = 0
        self._logged_late = False

    # -- what the front asks -------------------------------------------------------------

    def lookup(self, key: bytes, request: object = None) -> Answer:
        """Where ``key`` can be served from now; queues a read or a probe when it helps.

        Parameters
        ----------
        key
            The block's key.
        request
            Who asks (any hashable; vLLM's request id), for a front that looks
            a request's prefix up key by key, in order, once per scheduler
            step, as vLLM does. Then two rules hold per request, not per key:

            * **Its wait is bounded.** From its first RETRY or PENDING answer,
              a request may wait ``lookup_deadline_s``; past it every answer
              but HIT is MISS, so it loads what is in CPU rows and recomputes
              the rest. (Per key, a wait would start afresh each time a
              promoted block was evicted before the request came back.)
            * **Its prefix fits the CPU tier.** Only as many leading keys as
              the CPU tier has rows can be loaded at once (every load is
              staged through a row): a key past that is MISS, counted in
              ``row_limit_misses``, and the request's hits are marked
              recently used so that its own promotions evict other blocks
              first.

            A key seen again starts a new pass (the next step's lookup);
            :meth:`forget_request` drops a finished request (requests idle
            for long are dropped anyway).
        """
        if request is None:
            return self._lookup(key)
        now = self._clock()
        requests = self._requests
        req = requests.pop(request, None)
        if req is None:
            req = _Request()
            if requests:
                self._sweep(now)
        requests[request] = req  # most recently active last
        req.last = now
        seen = req.seen
        if key in seen:  # a new pass over its prefix
            if not req.deferred:
                req.since = None  # the last pass was answered: a new wait
            seen.clear()
            req.from_lower.clear()
            req.deferred = False
        seen[key] = None
        if len(seen) > self._rows:
            self._lookups += 1
            self._row_limited += 1
            return Answer.MISS
        if self._decide and key not in self._waiting and key not in self._cpu:
            tier = self.lower_of(key)
            if tier is not None:  # a read would start: is it worth it?
                m = req.from_lower.get(tier, 0) + 1
                if not self.worth_loading(tier, m):
                    self._lookups += 1
                    self._decline(tier)
                    return Answer.MISS
                req.from_lower[tier] = m
        answer = self._lookup(key)
        if answer is Answer.HIT:
            self._cpu.touch((key,))
        elif answer is not Answer.MISS:
            if req.since is None:
                req.since = now
            elif now - req.since >= self._deadline:
                self._late += 1
                self._warn_late("its request's wait")
                return Answer.MISS
            req.deferred = True
        return answer

    def forget_request(self, request: object) -> None:
        """``request`` looks nothing up any more (it finished)."""
        self._requests.pop(request, None)

    def _sweep(self, now: float) -> None:
        requests = self._requests
        while requests:
            oldest = next(iter(requests))
            if now - requests[oldest].last < self._forget_after:
                return
            del requests[oldest]

    def _warn_late(self, what: str) -> None:
        if not self._logged_late:
            self._logged_late = True
            log.warning(
                "kvtier: a lookup waited on %s for more than %.3f s (lookup_deadline_s): "
                "answered as a miss, the block is recomputed; logged once, counted as "
                "deadline_misses",
                what,
                self._deadline,
            )

    def _lookup(self, key: bytes) -> Answer:
        self._lookups += 1
        cpu = self._cpu
        if cpu.lookup((key,)):
            self._cpu_counts.lookup_hits += 1
            self._waiting.pop(key, None)
            return Answer.HIT
        waiting = self._waiting.get(key)
        if waiting is not None:
            if self._clock() - waiting.since < self._deadline:
                return Answer.RETRY
            if not waiting.issued:
                # Never started (no row came free in time): forget it; a later
                # lookup starts afresh.
                del self._waiting[key]
                self._to_read.pop(key, None)
            self._late += 1
            where = self._lower[waiting.tier].spec.name if waiting.read else "a shared tier"
            self._warn_late(f"a read from the {where} tier" if waiting.read else where)
            return Answer.MISS
        if key in cpu:
            return Answer.PENDING  # its store from the device is in flight
        for i, tier in enumerate(self._lower):
            if key in tier.known:
                self._to_read.setdefault(key, i)
                self._waiting[key] = _Waiting(self._clock(), i, read=True)
                return Answer.RETRY
        now = self._clock()
        for i, tier in enumerate(self._lower):
            if tier.spec.shared and now - tier.absent.get(key, -1e300) >= self._probe_ttl:
                self._to_probe.setdefault(i, {})[key] = None
                self._waiting[key] = _Waiting(now)
                return Answer.RETRY
        return Answer.MISS

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
        if plan is not None and self._placed is not None:
            now, placing = self._clock(), self._placed
            for k in plan.keys:
                placing[k] = now
        placed = 0 if plan is None else len(plan.keys)
        self._refusals += len(todo) - placed
        return plan

    def stored(self, keys: Sequence[bytes], ok: bool, *, write_down: bool = True) -> None:
        """The device copy into the rows of ``keys`` ended; write them through if ``ok``.

        ``write_down=False`` publishes them in the CPU tier only (a front that
        has stopped writing to the tiers below: a close past its timeout).
        """
        if not keys:
            return
        if self._placed is not None:
            self._measure_compute(keys, ok)
        self._cpu.complete_store(keys, ok)
        if ok:
            self._cpu_counts.blocks_in += len(keys)
            if write_down:
                self._write_down(keys, range(len(self._lower)), store=True)

    def pin_for_device_load(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Pin ready blocks for a copy to the device; their rows."""
        plan = self._cpu.prepare_load(keys)
        self._cpu_counts.blocks_out += len(keys)
        return plan.slots

    def unpin_device_load(self, keys: Sequence[bytes]) -> None:
        """The copy to the device of ``keys`` ended."""
        self._cpu.complete_load(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ready CPU blocks recently used."""
        self._cpu.touch(keys)  # keys not ready there are left alone

    # -- the CPU tier, as the fronts see it -----------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows of the CPU tier."""
        return self._rows

    @property
    def streams(self) -> bool:
        """A lower tier takes what the CPU tier evicts now (one takes stores and is
        not recovering): a store larger than the CPU tier can stream through it."""
        return any(t.spec.takes_stores and not t.recovering for t in self._lower)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` holds a CPU row, in any state (being written included)."""
        return key in self._cpu

    def pins(self, key: bytes) -> int:
        """How many loads and writes hold ``key``'s CPU row now."""
        return self._cpu.pins(key)

    def room(self) -> int:
        """How many new blocks the CPU tier takes now (free or evictable rows)."""
        st = self._cpu.statistics()
        return st.capacity - st.used + st.evictable

    def cpu_statistics(self) -> ManagerStatistics:
        """The CPU tier's residency: rows used, ready, pinned, evictable; evictions."""
        return self._cpu.statistics()

    def take_cpu_events(self) -> list[ManagerEvent]:
        """The CPU tier's residency events since the last call (``enable_events``)."""
        return self._cpu.take_events()

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget CPU blocks known to be bad (or a cache reset); those it forgot."""
        return self._cpu.remove(keys)

    def reset(self) -> None:
        """Forget every block of the CPU tier (vLLM's ``reset_cache``)."""
        self._cpu.reset()

    def prefix(self, keys: Sequence[bytes], in_flight: Container[bytes] = ()) -> int:
        """Length of the longest prefix of ``keys`` that some tier can serve; counted.

        A key counts for the CPU tier when it is ready there or in
        ``in_flight`` (a front's own stores and promotions: a load of it waits
        for them), else for the highest lower tier known to hold it. The
        prefix is marked recently used (its first key the last to go). For a
        front that loads a whole prefix itself (the Engine); vLLM's asks
        :meth:`lookup` key by key.
        """
        cpu = self._cpu
        n = cpu.lookup(keys)
        self._lookups += len(keys)
        in_cpu = n
        lower = self._lower
        reads: list[int] = [0] * len(lower)
        for key in keys[n:] if n < len(keys) else ():
            if key in in_flight or cpu.is_ready(key):
                in_cpu += 1
            else:
                for i, tier in enumerate(lower):
                    if key in tier.known:
                        reads[i] += 1
                        if self._decide and not self.worth_loading(i, reads[i]):
                            self._decline(i)
                            i = -1
                        break
                else:
                    i = -1
                if i < 0:
                    break
                lower[i].counts.lookup_hits += 1
            n += 1
        self._cpu_counts.lookup_hits += in_cpu
        if n:
            cpu.touch(keys[:n])
        return n

    def known(
        self, keys: Sequence[bytes], start: int, above: int, in_flight: Container[bytes] = ()
    ) -> int:
        """Past ``start``, the prefix of ``keys`` in ``in_flight``, ready in the CPU
        tier, or known to a lower tier above ``above`` (no side effect)."""
        n = start
        cpu = self._cpu
        for key in keys[start:]:
            if not (
                key in in_flight
                or cpu.is_ready(key)
                or ((tier := self.lower_of(key)) is not None and tier < above)
            ):
                break
            n += 1
        return n

    def worth_loading(self, index: int, m: int) -> bool:
        """Whether the ``m``-th block a request would read from lower tier ``index``
        arrives before recomputing ``m`` blocks would end.

        Arrival: the tier's measured seconds per delivered block times the
        blocks queued on it ahead plus these ``m``; recompute: ``m`` times the
        recompute cost, as set or measured. Without either measure yet, a load
        is always worth it (the first reads of a tier measure it).

        A tier is measured only by its reads, and a declined one is not read:
        one slow period would turn it off for good. So a request's first block
        of a tier that has not been read for :data:`REMEASURE_S` is read
        anyway: one block every so often measures it again.
        """
        r = self._recompute
        if r is None:
            return True
        tier = self._lower[index]
        s = tier.s_per_block()
        if s is None:
            return True
        if m == 1 and not tier.reading and self._clock() - tier.idle_since >= REMEASURE_S:
            return True
        return (tier.queued + m) * s <= m * r

    def _decline(self, index: int) -> None:
        self._declined += 1
        tier = self._lower[index]
        tier.counts.loads_declined += 1
        if not self._logged_declined:
            self._logged_declined = True
            s = tier.s_per_block() or 0.0
            log.warning(
                "kvtier: a block of the %s tier answered as a miss: reading it (%.3g ms a "
                "block, %d queued) would end after recomputing it (%.3g ms a block); "
                "logged once, counted as loads_declined",
                tier.spec.name,
                s * 1e3,
                tier.queued,
                (self._recompute or 0.0) * 1e3,
            )

    def lower_of(self, key: bytes) -> int | None:
        """The highest lower tier known to hold ``key``, or None (no side effect)."""
        for i, tier in enumerate(self._lower):
            if key in tier.known:
                return i
        return None

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
        todo = [k for k in keys if k not in self._cpu and self.lower_of(k) is not None]
        room = self.room() if todo else 0
        if not room:
            return []
        if len(todo) > room:
            todo = todo[: min(room, max(1, self._rows // 2))]
        plan = self._place(todo)
        if plan is None:
            return []
        by_tier: dict[int, list[tuple[bytes, int]]] = {}
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            tier = self.lower_of(k)
            assert tier is not None  # placed just now, known just before
            by_tier.setdefault(tier, []).append((k, slot))
        reads = []
        for i in sorted(by_tier):
            pairs = by_tier[i]
            read = Read(i, tuple(k for k, _s in pairs), tuple(s for _k, s in pairs), self._next())
            self._read(read)
            reads.append(read)
        return reads

    def follow_ups(self, read: Read) -> tuple[Read, ...]:
        """The reads that carry on ``read``'s undelivered blocks from lower tiers.

        Made when ``read``'s :class:`ReadDone` was settled: each block the
        tier did not deliver, held by a tier below it, is read from the
        highest such tier into the row it already had (the row stays
        reserved: not ready, not evictable), in one :class:`Read` per tier,
        each with ``follows`` set to ``read.seq``. A front that waits on
        ``read``'s blocks (the Engine's loads) asks right after that outcome
        and waits on these for the blocks they carry; the blocks of ``read``
        that are in neither ``loaded`` nor these reads are misses.

        Returns
        -------
        tuple of Read
            Empty when every block was delivered, or none is held below (or
            their wait is past ``lookup_deadline_s``), or once one of these
            reads has settled (ask right after ``read``'s outcome).
        """
        return self._follow_ups.get(read.seq, ())

    def evicting_writes(self, plan: StorePlan) -> tuple[Write, ...]:
        """The write-backs the rows of ``plan`` wait for (their evicted blocks)."""
        if not self._evicting:
            return ()  # the usual case, on every store's path
        out: dict[int, Write] = {}
        for slot in plan.slots:
            w = self._evicting.get(slot)
            if w is not None:
                out[w.seq] = w
        return tuple(out.values())

    def write_back(self) -> int:
        """Hand every write-back tier the ready blocks it lacks (at close); how many."""
        count = 0
        for i, tier in enumerate(self._lower):
            self._release_held(tier)
            if not tier.dirty:
                continue
            ready = [k for k in tier.dirty if self._cpu.is_ready(k) and k not in tier.known]
            tier.dirty.clear()
            if ready:
                tier.counts.write_backs += len(ready)
                count += len(ready)
                self._pin_and_write(i, ready)
        return count

    def abandon(self) -> int:
        """Forget what write-back tiers were still to be given (a close's timeout); how many."""
        left = {k for t in self._lower for k in t.dirty if self._cpu.is_ready(k)}
        for t in self._lower:
            self._release_held(t)
            t.dirty.clear()
        return len(left)

    def recovering(self, index: int) -> None:
        """Lower tier ``index`` refuses writes until its recovery ends.

        That end is a :class:`TierChanged` with ``recovered``. Meanwhile the
        blocks a write-back tier is owed stay pinned in their CPU rows: evicted,
        they would go to a write the tier refuses, and their only copy would
        be lost. Stores find fewer rows to evict meanwhile (a refusal is a
        recompute later; a lost block is not).
        """
        self._lower[index].recovering = True

    def probe(self, index: int, keys: Sequence[bytes]) -> Probe:
        """Ask lower tier ``index`` which of ``keys`` it holds: the :class:`Probe` queued."""
        self._lower[index].counts.probes += len(keys)
        probe = Probe(index, tuple(keys), self._next())
        self._intents.append(probe)
        return probe

    @property
    def busy(self) -> bool:
        """Reads, probes or writes are queued or in flight."""
        return bool(
            self._waiting
            or self._to_read
            or self._to_probe
            or self._intents
            or self._write_pins
            or self._evicting
            or self._deferred
        )

    @property
    def waiting(self) -> bool:
        """A lookup waits on a read or a probe (the front must keep stepping)."""
        return bool(self._waiting or self._to_read or self._to_probe)

    # -- intents and outcomes -------------------------------------------------------------

    def take_intents(self) -> list[Intent]:
        """What to carry out now: writes, reads into reserved rows, probes."""
        if not (self._intents or self._to_read or self._to_probe):
            return []  # most calls: a store with nothing below, a step with nothing new
        self._start_reads()
        for i, keys in self._to_probe.items():
            self._lower[i].counts.probes += len(keys)
            for k in keys:
                if (w := self._waiting.get(k)) is not None:
                    w.issued = True
            self._intents.append(Probe(i, tuple(keys), self._next()))
        self._to_probe.clear()
        out, self._intents = self._intents, []
        return out

    def settle(self, outcome: Outcome) -> None:
        """Apply an outcome a driver handed back."""
        if isinstance(outcome, Written):
            self._settle_write(outcome)
        elif isinstance(outcome, ReadDone):
            self._settle_read(outcome)
        elif isinstance(outcome, Probed):
            tier = self._lower[outcome.intent.tier]
            tier.learn(outcome.present, self._limit(tier))
            now, absent = self._clock(), tier.absent
            for k in outcome.intent.keys:
                if k not in outcome.present:
                    absent.pop(k, None)
                    absent[k] = now
            while absent and now - next(iter(absent.values())) >= self._probe_ttl:
                del absent[next(iter(absent))]
            for k in outcome.intent.keys:
                w = self._waiting.get(k)
                if w is not None and not w.read:
                    del self._waiting[k]  # the next lookup reads it, or asks the next tier
        else:
            tier = self._lower[outcome.tier]
            tier.learn(outcome.added, self._limit(tier))
            tier.forget(outcome.removed)
            self._orphaned(outcome.tier, outcome.removed)
            if outcome.recovered and tier.recovering:
                tier.recovering = False
                self._release_held(tier)

    def statistics(self) -> ChainStatistics:
        """A snapshot of the counters."""
        tiers = {"cpu": replace(self._cpu_counts)}  # copies: the snapshot does not move
        for t in self._lower:
            tiers[t.spec.name] = replace(t.counts, read_s_per_block=t.s_per_block())
        return ChainStatistics(
            tiers=tiers,
            lookups=self._lookups,
            store_refusals=self._refusals,
            deadline_misses=self._late,
            row_limit_misses=self._row_limited,
            loads_declined=self._declined,
            recompute_s_per_block=self._recompute,
            rows_held_by_writes=len(self._write_pins),
        )

    def is_waiting(self, key: bytes) -> bool:
        """Whether a lookup of ``key`` waits on a read or a probe."""
        return key in self._waiting or key in self._to_read

    # -- inside --------------------------------------------------------------------------

    def _place(self, keys: list[bytes]) -> StorePlan | None:
        n = min(len(keys), self.room())
        while n:
            plan = self._cpu.prepare_store(keys[:n])
            if plan is not None:
                if plan.evicted:
                    self._evicted(plan)
                return plan
            n //= 2  # the room counted rows this call's own keys would need to free
        return None

    def _evicted(self, plan: StorePlan) -> None:
        """A victim whose only copy is its row goes to each write-back tier lacking it
        first: the row is not reused until that write ends."""
        slot_of: dict[bytes, int] | None = None
        for i, tier in enumerate(self._lower):
            if not tier.dirty:
                continue
            if slot_of is None:
                slot_of = dict(zip(plan.evicted, plan.evicted_slots, strict=True))
            victims = [k for k in plan.evicted if k in tier.dirty]
            for k in victims:
                del tier.dirty[k]
            victims = [k for k in victims if k not in tier.known]
            if not victims:
                continue
            tier.counts.write_backs += len(victims)
            w = Write(
                i,
                tuple(victims),
                tuple(slot_of[k] for k in victims),
                evicting=True,
                seq=self._next(),
            )
            self._intents.append(w)
            for slot in w.rows:
                self._evicting[slot] = w

    def _mark_dirty(self, tier: _Lower, keys: Sequence[bytes]) -> None:
        tier.dirty.update(dict.fromkeys(keys))
        if tier.recovering:
            hold = [k for k in dict.fromkeys(keys) if k not in tier.held]
            if hold:
                self._cpu.prepare_load(hold)  # a pin against eviction, not a load
                tier.held.update(dict.fromkeys(hold))

    def _release_held(self, tier: _Lower) -> None:
        if tier.held:
            held = list(tier.held)
            tier.held.clear()
            self._cpu.complete_load(held)

    def _orphaned(self, index: int, keys: Sequence[bytes]) -> None:
        """A write-back tier dropped ``keys`` (evicted, or a peer's partition went):
        a block still ready in a CPU row has its only copy there again, so the
        tier is owed it (written when the CPU tier evicts it, or at close)."""
        tier = self._lower[index]
        if not keys or not tier.spec.write_back:
            return
        is_ready = self._cpu.is_ready
        owed = [k for k in keys if k not in tier.known and k not in tier.dirty and is_ready(k)]
        if owed:
            self._mark_dirty(tier, owed)

    def _measure_compute(self, keys: Sequence[bytes], ok: bool) -> None:
        """A step computed ``keys`` between their placement and now: one sample of
        the cost to compute a block (the slowest step bounds it from above)."""
        placing = self._placed
        assert placing is not None
        since = [t for k in keys if (t := placing.pop(k, None)) is not None]
        if not ok or not since:
            return
        sample = (self._clock() - min(since)) / len(keys)
        old = self._measured
        self._measured = sample if old is None else 0.8 * old + 0.2 * sample
        self._recompute = self._measured

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _limit(self, tier: _Lower) -> int:
        # A tier of this instance's own is known exactly; a shared one is bounded.
        return self._known_limit if tier.spec.shared else 1 << 62

    def _start_reads(self) -> None:
        if not self._to_read:
            return
        waiting = self._waiting
        wanted = [(k, t) for k, t in self._to_read.items() if k not in self._cpu and k in waiting]
        self._to_read.clear()
        plan = self._place([k for k, _t in wanted]) if wanted else None
        placed = set() if plan is None else set(plan.keys)
        now = self._clock()
        for k, _t in wanted:
            if k not in placed:
                # No row now: queued again within its deadline; past it, dropped
                # (nobody may look it up again to drop it).
                w = self._waiting.get(k)
                if w is not None and w.read:
                    if now - w.since < self._deadline:
                        self._to_read[k] = w.tier
                    else:
                        del self._waiting[k]
        if plan is None:
            return
        tier_of = dict(wanted)
        for k in plan.keys:
            waiting[k].issued = True
        for i in sorted({tier_of[k] for k in plan.keys}):
            pairs = [(k, s) for k, s in zip(plan.keys, plan.slots, strict=True) if tier_of[k] == i]
            read = Read(i, tuple(k for k, _s in pairs), tuple(s for _k, s in pairs), self._next())
            self._lookup_reads.add(read.seq)  # its blocks are lookup hits of that tier
            self._read(read)

    def _settle_read(self, done: ReadDone) -> None:
        read = done.intent
        tier = self._lower[read.tier]
        good = [k for k in read.keys if k in done.loaded]
        # The tier's cost per delivered block, over busy periods (overlapping
        # reads count once), recent ones weighing most.
        tier.reading -= 1
        tier.queued -= len(read.keys)
        tier.period_blocks += len(good)
        if not tier.reading:
            now = self._clock()
            tier.busy = 0.8 * tier.busy + (now - tier.since)
            tier.delivered = 0.8 * tier.delivered + tier.period_blocks
            tier.period_blocks = 0
            tier.idle_since = now
        bad = [k for k in read.keys if k not in done.loaded]
        since = self._read_since.pop(read.seq, None)
        if read.follows:
            self._follow_ups.pop(read.follows, None)  # its front has asked by now
        if good:
            self._cpu.complete_store(good, True)
            tier.counts.blocks_out += len(good)
        lookup = read.seq in self._lookup_reads
        if lookup:  # (a front's own promotions were counted by prefix)
            self._lookup_reads.discard(read.seq)
            tier.counts.lookup_hits += len(good)
        again: set[bytes] = set()
        if bad:
            tier.counts.read_failures += len(bad)
            tier.forget(bad)  # vanished, damaged or unreachable
            again = self._fall_through(read, bad, since, lookup)
            lost = [k for k in bad if k not in again]
            if lost:
                self._cpu.complete_store(lost, False)
        for k in read.keys:
            if k not in again:
                self._waiting.pop(k, None)
        if good and tier.spec.promote_up and read.tier:
            self._write_down(good, range(read.tier), store=False)

    def _fall_through(
        self, read: Read, bad: Sequence[bytes], since: float | None, lookup: bool
    ) -> set[bytes]:
        """Read the blocks ``read`` did not deliver from the tiers below its own that
        hold them, into the same rows (still reserved); the keys read again.

        Only tiers below: each block falls through the chain at most once per
        tier, so it ends. A block whose wait (its lookup's, else its first
        read's) is past the deadline is a miss instead: its lookup answers
        MISS by now, and a stalled tier must not hold its row longer.
        """
        now = self._clock()
        lower = self._lower
        waiting = self._waiting
        failed = set(bad)
        by_tier: dict[int, list[tuple[bytes, int]]] = {}
        for k, slot in zip(read.keys, read.rows, strict=True):
            if k not in failed:
                continue
            w = waiting.get(k)
            began = w.since if w is not None else since
            if began is not None and now - began >= self._deadline:
                continue
            below = next((j for j in range(read.tier + 1, len(lower)) if k in lower[j].known), -1)
            if below < 0:
                continue
            by_tier.setdefault(below, []).append((k, slot))
            if w is not None:
                w.tier = below
        if not by_tier:
            return set()
        reads = []
        for j in sorted(by_tier):
            pairs = by_tier[j]
            again = Read(
                j,
                tuple(k for k, _s in pairs),
                tuple(s for _k, s in pairs),
                self._next(),
                follows=read.seq,
            )
            if lookup:
                self._lookup_reads.add(again.seq)
            self._read(again, since)
            reads.append(again)
        self._follow_ups[read.seq] = tuple(reads)
        return {k for r in reads for k in r.keys}

    def _settle_write(self, done: Written) -> None:
        write = done.intent
        tier = self._lower[write.tier]
        tier.learn(done.stored, self._limit(tier))
        tier.forget(done.evicted)
        self._orphaned(write.tier, done.evicted)
        ok = [k for k in write.keys if k in done.stored]
        tier.counts.blocks_in += len(ok)
        tier.counts.write_failures += len(write.keys) - len(ok)
        if not write.evicting:
            self._unpin_written(write.keys)
            return
        for slot in write.rows:
            if self._evicting.get(slot) is write:
                del self._evicting[slot]
        if self._deferred:
            waiting, self._deferred = self._deferred, []
            for read in waiting:
                self._read(read)

    def _write_down(self, keys: Sequence[bytes], tiers: Iterable[int], *, store: bool) -> None:
        """Write ready CPU blocks to ``tiers`` that lack them: rows pinned per write."""
        for i in tiers:
            tier = self._lower[i]
            if store and not tier.spec.takes_stores:
                continue
            todo = [k for k in keys if k not in tier.known]
            if not todo:
                continue
            if tier.spec.write_back:
                self._mark_dirty(tier, todo)  # written when evicted, or at close
                continue
            self._pin_and_write(i, todo)

    def _pin_and_write(self, index: int, keys: Sequence[bytes]) -> None:
        plan = self._cpu.prepare_load(keys)  # a pin held for the write, not a load
        for k in keys:
            self._write_pins[k] = self._write_pins.get(k, 0) + 1
        self._intents.append(Write(index, plan.keys, plan.slots, seq=self._next()))

    def _read(self, read: Read, since: float | None = None) -> None:
        """Issue ``read``, or hold it while one of its rows is still being written back.

        ``since``: when its blocks' first read was issued (a read that follows
        another), else now.
        """
        self._read_since.setdefault(read.seq, self._clock() if since is None else since)
        if self._evicting and any(s in self._evicting for s in read.rows):
            self._deferred.append(read)
            return
        self._intents.append(read)
        tier = self._lower[read.tier]
        if not tier.reading:
            tier.since = self._clock()
        tier.reading += 1
        tier.queued += len(read.keys)

    def _unpin_written(self, keys: Sequence[bytes]) -> None:
        self._cpu.complete_load(keys)
        pins = self._write_pins
        for k in keys:
            left = pins[k] - 1
            if left:
                pins[k] = left
            else:
                del pins[k]
