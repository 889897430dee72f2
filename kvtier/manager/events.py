"""Events a :class:`~kvtier.manager.ResidencyManager` reports, for routers and metrics.

A serving system that routes requests by prefix (or exports KV events, as vLLM
does) needs to know which blocks a tier can serve. The manager records one event
per call that changes that set, in call order, when it was created with
``enable_events=True``; :meth:`~kvtier.manager.ResidencyManager.take_events`
hands them over and forgets them.

A key appears in a :class:`BlockRemoved` only after it appeared in a
:class:`BlockStored`: blocks whose store failed, or that were removed while being
written, were never announced and are never withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["BlockRemoved", "BlockStored", "ManagerEvent"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became ready (readable) in a tier."""

    keys: tuple[bytes, ...]
    """The block keys, in the order of the ``complete_store`` call that readied them."""
    tier: str
    """Name of the tier (the manager's ``tier``, e.g. ``"cpu"`` or ``"file"``)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that a tier can no longer serve: evicted, removed, or reset."""

    keys: tuple[bytes, ...]
    """The block keys, evicted ones in eviction order (least valuable first)."""
    tier: str
    """Name of the tier (the manager's ``tier``)."""


ManagerEvent: TypeAlias = BlockStored | BlockRemoved
"""Either event, as :meth:`~kvtier.manager.ResidencyManager.take_events` returns them."""
