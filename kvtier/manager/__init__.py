"""Scheduler side: which blocks each tier holds, their states, and what to evict.

One :class:`ResidencyManager` per tier. It decides; it never does I/O. See
``docs/manager.md`` for the protocol, the states and the policies.
"""

from __future__ import annotations

from kvtier.manager.events import BlockRemoved, BlockStored, ManagerEvent
from kvtier.manager.plans import LoadPlan, ManagerStatistics, StorePlan
from kvtier.manager.policies import ARCPolicy, CachePolicy, LRUPolicy
from kvtier.manager.residency import ResidencyManager

__all__ = [
    "ARCPolicy",
    "BlockRemoved",
    "BlockStored",
    "CachePolicy",
    "LRUPolicy",
    "LoadPlan",
    "ManagerEvent",
    "ManagerStatistics",
    "ResidencyManager",
    "StorePlan",
]
