"""The host tier: one CPU tier per host, in shared memory, shared by every instance on it.

A tier of the chain (``host_tier`` in :class:`~kvtier.config.KVTierConfig`),
directly below each instance's CPU region. See ``docs/host-tier.md``.

* ``_layout``: the segment file (``/dev/shm/kvtier.host.<namespace hex>``), its
  header and geometry, its locks; creating, joining and removing it (:func:`reap_host_segments`);
* ``_table``: the shared tables (rows, instances, leases) and the protocols on them;
* ``_tier``: :class:`HostTier`, one instance's view: store, look up, load verified,
  adopt; what it owns beside it: ``_membership`` (joining and leaving the segment),
  ``_keymap`` (which rows hold which key), ``_own_rows`` (its rows, and which a
  store takes), ``_leases`` (reads under a lease) and ``_statistics``
  (:class:`HostTierStatistics`);
* ``_report``: :func:`survey_host_segments`, what each segment holds, read from outside,
  and what else sits under the prefix (:class:`DamagedHostSegment`);
* ``_gc``: :func:`reap_damaged_host_segments`, the damaged entries of this user removed;
* ``_janitor``: the process that removes a segment every instance left;
* ``_chained``: :class:`ChainedHostTier`, the host tier behind the chain's
  :class:`~kvtier.tiers.base.Tier` contract (what the tier factory opens).

Every row carries :mod:`kvtier.tiers.block_format`'s header, as the file and
cluster tiers' blocks do.
"""

from __future__ import annotations

from kvtier.tiers.host._chained import ChainedHostTier
from kvtier.tiers.host._gc import reap_damaged as reap_damaged_host_segments
from kvtier.tiers.host._layout import SHM_DIR, Geometry, segment_path
from kvtier.tiers.host._layout import reap as reap_host_segments
from kvtier.tiers.host._report import (
    DamagedHostSegment,
    HostSegmentReport,
    HostSegmentSurvey,
    inspect_host_segments,
    survey_host_segments,
)
from kvtier.tiers.host._statistics import HostTierStatistics
from kvtier.tiers.host._tier import HostTier

__all__ = [
    "SHM_DIR",
    "ChainedHostTier",
    "DamagedHostSegment",
    "Geometry",
    "HostSegmentReport",
    "HostSegmentSurvey",
    "HostTier",
    "HostTierStatistics",
    "inspect_host_segments",
    "reap_damaged_host_segments",
    "reap_host_segments",
    "segment_path",
    "survey_host_segments",
]
