"""What the demo takes from the engine's statistics.

Every field of :class:`~kvtier.engine.EngineStatistics` that the demo reads is
read in :func:`read_statistics`, and nowhere else: the serving loop
(:mod:`kvtier.demo.serving`) takes its figures here, and the report
(:mod:`kvtier.demo.report`) prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine import EngineStatistics

__all__ = ["TierFigures", "read_statistics"]


@dataclass(frozen=True, slots=True)
class TierFigures:
    """What the demo takes from the engine's statistics."""

    cpu_hits: int
    """Offloaded blocks that lookups found in the CPU tier."""
    file_hits: int
    """Offloaded blocks that lookups found in the file tier (and not in the CPU tier)."""
    cpu_capacity: int
    """Rows (blocks) of the CPU tier."""
    cpu_evictions: int
    """Blocks the CPU tier evicted."""
    file_blocks: int
    """Blocks resident in the file tier."""
    file_evictions: int
    """Blocks the file tier evicted."""
    promotions: int
    """Blocks read from the file tier into the CPU tier."""
    load_shortfalls: int
    """Blocks a load promised and could not deliver."""
    dropped: int
    """Blocks a store could not place."""


def read_statistics(st: EngineStatistics) -> TierFigures:
    """The demo's view of ``st``: the one place that names its fields."""
    file_traffic, file_tier = st.file_traffic, st.file
    return TierFigures(
        cpu_hits=st.cpu_traffic.lookup_hits,
        file_hits=0 if file_traffic is None else file_traffic.lookup_hits,
        cpu_capacity=st.cpu.capacity,
        cpu_evictions=st.cpu.evictions,
        file_blocks=0 if file_tier is None else file_tier.blocks,
        file_evictions=0 if file_tier is None else file_tier.evictions,
        promotions=st.promotions,
        load_shortfalls=st.load_shortfalls,
        dropped=st.dropped,
    )
