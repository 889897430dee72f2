"""Carries out a :class:`~kvtier.chain.Chain`'s intents on the tiers' own event loop.

The chain decides on its owner's thread and never does I/O; a
:class:`TierDriver` lives on the loop that owns the tiers (kvtier's loop
thread under vLLM) and turns each intent into a tier call, then hands the
outcome to ``post`` when the call ends (on the loop: the runtime's, which
settles it or queues it for the chain's thread). Every intent gets exactly
one outcome, also when the tier refuses or fails it: the chain's pins are
released only through outcomes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvtier.chain._messages import Intent, Probe, Probed, Read, ReadDone, Write, Written
from kvtier.errors import KVTierError
from kvtier.region import Rows
from kvtier.tiers.base import LoadResult, Refreshable, StoreResult, Tier
from kvtier.transfer.completion import Completion

__all__ = ["TierDriver"]

R = TypeVar("R")

log = logging.getLogger("kvtier.chain")

_LOGGED_PER_TIER = 3
"""Failures logged per tier and kind before the rest are only counted."""


class TierDriver:
    """The tiers below the CPU region, driven by intents (loop thread only).

    Parameters
    ----------
    tiers
        The open tiers, in the chain's order.
    names
        Their names (the chain's), for logs.
    region
        The rows the intents name (the CPU region, or the slots of a front's own CPU tier).
    post
        Receives every outcome, on the loop, as its tier call ends.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        names: Sequence[str],
        region: Rows,
        post: Callable[[Written | ReadDone | Probed], None],
    ) -> None:
        self.tiers = list(tiers)
        self._names = list(names)
        self._region = region
        self._post = post
        self._logged: dict[tuple[int, str], int] = {}

    def carry_out(self, intent: Intent) -> None:
        """Start ``intent``; its outcome is posted when it ends (never raises)."""
        if isinstance(intent, Write):
            self._write(intent)
        elif isinstance(intent, Read):
            self._read(intent)
        else:
            self._probe(intent)

    # -- inside --------------------------------------------------------------------------

    def _rows(self, slots: Sequence[int]) -> list[memoryview]:
        return [self._region.row(s) for s in slots]

    def _write(self, w: Write) -> None:
        tier = self.tiers[w.tier]

        def outcome(res: StoreResult | None) -> Written:
            if res is None:
                return Written(w, frozenset())
            for key, err in list(res.failed.items())[:1]:
                self._warn(w.tier, "write", f"block {key.hex()} not written: {err}")
            return Written(w, frozenset((*res.stored, *res.skipped)), res.evicted)

        self._start(w.tier, "write", lambda: tier.store(w.keys, self._rows(w.rows)), outcome)

    def _read(self, r: Read) -> None:
        tier = self.tiers[r.tier]

        def outcome(res: LoadResult | None) -> ReadDone:
            if res is None:
                return ReadDone(r, frozenset())
            for key, err in list(res.missing.items())[:1]:
                self._warn(r.tier, "read", f"block {key.hex()} not loaded: {err}")
            return ReadDone(r, frozenset(res.loaded))

        self._start(r.tier, "read", lambda: tier.load(r.keys, self._rows(r.rows)), outcome)

    def _start(
        self,
        index: int,
        kind: str,
        call: Callable[[], Completion[R]],
        outcome: Callable[[R | None], Written | ReadDone],
    ) -> None:
        """Run a tier call; post ``outcome(result)``, or ``outcome(None)`` when it failed."""
        try:
            comp = call()
        except KVTierError as exc:  # refused before any I/O (closed, recovering, ...)
            self._warn(index, kind, f"refused: {exc}")
            self._post(outcome(None))
            return

        def done(c: Completion[R]) -> None:
            exc = c.exception()
            if exc is not None:
                self._warn(index, kind, f"failed: {exc}")
                self._post(outcome(None))
            else:
                self._post(outcome(c.result()))

        comp.add_done_callback(done)

    def _probe(self, p: Probe) -> None:
        tier = self.tiers[p.tier]
        if not isinstance(tier, Refreshable):
            self._post(Probed(p, frozenset(k for k in p.keys if tier.is_ready(k))))
            return
        task = asyncio.ensure_future(tier.refresh(p.keys))

        def done(t: asyncio.Future[int]) -> None:
            if not t.cancelled() and t.exception() is not None:
                self._warn(p.tier, "probe", f"asking the tier failed: {t.exception()}")
            # What the tier knows now, whether or not every node answered.
            self._post(Probed(p, frozenset(k for k in p.keys if tier.is_ready(k))))

        task.add_done_callback(done)

    def _warn(self, index: int, kind: str, message: str) -> None:
        n = self._logged.get((index, kind), 0)
        self._logged[(index, kind)] = n + 1
        if n < _LOGGED_PER_TIER:
            log.warning("kvtier %s tier: %s", self._names[index], message)
        elif n == _LOGGED_PER_TIER:
            log.warning(
                "kvtier %s tier: more %s failures: counted, not logged",
                self._names[index],
                kind,
            )
