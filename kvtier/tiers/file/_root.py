"""A file tier root: what kvtier keeps in it, and the root as measured.

``FileTierConfig.bytes_to_use`` is the budget of the *root* on disk: every
namespace directory under it (one per KV layout, or per live instance of one:
a partition) and everything kvtier writes there (slot files, ``index`` files,
quarantine copies, ``namespace.json``, lock files, directories, probe files)
together, and every other file found there too. This module names what a
root holds and measures it (:func:`scan_root`); the rest of the root's rules
are modules of their own:

* :mod:`kvtier.tiers.file._sizing`: what a namespace of so many slots may
  take, and what files take (``st_blocks * 512``, never ``st_size``; symlinks
  never followed);
* :mod:`kvtier.tiers.file._root_lock`: the lock every change of shares runs
  under;
* :mod:`kvtier.tiers.file._budget`: the share of a namespace being opened,
  reclaiming namespaces nobody has open, and one budget per root;
* :mod:`kvtier.tiers.file._delete`: deleting what kvtier wrote in a namespace;
* :mod:`kvtier.tiers.file._gc`: reclaiming by hand (``kvtier gc``).

What a namespace holds. One that is open keeps what it may still grow to:
its slot file, metadata and filesystem bookkeeping as measured, plus its
quarantine allowance (:func:`~kvtier.tiers.file._sizing.quarantine_keep`
whole-slot copies); one that is not open holds what it has on disk, and may
be reclaimed (deleted) by an open that needs the room, least recently used
first. A namespace's last use is the modification time of its ``lock`` file,
set when a tier opens it and when it closes. What kvtier does not recognize
as its own (an entry of the root that is not a namespace directory, a
namespace directory without a valid ``namespace.json``, a file kvtier did not
write inside a namespace) counts in the budget as it is and is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier._sizes import format_size
from kvtier.errors import TierIOError
from kvtier.tiers.file._description import (
    DESCRIPTION_FILE,
    Description,
    read_description,
    split_dir_name,
)
from kvtier.tiers.file._index import INDEX_FILE
from kvtier.tiers.file._root_lock import ROOT_LOCK
from kvtier.tiers.file._sizing import (
    allocated,
    allocation_unit,
    data_cost,
    disk_usage,
    tree_usage,
)

__all__ = [
    "DATA_FILE",
    "NAMESPACE_LOCK",
    "NamespaceUsage",
    "RootUsage",
    "probe_open",
    "scan_root",
]

NAMESPACE_LOCK = "lock"
"""A namespace's lock file: ``flock``'ed by the tier that has it open; its
mtime is the namespace's last use."""
DATA_FILE = "blocks.dat"
"""A namespace's slot file."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """One namespace directory of a root, as measured."""

    name: str
    """The directory's name (32 hex characters)."""
    path: Path
    """The directory."""
    description: Description | None
    """Its validated ``namespace.json``; None when missing or invalid."""
    problem: str | None
    """Why it is not recognized as kvtier's (no or invalid ``namespace.json``),
    in which case it is never removed; None when it is."""
    disk_bytes: int
    """Bytes allocated to the directory and everything under it."""
    data_bytes: int
    """Bytes allocated to ``blocks.dat``."""
    data_size: int
    """``st_size`` of ``blocks.dat`` (0 when absent)."""
    quarantine_bytes: int
    """Bytes allocated to the files in ``quarantine/``."""
    index_bytes: int
    """Bytes allocated to ``index`` (counted by
    :func:`~kvtier.tiers.file._sizing.data_cost`)."""
    last_used: float | None
    """When a tier last opened or closed it (its ``lock`` file's mtime, else
    ``namespace.json``'s), seconds since the epoch; None when unknown."""
    open: bool | None
    """True while a tier has it open (its ``lock`` is held); None when not asked."""

    @property
    def removable(self) -> bool:
        """Recognized as a kvtier namespace and known not to be open."""
        return self.problem is None and self.open is False

    def held_bytes(self, unit: int) -> int:
        """What it takes from the root's budget.

        What it has on disk; for an open namespace with a valid description,
        at least its metadata plus :func:`~kvtier.tiers.file._sizing.data_cost`
        of its slots (it may still write quarantine copies and extent blocks
        up to that).
        """
        desc = self.description
        if not self.open or desc is None or desc.slot_bytes is None:
            return self.disk_bytes
        meta = self.disk_bytes - self.data_bytes - self.quarantine_bytes - self.index_bytes
        slots = self.data_size // desc.slot_bytes
        return max(self.disk_bytes, meta + data_cost(slots, desc.slot_bytes, unit))

    def describe(self) -> str:
        """``<name> (<model>, <size>)`` for messages."""
        model = self.description.model_id if self.description is not None else None
        return f"{self.name} ({model or 'unknown model'}, {format_size(self.disk_bytes)})"


