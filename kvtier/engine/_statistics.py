"""The Engine's own statistics record: what only this front counts.

It is :attr:`FrontStatistics.front <kvtier.chain.FrontStatistics.front>` of
:meth:`Engine.statistics() <kvtier.Engine.statistics>`; each field is the
series ``kvtier_<field>`` (``_total`` added to a counter's) of the Engine's
exporter (:mod:`kvtier.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineCounts"]


@dataclass(slots=True)
class EngineCounts:
    """What the Engine counts that the vLLM front does not (a snapshot: ``statistics().front``)."""

    dropped: int = 0
    """Blocks a store gave up on: no row could be freed."""
    load_shortfalls: int = 0
    """Blocks a load had promised but could not deliver (an I/O or integrity
    failure, a block vanished from a shared tier, a node down, and no tier
    below the one that failed held it)."""
    abandoned_at_close: int = 0
    """Blocks :meth:`~kvtier.Engine.aclose` did not write to the lower tiers
    because its timeout passed first (logged)."""
    in_flight: int = 0
    """Jobs (device copies, promotions) running now (set in each snapshot)."""
