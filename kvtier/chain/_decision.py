"""Load or recompute: whether a lower tier's block arrives before its recompute would end.

The chain (:class:`~kvtier.chain.Chain`) owns one :class:`LoadDecision` and
asks it before a lookup starts a read from a lower tier. It knows both sides
from what the chain already sees:

* each lower tier's delivered seconds per block: its reads' busy periods
  (overlapping reads counted once) against the blocks they delivered, recent
  periods weighing most, and the blocks queued on it now;
* what recomputing a block costs: set (``recompute_s_per_block``), or measured
  from the time between a store's placement and its end, where a front's
  stores follow the compute that made the blocks (vLLM's).

Without either measure a load is always worth it (the first reads of a tier
measure it). No I/O, no thread: the chain's owner calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["REMEASURE_S", "LoadDecision"]

log = logging.getLogger("kvtier.chain")

REMEASURE_S = 10.0
"""A lower tier unread this long gets a request's first block read, declined or not,
so that the load-or-recompute decision measures it again (:meth:`LoadDecision.worth_loading`)."""


@dataclass(slots=True)
class _Reads:
    """One lower tier's reads, as the decision measures them."""

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
    declined: int = 0
    """Its blocks that lookups answered as misses (loading them would lose)."""

    def s_per_block(self) -> float | None:
        return self.busy / self.delivered if self.delivered else None


class LoadDecision:
    """The load-or-recompute decision of one chain (see the module docstring).

    Parameters
    ----------
    names
        The lower tiers' names, in the chain's order (for the log).
    enabled
        Whether a slow load is declined at all (``decline_slow_loads``).
    recompute_s_per_block
        What recomputing a block costs, in seconds, or None: unknown.
    measure_recompute
        Without a set cost, measure it from the time between :meth:`placed`
        and :meth:`computed` (a front whose stores follow the compute that
        made the blocks: vLLM's).
    clock
        Monotonic seconds (the chain's).
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        enabled: bool,
        recompute_s_per_block: float | None,
        measure_recompute: bool,
        clock: Callable[[], float],
    ) -> None:
        self.enabled = enabled
        """Whether a lookup asks :meth:`worth_loading` at all."""
        self.declined = 0
        """Blocks lookups answered as misses because loading them would lose."""
        self._names = list(names)
        self._reads = [_Reads() for _ in self._names]
        self._recompute = recompute_s_per_block
        self._clock = clock
        self._placed: dict[bytes, float] | None = (
            {} if measure_recompute and recompute_s_per_block is None else None
        )
        """Measuring: when each key was placed (its compute's step began)."""
        self.measuring = self._placed is not None
        """Whether :meth:`placed` and :meth:`computed` measure the recompute cost."""
        self._measured: float | None = None
        self._logged = False

    @property
    def recompute_s_per_block(self) -> float | None:
        """What recomputing one block costs, as set or measured; None: unknown."""
        return self._recompute

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
        tier = self._reads[index]
        s = tier.s_per_block()
        if s is None:
            return True
        if m == 1 and not tier.reading and self._clock() - tier.idle_since >= REMEASURE_S:
            return True
        return (tier.queued + m) * s <= m * r

    def decline(self, index: int) -> None:
        """A lookup answered a block of lower tier ``index`` as a miss: counted (logged once)."""
        self.declined += 1
        tier = self._reads[index]
        tier.declined += 1
        if not self._logged:
            self._logged = True
            log.warning(
                "kvtier: a block of the %s tier answered as a miss: reading it (%.3g ms a "
                "block, %d queued) would end after recomputing it (%.3g ms a block); "
                "logged once, counted as loads_declined",
                self._names[index],
                (tier.s_per_block() or 0.0) * 1e3,
                tier.queued,
                (self._recompute or 0.0) * 1e3,
            )

    def declined_from(self, index: int) -> int:
        """Blocks of lower tier ``index`` declined so far."""
        return self._reads[index].declined

    def s_per_block(self, index: int) -> float | None:
        """Lower tier ``index``'s seconds of reading per delivered block; None before any."""
        return self._reads[index].s_per_block()

    # -- what the chain saw ------------------------------------------------------------------

    def read_started(self, index: int, blocks: int) -> None:
        """A read of ``blocks`` blocks from lower tier ``index`` goes out."""
        tier = self._reads[index]
        if not tier.reading:
            tier.since = self._clock()
        tier.reading += 1
        tier.queued += blocks

    def read_ended(self, index: int, blocks: int, delivered: int) -> None:
        """That read ended, ``delivered`` of its blocks verified in their rows.

        The tier's cost per delivered block is taken over busy periods
        (overlapping reads count once), recent ones weighing most.
        """
        tier = self._reads[index]
        tier.reading -= 1
        tier.queued -= blocks
        tier.period_blocks += delivered
        if not tier.reading:
            now = self._clock()
            tier.busy = 0.8 * tier.busy + (now - tier.since)
            tier.delivered = 0.8 * tier.delivered + tier.period_blocks
            tier.period_blocks = 0
            tier.idle_since = now

    def placed(self, keys: Sequence[bytes]) -> None:
        """Rows were placed for ``keys`` now (their compute's step began); measuring only."""
        placing = self._placed
        if placing is not None:
            now = self._clock()
            for k in keys:
                placing[k] = now

    def computed(self, keys: Sequence[bytes], ok: bool) -> None:
        """A step computed ``keys`` between their placement and now: one sample of
        the cost to compute a block (the slowest step bounds it from above);
        measuring only."""
        placing = self._placed
        if placing is None:
            return
        since = [t for k in keys if (t := placing.pop(k, None)) is not None]
        if not ok or not since:
            return
        sample = (self._clock() - min(since)) / len(keys)
        old = self._measured
        self._measured = sample if old is None else 0.8 * old + 0.2 * sample
        self._recompute = self._measured