@dataclass(frozen=True, slots=True)
class RootUsage:
    """A root, as measured."""

    root: Path
    """The root directory."""
    unit: int
    """Its filesystem's allocation unit (see
    :func:`~kvtier.tiers.file._sizing.allocation_unit`)."""
    namespaces: tuple[NamespaceUsage, ...]
    """Its namespace directories (real directories with a namespace name), by name."""
    other_bytes: int
    """The root directory itself (at least one unit), its lock file, and every
    entry that is not a namespace directory (never removed)."""
    outside: tuple[tuple[str, int], ...] = ()
    """The entries that are not namespace directories (nor the lock file),
    each with its bytes on disk, largest first."""

    @property
    def disk_bytes(self) -> int:
        """Bytes allocated to everything under the root, the root included."""
        return self.other_bytes + sum(ns.disk_bytes for ns in self.namespaces)


def scan_root(root: Path, *, probe: bool, skip: str | None = None) -> RootUsage:
    """Measure every entry of ``root``.

    Parameters
    ----------
    root
        The root directory.
    probe
        Ask each namespace whether it is open (:func:`probe_open`); only
        under the root lock (shared or exclusive), else an opening tier could
        find its namespace's lock briefly taken and fail with ``BusyError``.
    skip
        A namespace name left out (the one being opened).

    Returns
    -------
    RootUsage
        Every namespace directory measured, and what else the root holds.

    Raises
    ------
    TierIOError
        When ``root`` cannot be listed.
    """
    unit = allocation_unit(root)
    try:
        names = sorted(os.listdir(root))
        own = os.lstat(root).st_blocks * 512
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot list the root: {exc.strerror}", root) from exc
    other = max(own, unit)
    namespaces = []
    outside: list[tuple[str, int]] = []
    for name in names:
        path = root / name
        if name == skip:
            continue
        if split_dir_name(name) is None or not _is_real_dir(path):
            size = disk_usage(path)
            other += size
            if name != ROOT_LOCK:
                outside.append((name, size))
            continue
        namespaces.append(_measure(path, probe))
    outside.sort(key=lambda entry: -entry[1])
    return RootUsage(root, unit, tuple(namespaces), other, tuple(outside))


def _measure(path: Path, probe: bool) -> NamespaceUsage:
    desc: Description | None = None
    problem: str | None = None
    try:
        desc = read_description(path / DESCRIPTION_FILE)
    except TierIOError as exc:
        problem = str(exc)
    if desc is None and problem is None:
        problem = f"no {DESCRIPTION_FILE}"
    elif desc is not None and desc.namespace != (split_dir_name(path.name) or ("",))[0]:
        problem = f"{DESCRIPTION_FILE} names namespace {desc.namespace}"
    data = path / DATA_FILE
    try:
        st = os.lstat(data)
        data_bytes, data_size = st.st_blocks * 512, st.st_size if stat.S_ISREG(st.st_mode) else 0
    except OSError:
        data_bytes = data_size = 0
    last: float | None = None
    for name in (NAMESPACE_LOCK, DESCRIPTION_FILE):
        with contextlib.suppress(OSError):
            last = os.lstat(path / name).st_mtime
            break
    return NamespaceUsage(
        name=path.name,
        path=path,
        description=desc,
        problem=problem,
        disk_bytes=disk_usage(path),
        data_bytes=data_bytes,
        data_size=data_size,
        quarantine_bytes=tree_usage(str(path / "quarantine")),
        index_bytes=allocated(path / INDEX_FILE),
        last_used=last,
        open=probe_open(path) if probe else None,
    )


def probe_open(ns_dir: Path) -> bool:
    """Whether a tier has ``ns_dir`` open: its ``lock`` is held (``flock``, non-blocking).

    True also when the lock file cannot be opened for another reason than
    its absence (a symlink, no permission): what cannot be checked is never
    taken for unused. Call it under the root lock (see :func:`scan_root`).
    """
    try:
        fd = os.open(ns_dir / NAMESPACE_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's own lock
    return False


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
