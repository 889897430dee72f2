"""The O_DIRECT file tier: blocks in the slots of one preallocated file, read and written
by io_uring (or a thread pool) straight from and into CPU-region rows.

Its face, what the other packages of kvtier use (none of them imports one of its
private modules):

* :class:`FileTier`, :class:`FileTierStatistics`, :class:`LoadResult`,
  :class:`StoreResult`, :data:`LAYOUT_KIND`: the tier itself (the
  :class:`~kvtier.tiers.base.Tier` contract), its record, its results;
* :data:`TIER_FORMAT_VERSION`: the version of a namespace directory's layout;
* :class:`Description`: the fields of a ``namespace.json`` read back, validated;
* :func:`read_description`: read and validate a ``namespace.json``;
* :func:`split_dir_name`: ``(namespace, partition)`` of a namespace directory's name;
* :data:`INDEX_FILE`: the name of a partition's ``index`` (which key each slot holds);
* :class:`IndexReader`: a read-only mapping of another partition's ``index``;
* :func:`scan_root`: measure a root, namespace by namespace, without opening a tier;
* :class:`RootUsage`: a root as :func:`scan_root` measured it;
* :class:`NamespaceUsage`: one namespace directory of a root, as measured;
* :func:`lock_root_blocking`: take the root lock (shared for readers such as
  ``kvtier inspect``);
* :func:`collect`: remove namespaces no tier has open, by age and to a size
  (``kvtier gc``);
* :class:`Collection`: what :func:`collect` removed.

Its parts, each a private module of this package:

* ``_tier``: :class:`FileTier`, the facade over the parts below; ``_opening``:
  the steps of an open before the tier exists, and their undoing; ``_parts``:
  the parts wired, their idleness, registered memory and release;
  ``_statistics``: :class:`FileTierStatistics`, gathered from the parts;
  ``_buffers``: the checks of a call's buffers; ``_sharing``: lookups, loads
  and listeners over other instances' partitions;
* ``_root``: what a root holds, measured; ``_sizing``: what a namespace of so
  many slots may take on disk; ``_root_lock``: the lock around every change
  of shares; ``_budget``: a namespace's share of the root's budget, reclaiming
  for it; ``_delete``: deleting what kvtier wrote; ``_gc``: ``kvtier gc``;
* ``_namespace``, ``_description``: the disk steps of an open (and their
  undoing), ``namespace.json``;
* ``_slots``, ``_pipeline``, ``_worker``: the slot file and the I/O on it;
* ``_index``, ``_peers``: the keys a partition publishes, the other partitions
  of a shared root;
* ``_recovery``, ``_quarantine``: finding blocks again at open, damaged blocks.

The header every block carries is :mod:`kvtier.tiers.block_format`, shared with
the cluster tier (its compiled helper, ``kvtier.tiers._blocks``, seals and checks
slot headers and XXH3 checksums in bulk).
"""

from __future__ import annotations

from kvtier.tiers.file._description import Description, read_description, split_dir_name
from kvtier.tiers.file._gc import Collection, collect
from kvtier.tiers.file._index import INDEX_FILE, IndexReader
from kvtier.tiers.file._root import NamespaceUsage, RootUsage, scan_root
from kvtier.tiers.file._root_lock import lock_root_blocking
from kvtier.tiers.file._tier import (
    LAYOUT_KIND,
    TIER_FORMAT_VERSION,
    FileTier,
    FileTierStatistics,
    LoadResult,
    StoreResult,
)

__all__ = [
    "INDEX_FILE",
    "LAYOUT_KIND",
    "TIER_FORMAT_VERSION",
    "Collection",
    "Description",
    "FileTier",
    "FileTierStatistics",
    "IndexReader",
    "LoadResult",
    "NamespaceUsage",
    "RootUsage",
    "StoreResult",
    "collect",
    "lock_root_blocking",
    "read_description",
    "scan_root",
    "split_dir_name",
]
