"""Scheduler side: which blocks each tier holds, their states, and what to evict.

One :class:`ResidencyManager` per tier. It decides; it never does I/O. See
``docs/manager.md`` for the protocol, the states and the policies.
"""

from __future__ import annotations

# Imported for its effect: ResidencyManager builds the compiled manager for the
# built-in policies once native.py has registered it (residency.py cannot import
# it: the native manager subclasses the Python one).
from kvtier.manager import native  # noqa: F401
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
