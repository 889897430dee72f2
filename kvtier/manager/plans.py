"""Value types the residency manager returns: plans for the data plane, statistics."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadPlan", "ManagerStatistics", "StorePlan"]


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Where to write the blocks of a :meth:`~kvtier.manager.ResidencyManager.prepare_store`.

    The new blocks are *being written*: not readable, not evictable, until
    :meth:`~kvtier.manager.ResidencyManager.complete_store` is called with
    exactly :attr:`keys` (or any part of them, in any number of calls).
    """

    keys: tuple[bytes, ...]
    """Keys to store, in the order of the call; keys already present are left out."""
    slots: tuple[int, ...]
    """Slot of each key of :attr:`keys`, in ``[0, capacity)``."""
    evicted: tuple[bytes, ...]
    """Keys evicted to make room, least valuable first. They are gone from the
    manager already; their slots are among :attr:`slots`."""
    evicted_slots: tuple[int, ...]
    """The slot each key of :attr:`evicted` held. A write-back tier must copy a
    victim's row out *before* it writes a new block into the same slot."""


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Where to read the blocks of a :meth:`~kvtier.manager.ResidencyManager.prepare_load`.

    Every block is pinned (not evictable, its slot not reused) until
    :meth:`~kvtier.manager.ResidencyManager.complete_load` releases it.
    """

    keys: tuple[bytes, ...]
    """The keys, in the order of the call."""
    slots: tuple[int, ...]
    """Slot of each key of :attr:`keys`."""


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """A snapshot of one manager's occupancy and counters."""

    capacity: int
    """Slots in the tier."""
    used: int
    """Slots holding a block in any state (being written, ready, or removed but
    still pinned or being written)."""
    ready: int
    """Blocks that lookups and loads can use (pinned ones included)."""
    being_written: int
    """Blocks between ``prepare_store`` and ``complete_store``."""
    pinned: int
    """Blocks held by at least one load in flight (each counts once)."""
    evictable: int
    """Ready blocks that no load pins: what eviction may take."""
    hits: int
    """Keys that ``lookup`` found in the ready prefix, since creation or reset."""
    misses: int
    """Keys that ``lookup`` was asked for past the ready prefix."""
    evictions: int
    """Blocks evicted to make room for stores."""
