"""Deprecated: the file tier's old module path; use :mod:`kvtier.tiers.file`.

The file tier became a package (``kvtier.tiers.file``: the tier and its
parts). Code that imported it from here (``from kvtier.tiers.file_tier
import FileTier``, as ``../shared/peer``'s benchmark does) keeps working for
one release, with a :class:`DeprecationWarning`.
"""

from __future__ import annotations

import warnings

from kvtier.tiers.file import (
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

warnings.warn(
    "kvtier.tiers.file_tier is deprecated: import from kvtier.tiers.file",
    DeprecationWarning,
    stacklevel=2,
)
