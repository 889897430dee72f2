"""Lookups: where a key can be served from now, as each front asks it.

The chain (:class:`~kvtier.chain.Chain`) owns one :class:`Lookups` and hands
the fronts its answers:

* **key by key, stepping** (vLLM's scheduler, :meth:`Lookups.lookup`): a key
  ready in a CPU row is a HIT; one whose store is in flight PENDING; one a
  lower tier holds is queued for a read into a CPU row, one no tier is known
  to hold asked of a shared tier (a probe), both answering RETRY until they
  end or their wait is past ``lookup_deadline_s`` (then MISS). With a
  request named, its deadline and row limit
  (:class:`~kvtier.chain._deadlines.Deadlines`) and the load-or-recompute
  decision (:class:`~kvtier.chain._decision.LoadDecision`) apply;
* **a whole prefix at once** (the Engine, :meth:`Lookups.prefix`), counted per
  tier, for a front that loads the prefix itself.

It queues the reads and probes that lookups wait on; the chain places their
rows, issues them, and tells it how each went (:meth:`Lookups.reads_due`,
:meth:`Lookups.probed`, :meth:`Lookups.ended`). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from kvtier.chain._deadlines import Deadlines
from kvtier.chain._decision import LoadDecision
from kvtier.chain._lower import Lower
from kvtier.chain._messages import Answer, Probed
from kvtier.chain._statistics import TierCounts
from kvtier.manager import ResidencyManager

__all__ = ["Lookups"]


_NO_ROW_MARKS = 1 << 16
"""The most keys marked as having found no row, waiting for their next lookup."""


@dataclass(slots=True)
class _Waiting:
    """A key a lookup is waiting on: read or probed since ``since``."""

    since: float
    tier: int = -1
    """The tier it is read from; -1 while probed."""
    read: bool = False
    issued: bool = False
    """Its read or probe went to the driver (else it waits for a row)."""


class Lookups:
    """The fronts' lookups over one chain (see the module docstring).

    Parameters
    ----------
    cpu, cpu_counts
        The CPU tier's residency and the chain's counts for it.
    lower
        The chain's records of its lower tiers.
    decision, deadlines
        The chain's load-or-recompute decision and per-request deadlines.
    probe_ttl_s
        How long a shared tier's "absent" answer stands before a lookup asks again.
    row_wait_s
        How long a lookup's read may wait for a CPU row to come free (rows held
        by device copies and writes free within a few scheduler steps); past
        it the lookup answers MISS at once, counted with the row limit's.
    clock
        Monotonic seconds (the chain's).
    """

    def __init__(
        self,
        cpu: ResidencyManager,
        cpu_counts: TierCounts,
        lower: Sequence[Lower],
        decision: LoadDecision,
        deadlines: Deadlines,
        *,
        probe_ttl_s: float,
        row_wait_s: float = 0.1,
        clock: Callable[[], float],
    ) -> None:
        self._cpu = cpu
        self._counts = cpu_counts
        self._lower = lower
        self._decision = decision
        self._deadlines = deadlines
        self._deadline = deadlines.deadline_s
        self._probe_ttl = probe_ttl_s
        self._row_wait = min(row_wait_s, self._deadline)
        self._no_row: dict[bytes, float] = {}
        """Keys whose read found no row in ``row_wait_s``, and when: their next lookup
        is a MISS (oldest first), however late it comes: vLLM revisits a deferred
        request seconds apart under load, and that request's wait was for rows."""
        self._no_row_ttl = max(60.0, 10 * self._deadline)
        """How long a mark waits for its next lookup (the requests' own memory)."""
        self._clock = clock
        self.count = 0
        """Keys looked up."""
        self._waiting: dict[bytes, _Waiting] = {}
        self._to_read: dict[bytes, int] = {}  # key -> tier, in lookup order
        self._to_probe: dict[int, dict[bytes, None]] = {}

    @property
    def busy(self) -> bool:
        """A lookup waits on a read or a probe (queued or in flight)."""
        return bool(self._waiting or self._to_read or self._to_probe)

    @property
    def due(self) -> bool:
        """Reads or probes wait to be issued (:meth:`reads_due`, :meth:`probes_due`)."""
        return bool(self._to_read or self._to_probe)

    # -- what the fronts ask -------------------------------------------------------------

    def lookup(self, key: bytes, request: object = None) -> Answer:
        """Where ``key`` can be served from now; queues a read or a probe when it helps.

        Parameters
        ----------
        key
            The block's key.
        request
            Who asks (any hashable; vLLM's request id), for a front that looks
            a request's prefix up key by key, in order, once per scheduler
            step, as vLLM does. Then two rules hold per request, not per key
            (:class:`~kvtier.chain._deadlines.Deadlines`): its wait is bounded
            by ``lookup_deadline_s`` from its first RETRY or PENDING, and only
            as many leading keys as the CPU tier has rows can load (a key past
            that is MISS, counted in ``row_limit_misses``). A lower tier's
            block whose read would end after its recompute is MISS
            (``loads_declined``); a HIT is marked recently used, so that the
            request's own promotions evict other blocks first. A key seen
            again starts a new pass (the next step's lookup);
            :meth:`forget_request` drops a finished request (requests idle for
            long are dropped anyway).
        """
        if request is None:
            return self._lookup(key)
        req = self._deadlines.enter(request, key)
        if req is None:  # past the row limit
            self.count += 1
            return Answer.MISS
        decision = self._decision
        if decision.enabled and key not in self._waiting and key not in self._cpu:
            tier = self.lower_of(key)
            if tier is not None:  # a read would start: is it worth it?
                m = req.from_lower.get(tier, 0) + 1
                if not decision.worth_loading(tier, m):
                    self.count += 1
                    decision.decline(tier)
                    return Answer.MISS
                req.from_lower[tier] = m
        answer = self._lookup(key)
        if answer is Answer.HIT:
            self._cpu.touch((key,))
        elif answer is not Answer.MISS and not self._deadlines.wait(req, key):
            return Answer.MISS
        return answer

    def locate(self, key: bytes, request: object = None) -> Answer:
        """Whether a lower tier can serve ``key``, for a front with a CPU tier of its
        own above the chain (:mod:`kvtier.below`): it reads a HIT itself, into its
        own slot (:meth:`~kvtier.chain.Chain.read_into`), so no read starts here.

        HIT when a lower tier is known to hold ``key`` (and reading it beats
        recomputing it: else MISS, counted in ``loads_declined``); RETRY while a
        shared tier is asked (a probe), MISS past ``lookup_deadline_s``; else
        MISS. ``request`` as in :meth:`lookup` (its wait is bounded; the row
        limit is the chain's ``row_limit``).
        """
        req = None
        if request is not None:
            req = self._deadlines.enter(request, key)
            if req is None:  # past the row limit
                self.count += 1
                return Answer.MISS
        tier = self.lower_of(key)
        if tier is None:
            self.count += 1
            waiting = self._waiting.get(key)
            if waiting is None:
                answer = self._ask(key)
            elif self._clock() - waiting.since < self._deadline:
                answer = Answer.RETRY
            else:
                self._deadlines.miss_late("a shared tier")
                answer = Answer.MISS
            if answer is Answer.RETRY and req is not None and not self._deadlines.wait(req, key):
                return Answer.MISS
            return answer
        self.count += 1
        self._waiting.pop(key, None)  # a probe found it
        decision = self._decision
        if decision.enabled:
            m = (req.from_lower.get(tier, 0) if req is not None else 0) + 1
            if not decision.worth_loading(tier, m):
                decision.decline(tier)
                return Answer.MISS
            if req is not None:
                req.from_lower[tier] = m
        self._lower[tier].counts.lookup_hits += 1
        return Answer.HIT

    def forget_request(self, request: object) -> None:
        """``request`` looks nothing up any more (it finished)."""
        self._deadlines.forget(request)

    def delivered(self, keys: Sequence[bytes]) -> None:
        """``keys`` arrived in CPU rows: a request whose last pass waited on them
        did not wait on kvtier since (:class:`~kvtier.chain._deadlines.Deadlines`)."""
        self._deadlines.delivered(keys)

    def is_waiting(self, key: bytes) -> bool:
        """Whether a lookup of ``key`` waits on a read or a probe."""
        return key in self._waiting or key in self._to_read

    def lower_of(self, key: bytes) -> int | None:
        """The highest lower tier known to hold ``key``, or None (no side effect)."""
        for i, tier in enumerate(self._lower):
            if key in tier.known:
                return i
        return None

    def prefix(self, keys: Sequence[bytes], in_flight: Container[bytes] = ()) -> int:
        """Length of the longest prefix of ``keys`` that some tier can serve; counted.

        A key counts for the CPU tier when it is ready there or in
        ``in_flight`` (a front's own stores and promotions: a load of it waits
        for them), else for the highest lower tier known to hold it (unless
        reading it would lose to recomputing it). The prefix is marked
        recently used (its first key the last to go). For a front that loads
        a whole prefix itself (the Engine); vLLM's asks :meth:`lookup` key by key.
        """
        cpu, decision = self._cpu, self._decision
        n = cpu.lookup(keys)
        self.count += len(keys)
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
                        if decision.enabled and not decision.worth_loading(i, reads[i]):
                            decision.decline(i)
                            i = -1
                        break
                else:
                    i = -1
                if i < 0:
                    break
                lower[i].counts.lookup_hits += 1
            n += 1
        self._counts.lookup_hits += in_cpu
        if n:
            cpu.touch(keys[:n])
        return n

    def known(
        self, keys: Sequence[bytes], start: int, above: int, in_flight: Container[bytes] = ()
    ) -> int:
        """Past ``start``, the prefix of ``keys`` in ``in_flight``, ready in the CPU
        tier, or known to a lower tier above ``above`` (no side effect)."""
        n = start
        is_ready = self._cpu.is_ready
        for key in keys[start:]:
            if not (
                key in in_flight
                or is_ready(key)
                or ((tier := self.lower_of(key)) is not None and tier < above)
            ):
                break
            n += 1
        return n

    # -- the chain's side: the reads and probes lookups wait on ---------------------------

    def reads_due(self) -> list[tuple[bytes, int]]:
        """The reads lookups wait on that are not issued yet: each key and its tier,
        in lookup order (taken: hand those that get no row to :meth:`unplaced`)."""
        waiting, cpu = self._waiting, self._cpu
        wanted = [(k, t) for k, t in self._to_read.items() if k not in cpu and k in waiting]
        self._to_read.clear()
        return wanted

    def unplaced(self, keys: Sequence[bytes]) -> None:
        """No row for the reads of ``keys`` now: queued again while a row may come
        free soon (``row_wait_s`` from their lookup); past that, dropped, and their
        lookups answer MISS at once (the request recomputes them rather than wait
        for rows that device copies and writes hold)."""
        now = self._clock()
        for k in keys:
            w = self._waiting.get(k)
            if w is not None and w.read:
                if now - w.since < self._row_wait:
                    self._to_read[k] = w.tier
                else:
                    del self._waiting[k]
                    no_row = self._no_row
                    no_row.pop(k, None)
                    no_row[k] = now  # oldest first
                    if len(no_row) > _NO_ROW_MARKS:
                        del no_row[next(iter(no_row))]

    def issued(self, keys: Sequence[bytes]) -> None:
        """The reads of ``keys`` went to the driver."""
        waiting = self._waiting
        for k in keys:
            waiting[k].issued = True

    def probes_due(self) -> list[tuple[int, tuple[bytes, ...]]]:
        """The probes lookups wait on, per shared tier (taken: they go to the driver)."""
        out = []
        for i, keys in self._to_probe.items():
            for k in keys:
                if (w := self._waiting.get(k)) is not None:
                    w.issued = True
            out.append((i, tuple(keys)))
        self._to_probe.clear()
        return out

    def probed(self, done: Probed) -> None:
        """A probe ended: what the tier holds is known, what it lacks is absent for a while."""
        tier = self._lower[done.intent.tier]
        tier.learn(done.present)
        now, absent = self._clock(), tier.absent
        for k in done.intent.keys:
            if k not in done.present:
                absent.pop(k, None)
                absent[k] = now
        while absent and now - next(iter(absent.values())) >= self._probe_ttl:
            del absent[next(iter(absent))]
        for k in done.intent.keys:
            w = self._waiting.get(k)
            if w is not None and not w.read:
                del self._waiting[k]  # the next lookup reads it, or asks the next tier

    def began(self, key: bytes) -> float | None:
        """When the wait of a lookup of ``key`` began, or None (none waits)."""
        w = self._waiting.get(key)
        return None if w is None else w.since

    def moved(self, key: bytes, tier: int) -> None:
        """The read a lookup of ``key`` waits on goes on from lower tier ``tier``."""
        w = self._waiting.get(key)
        if w is not None:
            w.tier = tier

    def ended(self, keys: Sequence[bytes]) -> None:
        """The reads of ``keys`` ended (delivered, or a miss): no lookup waits on them."""
        for k in keys:
            self._waiting.pop(k, None)

    # -- inside --------------------------------------------------------------------------

    def _had_no_row(self, key: bytes) -> bool:
        """Whether ``key``'s read found no row in time (its next lookup, and only that
        one, is a MISS: the request recomputes it; a later pass tries again);
        forgets marks nobody came back for (their request is forgotten too)."""
        no_row, now = self._no_row, self._clock()
        while no_row and now - next(iter(no_row.values())) >= self._no_row_ttl:
            del no_row[next(iter(no_row))]
        return no_row.pop(key, None) is not None

    def _lookup(self, key: bytes) -> Answer:
        self.count += 1
        cpu = self._cpu
        if cpu.lookup((key,)):
            self._counts.lookup_hits += 1
            self._waiting.pop(key, None)
            return Answer.HIT
        if self._no_row and self._had_no_row(key):
            self._deadlines.row_limited += 1
            return Answer.MISS
        waiting = self._waiting.get(key)
        if waiting is not None:
            if self._clock() - waiting.since < self._deadline:
                return Answer.RETRY
            if not waiting.issued:
                # Never started (no row came free in time): forget it; a later
                # lookup starts afresh.
                del self._waiting[key]
                self._to_read.pop(key, None)
            where = self._lower[waiting.tier].spec.name if waiting.read else "a shared tier"
            self._deadlines.miss_late(f"a read from the {where} tier" if waiting.read else where)
            return Answer.MISS
        if key in cpu:
            return Answer.PENDING  # its store from the device is in flight
        for i, tier in enumerate(self._lower):
            if key in tier.known:
                self._to_read.setdefault(key, i)
                self._waiting[key] = _Waiting(self._clock(), i, read=True)
                return Answer.RETRY
        return self._ask(key)

    def _ask(self, key: bytes) -> Answer:
        """``key`` is in no tier this instance knows of: RETRY while a shared tier is
        asked whether it holds it (a probe queued), else MISS."""
        now = self._clock()
        for i, tier in enumerate(self._lower):
            if tier.spec.shared and now - tier.absent.get(key, -1e300) >= self._probe_ttl:
                self._to_probe.setdefault(i, {})[key] = None
                self._waiting[key] = _Waiting(now)
                return Answer.RETRY
        return Answer.MISS
