"""What the demo takes from the engine's statistics.

Every field of :class:`~kvtier.chain.FrontStatistics` that the demo reads is
read in :func:`read_statistics`, and nowhere else: the serving loop
(:mod:`kvtier.demo.serving`) takes its figures here, and the report
(:mod:`kvtier.demo.report`) prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.chain import FrontStatistics, TierReport
from kvtier.engine import EngineCounts
from kvtier.manager import ManagerStatistics
from kvtier.tiers.file import FileTierStatistics

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


def read_statistics(st: FrontStatistics[EngineCounts]) -> TierFigures:
    """The demo's view of ``st``: the one place that names its fields."""
    cpu: TierReport[ManagerStatistics] = st.tiers["cpu"]
    file: TierReport[FileTierStatistics] | None = st.tiers.get("file")
    return TierFigures(
        cpu_hits=cpu.lookup_hits,
        file_hits=0 if file is None else file.lookup_hits,
        cpu_capacity=cpu.statistics.capacity,
        cpu_evictions=cpu.statistics.evictions,
        file_blocks=0 if file is None else file.statistics.blocks,
        file_evictions=0 if file is None else file.statistics.evictions,
        promotions=0 if file is None else file.read_blocks,
        load_shortfalls=st.front.load_shortfalls,
        dropped=st.front.dropped,
    )
