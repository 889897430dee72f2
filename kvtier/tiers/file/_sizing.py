"""Sizes on disk: what a namespace of so many slots may take, and what files take.

The arithmetic of the root's budget (:mod:`kvtier.tiers.file._budget`): what a
slot file, its extent bookkeeping, its ``index`` and its quarantine copies may
take at most, how many slots fit in so many bytes, and what a namespace's
metadata takes at least. And the measure of what is there: sizes are
``st_blocks * 512`` (what the filesystem allocated), never ``st_size``;
symlinks are never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.tiers.file._index import index_bytes

__all__ = [
    "QUARANTINE_MAX",
    "allocated",
    "allocation_unit",
    "data_cost",
    "disk_usage",
    "file_allowance",
    "metadata_estimate",
    "quarantine_keep",
    "round_up",
    "slots_within",
    "tree_usage",
]

QUARANTINE_MAX = 8
"""Most quarantine copies a namespace keeps."""
_EXTENT_BYTES_PER_SLOT = 48
"""Filesystem bookkeeping allowed per slot, beyond the slot file's bytes.

ext4 and XFS count the blocks of a file's extent tree in ``st_blocks``. A
slot file written in a checkerboard (every other slot) measured 12.5 bytes a
slot here (20 000 slots of 12 KiB: 244 KiB of extent blocks, kept after the
gaps were written); a slot whose header alone was zeroed can be two extents,
and tree blocks split half full: 2 x 12 x 2 = 48 bytes a slot at worst."""
_NAMESPACE_DIRS = 3
"""The namespace directory, ``tmp/`` and ``quarantine/``."""


def quarantine_keep(slots: int) -> int:
    """Quarantine copies a namespace of ``slots`` slots keeps: ``min(8, slots // 16)``.

    Each copy is a whole slot and is counted in the namespace's share, so a
    tier keeps at most one copy per 16 slots (a tiny tier keeps none and
    only logs what failed).
    """
    return min(QUARANTINE_MAX, slots // 16)


def round_up(n: int, unit: int) -> int:
    """``n`` rounded up to a multiple of ``unit``."""
    return -(-n // unit) * unit


def data_cost(slots: int, slot_bytes: int, unit: int) -> int:
    """Disk bytes the slot file and quarantine of ``slots`` slots may take at most.

    Parameters
    ----------
    slots
        Slots of the slot file.
    slot_bytes
        Bytes per slot (header plus payload).
    unit
        The filesystem's allocation unit (see :func:`allocation_unit`).

    Returns
    -------
    int
        The slot file rounded up to whole units, its extent bookkeeping (one
        unit plus 48 bytes a slot), its ``index`` (32 bytes a slot, see
        :mod:`kvtier.tiers.file._index`) and :func:`quarantine_keep`
        whole-slot copies; 0 for no slot.
    """
    if slots <= 0:
        return 0
    return (
        file_allowance(slots, slot_bytes, unit)
        + round_up(index_bytes(slots), unit)
        + quarantine_keep(slots) * round_up(slot_bytes, unit)
    )


def file_allowance(slots: int, slot_bytes: int, unit: int) -> int:
    """What the slot file of ``slots`` slots may take: its bytes and its extent blocks."""
    return (
        round_up(slots * slot_bytes, unit) + unit + round_up(_EXTENT_BYTES_PER_SLOT * slots, unit)
    )


def slots_within(room: int, slot_bytes: int, unit: int) -> int:
    """The most slots whose :func:`data_cost` fits in ``room`` bytes (0 if none)."""
    low, high = 0, max(0, room // slot_bytes)
    while low < high:  # data_cost grows with the slots: bisect
        mid = (low + high + 1) // 2
        if data_cost(mid, slot_bytes, unit) <= room:
            low = mid
        else:
            high = mid - 1
    return low


def metadata_estimate(description_bytes: int, unit: int) -> int:
    """What a namespace's metadata takes at least in the accounting.

    Its three directories one unit each, ``namespace.json`` rounded up, and
    one unit for the ``O_DIRECT`` probe file written (and removed) at every
    open. The accounting uses the larger of this and what is measured, so
    that a tier's capacity does not depend on whether its filesystem gives
    directories blocks of their own (ext4 does, tmpfs and XFS's small
    directories do not).
    """
    return _NAMESPACE_DIRS * unit + round_up(description_bytes, unit) + unit


def allocation_unit(path: Path) -> int:
    """The filesystem's allocation unit at ``path``: ``f_frsize``, at least 4096."""
    try:
        return max(4096, os.statvfs(path).f_frsize)
    except OSError:
        return 4096


def allocated(path: Path) -> int:
    """Bytes allocated to the file ``path`` itself (0 when it does not exist)."""
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def disk_usage(path: Path) -> int:
    """Bytes allocated to ``path`` and, for a directory, everything under it.

    ``st_blocks * 512`` of every entry, directories included; symlinks are
    counted as themselves, never followed; entries that vanish while counted
    count 0.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    total = st.st_blocks * 512
    if stat.S_ISDIR(st.st_mode):
        total += tree_usage(str(path))
    return total


def tree_usage(path: str) -> int:
    """Bytes allocated to everything under the directory ``path``, not to ``path`` itself.

    0 when it cannot be listed; entries are counted as in :func:`disk_usage`.
    """
    total = 0
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            total += tree_usage(entry.path)
    return total
