"""Per-request deadlines and the row limit: a front that names its requests (vLLM's).

vLLM looks a waiting request's prefix up key by key, once per scheduler step,
and defers the request while any answer is RETRY or PENDING. The chain
(:class:`~kvtier.chain.Chain`) owns one :class:`Deadlines` table that keeps
two rules per request, not per key:

* **Its wait is bounded.** From its first RETRY or PENDING answer, a request
  may wait ``lookup_deadline_s``; past it every answer but HIT is MISS, so it
  loads what is in CPU rows and recomputes the rest. (Per key, a wait would
  start afresh each time a promoted block was evicted before the request came
  back.) What it waits on is kvtier's, not the engine's: when everything its
  last pass waited on was delivered (read into CPU rows, or stored from the
  device) before its next pass, the time between the passes was the engine's
  (vLLM revisits a deferred request seconds apart under load), and its wait
  starts afresh. A block delivered to it twice and gone again before it came
  back is one the CPU tier is too small to keep for it: a wait on it answers
  MISS at once, counted with the row limit's misses (``row_limit_misses``),
  not as a late tier.
* **Its prefix fits the CPU tier.** Only as many leading keys as the CPU tier
  has rows can be loaded at once (every load is staged through a row): a key
  past that is MISS, counted in ``row_limit_misses``.

A key seen again starts a new pass (the next step's lookup). A finished
request is forgotten (:meth:`Deadlines.forget`); requests idle for long are
forgotten anyway. Misses past a deadline (the request's, or a key's own wait
on a read or a probe, which the chain checks) are counted here, and logged once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["Deadlines"]

log = logging.getLogger("kvtier.chain")


@dataclass(slots=True)
class _Request:
    """One request's lookups."""

    seen: dict[bytes, None] = field(default_factory=dict)
    """Keys looked up in its current pass over its prefix."""
    since: float | None = None
    """When its current wait began (its first RETRY or PENDING), or None."""
    deferred: bool = False
    """Its current pass answered RETRY or PENDING somewhere."""
    last: float = 0.0
    """When it last looked a key up."""
    from_lower: dict[int, int] = field(default_factory=dict)
    """Blocks of its current pass to be read from each lower tier (the load decision's)."""
    begun: float = 0.0
    """When its current pass began."""
    waited: list[bytes] = field(default_factory=list)
    """Keys of its current pass that answered RETRY or PENDING."""
    got: set[bytes] = field(default_factory=set)
    """Keys it waited on and had delivered since it came (see the module docstring)."""
    again: frozenset[bytes] = frozenset()
    """Keys delivered to it twice: a wait on one in its current pass is a row miss."""


class Deadlines:
    """The requests looking up, their waits and the row limit (see the module docstring).

    Parameters
    ----------
    deadline_s
        How long a lookup may wait (``lookup_deadline_s``).
    rows
        The CPU tier's rows: the most leading keys of one request that can load.
    clock
        Monotonic seconds (the chain's).
    """

    def __init__(self, deadline_s: float, rows: int, clock: Callable[[], float]) -> None:
        self.deadline_s = deadline_s
        self.late = 0
        """Lookups answered MISS because a wait outlasted the deadline."""
        self.row_limited = 0
        """Lookups answered MISS because the request's prefix before them needed every row."""
        self._rows = rows
        self._remember = max(1024, 4 * rows)
        self._clock = clock
        self._requests: dict[object, _Request] = {}
        """Requests looking up, least recently active first."""
        self._forget_after = max(60.0, 10 * deadline_s)
        self._logged = False
        self._awaited: set[bytes] = set()
        """Keys some request's pass waits on, not yet delivered."""
        self._delivered: dict[bytes, float] = {}
        """When awaited keys were delivered, oldest first (bounded)."""

    def __len__(self) -> int:
        """Requests remembered now."""
        return len(self._requests)

    def enter(self, request: object, key: bytes) -> _Request | None:
        """``request`` looks ``key`` up now: its record, or None when ``key`` is past
        the row limit (counted; the lookup is a MISS)."""
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
            again: frozenset[bytes] = frozenset()
            if not req.deferred:
                req.since = None  # the last pass was answered: a new wait
            elif self._all_delivered(req):
                req.since = None  # the engine's gap between passes, not kvtier's wait
                got = req.got
                again = frozenset(k for k in req.waited if k in got)  # delivered twice
                got.update(req.waited)
            req.again = again
            seen.clear()
            req.from_lower.clear()
            req.waited.clear()
            req.deferred = False
            req.begun = now
        elif not seen:
            req.begun = now
        seen[key] = None
        if len(seen) > self._rows:
            self.row_limited += 1
            return None
        return req

    def wait(self, req: _Request, key: bytes) -> bool:
        """The lookup of ``key`` just entered for ``req`` answers RETRY or PENDING:
        whether it may (False past the request's deadline: a MISS, counted)."""
        now = req.last  # when the lookup entered
        if key in req.again:  # its delivery was evicted twice before it came back
            self.row_limited += 1
            return False
        if req.since is None:
            req.since = now
        elif now - req.since >= self.deadline_s:
            self.miss_late("its request's wait")
            return False
        req.deferred = True
        req.waited.append(key)
        if len(self._awaited) >= self._remember:
            self._awaited.clear()  # reads that never settled: forget them, not the rule
        self._awaited.add(key)
        return True

    def delivered(self, keys: Iterable[bytes]) -> None:
        """``keys`` arrived in CPU rows (a read, or a store from the device)."""
        awaited = self._awaited
        if not awaited:
            return
        got = awaited.intersection(keys)
        if not got:
            return
        awaited.difference_update(got)
        now, delivered = self._clock(), self._delivered
        for k in got:
            delivered.pop(k, None)
            delivered[k] = now
        while len(delivered) > self._remember:
            del delivered[next(iter(delivered))]

    def _all_delivered(self, req: _Request) -> bool:
        """Everything ``req``'s last pass waited on arrived after that pass began."""
        delivered, begun = self._delivered, req.begun
        return bool(req.waited) and all(delivered.get(k, -1.0) >= begun for k in req.waited)

    def miss_late(self, what: str) -> None:
        """A lookup answered MISS because its wait on ``what`` outlasted the deadline."""
        self.late += 1
        if not self._logged:
            self._logged = True
            log.warning(
                "kvtier: a lookup waited on %s for more than %.3f s (lookup_deadline_s): "
                "answered as a miss, the block is recomputed; logged once, counted as "
                "lookup_deadline_misses",
                what,
                self.deadline_s,
            )

    def forget(self, request: object) -> None:
        """``request`` looks nothing up any more (it finished)."""
        self._requests.pop(request, None)
        if not self._requests:
            self._awaited.clear()  # nobody waits: what a lost read left here goes

    def _sweep(self, now: float) -> None:
        requests = self._requests
        while requests:
            oldest = next(iter(requests))
            if now - requests[oldest].last < self._forget_after:
                return
            del requests[oldest]
        self._awaited.clear()
