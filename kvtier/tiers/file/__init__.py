"""The O_DIRECT file tier: blocks in the slots of one preallocated file, read and written
by io_uring (or a thread pool) straight from and into CPU-region rows.

Its parts, each a module of this package:

* ``_tier``: :class:`FileTier`, the tier itself (the :class:`~kvtier.tiers.base.Tier`
  contract);
* ``_root``, ``_namespace``, ``_description``: the root's budget and lock, the
  namespaces under it and their ``namespace.json``;
* ``_slots``, ``_pipeline``, ``_worker``: the slot file and the I/O on it;
* ``_recovery``, ``_quarantine``: finding blocks again at open, damaged blocks.

The header every block carries is :mod:`kvtier.tiers.block_format`, shared with
the cluster tier (its compiled helper, ``kvtier.tiers._blocks``, seals and checks
slot headers and XXH3 checksums in bulk).
"""

from __future__ import annotations

from kvtier.tiers.file._tier import (
    LAYOUT_KIND,
    TIER_FORMAT_VERSION,
    FileTier,
    FileTierStatistics,
    LoadResult,
    StoreResult,
)

__all__ = [
    "LAYOUT_KIND",
    "TIER_FORMAT_VERSION",
    "FileTier",
    "FileTierStatistics",
    "LoadResult",
    "StoreResult",
]
