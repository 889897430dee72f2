"""A tier below the CPU region, as one chain knows it: the keys it holds, its counts.

One :class:`Lower` record per lower tier, made by the chain
(:class:`~kvtier.chain.Chain`) and shared with the parts it owns (the
lookups, the write-back): no object of the tier itself, only what this
instance learnt of it from the outcomes of its intents.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.chain._messages import LowerTier
from kvtier.chain._statistics import TierCounts

__all__ = ["Lower"]


@dataclass(slots=True)
class Lower:
    """A tier below the CPU region, as this chain knows it."""

    spec: LowerTier
    limit: int
    """Keys remembered at most: a shared tier's keys come from every instance,
    so what this one remembers is bounded (the oldest are forgotten; a later
    probe finds them); a tier of this instance's own is known exactly."""
    known: dict[bytes, None] = field(default_factory=dict)
    """Keys it holds as far as this instance knows (insertion order: oldest first)."""
    counts: TierCounts = field(default_factory=TierCounts)
    absent: dict[bytes, float] = field(default_factory=dict)
    """Shared tiers: keys a probe found absent, and when (oldest first)."""
    recovering: bool = False
    """Its recovery at open goes on: it refuses writes until it ends."""

    def learn(self, keys: Iterable[bytes]) -> None:
        """It holds ``keys`` (the most recently learnt last)."""
        known = self.known
        for k in keys:
            known.pop(k, None)
            known[k] = None
            self.absent.pop(k, None)
        while len(known) > self.limit:
            del known[next(iter(known))]

    def forget(self, keys: Iterable[bytes]) -> None:
        """It does not hold ``keys`` (any more)."""
        for k in keys:
            self.known.pop(k, None)
