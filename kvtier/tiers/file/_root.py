"""The disk budget of a file tier root: what every namespace holds, and reclaiming it.

``FileTierConfig.bytes_to_use`` is the budget of the *root* on disk: every
namespace directory under it (one per KV layout) and everything kvtier
writes there (slot files, quarantine copies, ``namespace.json``, lock files,
directories, probe files) together. This module measures a root, plans the
share of a namespace being opened, reclaims namespaces nobody has open, and
removes them for ``kvtier gc``.

Concurrency. Every step that decides or changes shares runs under an
exclusive ``flock`` on ``<root>/kvtier.lock`` (:data:`ROOT_LOCK`): opening a
namespace (from its accounting until its slot file is reserved), undoing a
failed open, and ``kvtier gc``. A namespace's own ``lock`` is taken only
under that lock, so a process holding it can ask each namespace whether it is
open (a non-blocking ``flock`` on its ``lock``) without racing an opening
tier; ``kvtier inspect`` does so under a shared lock. Whoever takes the
root lock checks, once it holds it, that the file it locked is still
``<root>/kvtier.lock`` (else it opens that again and retries): so an open
that fails on a root holding nothing else may remove the lock file it holds
(:func:`release_root`) without letting two holders in.

What a namespace holds. One that is open keeps what it may still grow to:
its slot file, metadata and filesystem bookkeeping as measured, plus its
quarantine allowance (:func:`quarantine_keep` whole-slot copies); one that is
not open holds what it has on disk, and may be reclaimed (deleted) by an open
that needs the room, least recently used first. A namespace's last use is
the modification time of its ``lock`` file, set when a tier opens it and
when it closes.

Sizes are ``st_blocks * 512`` (what the filesystem allocated), never
``st_size``; symlinks are never followed. A slot file is truncated to zero
before it is unlinked (:func:`delete_namespace_files`): other instances'
readers may still hold it open for up to a second, and an unlinked file's
blocks stay allocated while a descriptor is open, where the budget would no
longer see them. Their mapped ``index`` cannot be shrunk under them (a
mapping faults past the end of its file); while an instance of its
namespace is live, a reclaimed partition's ``index`` stays counted against
the share of the open that reclaimed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as _errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvtier._sizes import format_size
from kvtier.errors import CapacityError, ConfigurationError, TierIOError
from kvtier.tiers.file._description import (
    DESCRIPTION_FILE,
    Description,
    is_namespace_name,
    read_description,
    split_dir_name,
)
from kvtier.tiers.file._index import INDEX_FILE, index_bytes

__all__ = [
    "DATA_FILE",
    "NAMESPACE_LOCK",
    "QUARANTINE_MAX",
    "ROOT_LOCK",
    "Collection",
    "NamespaceUsage",
    "RootUsage",
    "Share",
    "allocated",
    "allocation_unit",
    "check_budget",
    "collect",
    "data_cost",
    "delete_namespace_files",
    "disk_usage",
    "file_allowance",
    "lock_root",
    "lock_root_blocking",
    "metadata_estimate",
    "plan_share",
    "probe_open",
    "quarantine_keep",
    "release_root",
    "remove_namespace",
    "round_up",
    "scan_root",
    "slots_within",
    "trim_quarantine",
]

log = logging.getLogger("kvtier.file_tier")

ROOT_LOCK = "kvtier.lock"
"""The root's lock file (empty: it takes no disk blocks)."""
OUTSIDE_WARN = 0.5
"""Share of the budget above which what kvtier does not own in the root is warned of."""
NAMESPACE_LOCK = "lock"
DATA_FILE = "blocks.dat"
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
        total += _tree_usage(str(path))
    return total


def _tree_usage(path: str) -> int:
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
            total += _tree_usage(entry.path)
    return total


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
    """Bytes allocated to ``index`` (counted by :func:`data_cost`)."""
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
        at least its metadata plus :func:`data_cost` of its slots (it may
        still write quarantine copies and extent blocks up to that).
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
    """Its filesystem's allocation unit (see :func:`allocation_unit`)."""
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
        quarantine_bytes=_tree_usage(str(path / "quarantine")),
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


# -- the root lock --------------------------------------------------------------------------


def _open_root_lock(root: Path, create: bool) -> int | None:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    try:
        return os.open(root / ROOT_LOCK, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise TierIOError(_errno.ENOENT, "the root vanished", root) from None
        return None
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot open the root lock: {exc.strerror}", root / ROOT_LOCK
        ) from exc


async def lock_root(root: Path) -> int:
    """Take the root lock (exclusive) without blocking the event loop; its descriptor.

    Polls with a non-blocking ``flock`` (the holders keep it for
    milliseconds: an accounting step and a reservation), so that cancelling
    the caller leaves no thread behind that would take the lock later.
    Close the descriptor to release it.
    """
    while True:
        fd = _open_root_lock(root, create=True)
        if fd is None:  # only without create; kept for the type checker
            raise TierIOError(_errno.ENOENT, "no root lock", root / ROOT_LOCK)
        delay = 0.001
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.05)
        except BaseException:
            os.close(fd)
            raise
        if _still_the_lock(root, fd):
            return fd
        os.close(fd)  # removed by a failed open meanwhile: lock the file there now


def lock_root_blocking(root: Path, *, shared: bool = False, create: bool = True) -> int | None:
    """Take the root lock, waiting for it; its descriptor (None: no lock file and ``create`` off).

    For commands and worker threads. ``shared`` lets several readers
    (``kvtier inspect``) in at once and keeps opens and ``gc`` out.
    """
    while True:
        fd = _open_root_lock(root, create)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        if _still_the_lock(root, fd):
            return fd
        os.close(fd)


def _still_the_lock(root: Path, fd: int) -> bool:
    """Whether ``fd`` (locked) is still the file at ``<root>/kvtier.lock``.

    A failed open may remove the lock file it held (:func:`release_root`);
    whoever was waiting on that file then holds a lock nobody else will
    look at, and must lock the file now there instead.
    """
    held = os.fstat(fd)
    try:
        now = os.stat(root / ROOT_LOCK, follow_symlinks=False)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def release_root(root: Path, fd: int, *, created_root: bool) -> None:
    """Release the root lock ``fd`` after a failed open, leaving no trace of it.

    When the root holds nothing but its lock file, the file is removed
    while still locked (whoever waits on it retries on a new one, see
    :func:`lock_root`), and the root directory too when the open created
    it. Either way ``fd`` is closed.
    """
    try:
        with contextlib.suppress(OSError):
            if os.listdir(root) == [ROOT_LOCK] and _still_the_lock(root, fd):
                os.unlink(root / ROOT_LOCK)
                if created_root:
                    os.rmdir(root)
    finally:
        os.close(fd)


# -- removing a namespace ------------------------------------------------------------------


def remove_namespace(ns: NamespaceUsage) -> int:
    """Delete what kvtier wrote in a namespace directory not open; the bytes freed.

    Only a directory recognized as kvtier's (``ns.removable``) is touched,
    and in it only what kvtier writes: ``blocks.dat`` first, truncated to
    zero then unlinked (so that its blocks are freed at once though other
    instances' readers still hold it open, and that a crash part way leaves
    a directory still recognized, and reclaimed later),
    ``index``, the files of ``tmp/`` and ``quarantine/``, a format 1 ``blocks/`` tree, then
    ``namespace.json`` and ``lock``, and the directories once empty. Anything
    else stays, with the directory around it, and is logged. Every step goes
    through descriptors opened with ``O_NOFOLLOW``: a symlink is never
    followed. The namespace's lock is held throughout; call it under the
    root lock.

    Returns
    -------
    int
        Bytes freed (0 when the namespace turned out to be open or gone).
    """
    if not ns.removable:
        return 0
    before = disk_usage(ns.path)
    lock: int | None = None
    try:
        lock = os.open(ns.path / NAMESPACE_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    except OSError:
        return 0
    try:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return 0  # opened since it was measured
        if not delete_namespace_files(ns.path):
            return 0
    finally:
        if lock is not None:
            os.close(lock)
    try:
        os.rmdir(ns.path)
    except OSError as exc:
        log.warning(
            "file tier: %s keeps files kvtier did not write; they were left in place (%s)",
            ns.path,
            exc.strerror,
        )
    return max(0, before - disk_usage(ns.path))


def delete_namespace_files(ns_dir: Path) -> bool:
    """Delete what kvtier writes in ``ns_dir`` (see :func:`remove_namespace`), not the directory.

    The caller holds the namespace's lock, or made the directory itself.
    Returns False when ``ns_dir`` is not a directory (a symlink is not followed).
    """
    try:
        dfd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        _truncate(dfd, DATA_FILE)
        _unlink(dfd, DATA_FILE)
        _unlink(dfd, INDEX_FILE)
        for sub in ("tmp", "quarantine"):
            _empty_dir(dfd, sub, lambda _name: True)
        _remove_legacy_blocks(dfd)
        _unlink(dfd, DESCRIPTION_FILE)
        _unlink(dfd, NAMESPACE_LOCK)
    finally:
        os.close(dfd)
    return True


def trim_quarantine(qdir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` files of ``qdir`` (a namespace's quarantine)."""
    aged: list[tuple[int, str]] = []
    try:
        with os.scandir(qdir) as it:
            for entry in it:
                with contextlib.suppress(OSError):  # gone meanwhile: nothing to trim
                    if entry.is_file(follow_symlinks=False):
                        aged.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
    except OSError:
        return
    aged.sort()
    for _, path in aged[: max(0, len(aged) - keep)]:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _truncate(dfd: int, name: str) -> None:
    """Truncate the regular file ``name`` to zero: its blocks are freed even if others hold it.

    Other instances' readers keep a descriptor of a partition's slot file
    until their next listing of the root; unlinked only, its blocks would
    stay allocated (and outside the budget's sight) until then. Their reads
    of it come back short: a miss.
    """
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return  # missing, a symlink, a FIFO without reader...: unlinked (or left) as it is
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
    except OSError as exc:
        log.warning("file tier: cannot truncate %s before removing it: %s", name, exc.strerror)
    finally:
        os.close(fd)


def _unlink(dfd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            os.unlink(name, dir_fd=dfd)


def _empty_dir(parent: int, name: str, ours: Callable[[str], bool]) -> None:
    """Remove the regular files of ``parent/name`` that ``ours`` accepts, then the directory."""
    try:
        sub = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
        )
    except OSError:
        return  # missing, or not a directory (a symlink): left alone
    try:
        for entry in _names(sub):
            if ours(entry):
                _unlink(sub, entry)
    finally:
        os.close(sub)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)


def _remove_legacy_blocks(dfd: int) -> None:
    """A format 1 tree: ``blocks/<2 hex>/<32 hex>`` block files (and its temporaries)."""
    try:
        blocks = os.open(
            "blocks", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd
        )
    except OSError:
        return
    try:
        for fan in _names(blocks):
            if len(fan) == 2 and is_namespace_name(fan * 16):
                _empty_dir(blocks, fan, lambda name: is_namespace_name(name.split(".")[0]))
    finally:
        os.close(blocks)
    with contextlib.suppress(OSError):
        os.rmdir("blocks", dir_fd=dfd)


def _names(dfd: int) -> list[str]:
    try:
        return os.listdir(dfd)
    except OSError:
        return []


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# -- planning the share of a namespace being opened ----------------------------------------


@dataclass(frozen=True, slots=True)
class Share:
    """What the accounting gave a namespace being opened."""

    slots: int
    """Slots of its slot file."""
    wanted: int
    """Slots it would have with every namespace not open reclaimed."""
    room: int
    """Bytes of the budget left to the namespace: its metadata and slot file
    and quarantine must fit in them."""
    reclaimed: tuple[NamespaceUsage, ...]
    """Namespaces removed to make room, oldest first."""


def plan_share(
    usage: RootUsage,
    *,
    budget: int,
    slot_bytes: int,
    metadata: int,
    reclaim: bool,
    namespace: str,
    instances: int = 1,
) -> Share:
    """Give a namespace being opened its share of the root's budget.

    The namespace wants the budget less what namespaces in use (open, or not
    recognized as kvtier's) and other files hold. Namespaces not open hold
    what they have on disk; with ``reclaim`` the least recently used are
    removed, oldest first, until the namespace has what it wants.

    Parameters
    ----------
    usage
        The root without the namespace, from :func:`scan_root` with ``probe``.
    budget
        ``bytes_to_use``.
    slot_bytes
        Bytes per slot of the namespace.
    metadata
        Bytes its metadata takes (see :func:`metadata_estimate`).
    reclaim
        Remove namespaces not open when the share is less than wanted.
    namespace
        Its name, for messages.
    instances
        Live instances the root is shared by (``FileTierConfig.instances``):
        a partition takes at most ``budget // instances``.

    Raises
    ------
    CapacityError
        When not even one slot fits; the message names the budget and what
        holds the rest, namespace by namespace.
    """
    unit = usage.unit
    kept = [ns for ns in usage.namespaces if not ns.removable]
    idle = sorted(
        (ns for ns in usage.namespaces if ns.removable), key=lambda ns: ns.last_used or 0.0
    )
    held = usage.other_bytes + sum(ns.held_bytes(unit) for ns in kept)
    # Fair share: each of ``instances`` live partitions gets an equal part of
    # the budget (the root's own bytes come out of the first's).
    cap = budget // instances - (usage.other_bytes if instances > 1 else 0)
    most = slots_within(cap - metadata, slot_bytes, unit)
    wanted = min(most, slots_within(budget - held - metadata, slot_bytes, unit))

    def room() -> int:
        return min(cap, budget - held - sum(ns.disk_bytes for ns in idle))

    def slots_now() -> int:
        return slots_within(room() - metadata, slot_bytes, unit)

    # Namespaces whose partitions live instances read: they may hold a
    # reclaimed partition's index mapped (and its slot file open, truncated
    # to nothing by the reclaim) until their next listing of the root.
    read = {_namespace_of(ns.name) for ns in kept if ns.open}
    reclaimed: list[NamespaceUsage] = []
    while reclaim and idle and slots_now() < wanted:
        ns = idle.pop(0)
        freed = remove_namespace(ns)
        # A WARNING: another model's cache is gone, which an operator must be able
        # to see (serving engines show WARNING and above by default).
        log.warning(
            "file tier: reclaimed namespace %s (not open, last used %s) for %s: %s freed",
            ns.describe(),
            _when(ns.last_used),
            namespace,
            format_size(freed),
        )
        reclaimed.append(ns)
        if ns.path.exists():
            # Files kvtier did not write kept the directory: they still count.
            held += disk_usage(ns.path)
        if _namespace_of(ns.name) in read:
            # Its index stays allocated while a reader maps it (it cannot be
            # shrunk under a mapping): counted as held, so the budget holds.
            held += ns.index_bytes
    slots = slots_now()
    holders = _holders(usage.other_bytes, kept, idle, unit, reclaim)
    if slots < 1:
        shared = any(ns.open for ns in kept)
        raise CapacityError(
            f"bytes_to_use ({format_size(budget)}) of the file tier root {usage.root} leaves "
            f"no room for one slot of {format_size(slot_bytes)} for namespace {namespace}"
            + (f" (at most 1/{instances} of it per instance)" if instances > 1 else "")
            + f": {holders}"
            + (
                "; live instances sharing a root split its budget by the file tier's "
                "`instances` (each takes at most bytes_to_use // instances)"
                if shared
                else ""
            )
        )
    full = min(most, slots_within(budget - usage.other_bytes - metadata, slot_bytes, unit))
    if slots < full:
        log.warning(
            "file tier: namespace %s gets %d slots (%s) of bytes_to_use %s, not %d: %s",
            namespace,
            slots,
            format_size(slots * slot_bytes),
            format_size(budget),
            full,
            holders,
        )
    else:
        log.info(
            "file tier: namespace %s gets %d slots (%s) of bytes_to_use %s: %s",
            namespace,
            slots,
            format_size(slots * slot_bytes),
            format_size(budget),
            holders,
        )
    _warn_outside(usage, kept, budget, namespace, slots * slot_bytes)
    return Share(slots, wanted, room(), tuple(reclaimed))


def check_budget(usage: RootUsage, budget: int, namespace: str) -> None:
    """Refuse a budget other than the one the instances open on the root were given.

    Every tier records its ``bytes_to_use`` in its partition's
    ``namespace.json`` at open. A root has one budget: with a larger one, a
    later instance would take its share out of room the first counted on,
    and the root's usage exceed the first's budget. Instances of one
    namespace (one model sharing the root, split by ``instances``) must
    agree: another budget is refused. A tier of another namespace open with
    another budget is warned of, naming both (each model's budget is then the
    root's only as far as the other's leaves it).

    Parameters
    ----------
    usage
        The root, from :func:`scan_root` with ``probe``.
    budget
        ``bytes_to_use`` of the tier being opened.
    namespace
        Its namespace (32 hex characters).

    Raises
    ------
    ConfigurationError
        Naming both budgets and the partitions open with the other one.
    """
    same: dict[int, list[str]] = {}
    other: dict[int, list[str]] = {}
    for ns in usage.namespaces:
        theirs = ns.description.bytes_to_use if ns.open and ns.description else None
        if theirs is not None and theirs != budget:
            into = same if _namespace_of(ns.name) == namespace else other
            into.setdefault(theirs, []).append(ns.name)
    if same:
        first = format_size(min(same))
        what = (
            f"bytes_to_use ({format_size(budget)}) differs from what the instances open on "
            f"the root {usage.root} were given: {_budgets(same)}. A root has one budget, "
            "split between the live instances sharing it: give every instance the same "
            f"bytes_to_use ({first}), or close them first"
        )
        raise ConfigurationError(what, (("bytes_to_use", what),))
    if other:
        log.warning(
            "file tier: bytes_to_use (%s) differs from what the file tiers of other models "
            "open on the root %s were given: %s; the root's usage may exceed the smaller "
            "budget. Give every tier on a root the same bytes_to_use",
            format_size(budget),
            usage.root,
            _budgets(other),
        )


def _budgets(given: dict[int, list[str]]) -> str:
    return "; ".join(
        f"{format_size(size)} ({', '.join(names)})" for size, names in sorted(given.items())
    )


def _namespace_of(name: str) -> str:
    """The namespace a partition directory belongs to (its name without ``.<n>``)."""
    return name.partition(".")[0]


def _warn_outside(
    usage: RootUsage, kept: Iterable[NamespaceUsage], budget: int, namespace: str, left: int
) -> None:
    """WARN when what kvtier does not own in the root takes most of the budget."""
    foreign = [ns for ns in kept if not ns.open and ns.problem is not None]
    outside = usage.other_bytes + sum(ns.disk_bytes for ns in foreign)
    if outside <= budget * OUTSIDE_WARN:
        return
    largest = [(name, size) for name, size in usage.outside] + [
        (ns.name, ns.disk_bytes) for ns in foreign
    ]
    largest.sort(key=lambda entry: -entry[1])
    named = ", ".join(f"{name} ({format_size(size)})" for name, size in largest[:3])
    log.warning(
        "file tier: files kvtier did not write take %s of the root %s's bytes_to_use %s "
        "(they count in it and are never removed), leaving namespace %s %s of slots%s",
        format_size(outside),
        usage.root,
        format_size(budget),
        namespace,
        format_size(left),
        f": {named}" if named else "",
    )


def _holders(
    other: int,
    kept: Iterable[NamespaceUsage],
    idle: Iterable[NamespaceUsage],
    unit: int,
    reclaim: bool,
) -> str:
    parts = []
    opened = [ns for ns in kept if ns.open]
    foreign = [ns for ns in kept if not ns.open]
    if opened:
        total = sum(ns.held_bytes(unit) for ns in opened)
        parts.append(
            f"{format_size(total)} held by open namespaces "
            + ", ".join(f"{ns.describe()}" for ns in opened)
        )
    idle = list(idle)
    if idle:
        why = "reclaim is off" if not reclaim else "not reclaimed"
        parts.append(
            f"{format_size(sum(ns.disk_bytes for ns in idle))} by namespaces not open ({why}) "
            + ", ".join(ns.describe() for ns in idle)
        )
    if foreign:
        parts.append(
            f"{format_size(sum(ns.disk_bytes for ns in foreign))} by directories kvtier does not "
            "recognize (never removed) " + ", ".join(f"{ns.name} ({ns.problem})" for ns in foreign)
        )
    parts.append(f"{format_size(other)} by the root directory and other files")
    return "; ".join(parts)


def _when(t: float | None) -> str:
    if t is None:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# -- reclaiming by hand (``kvtier gc``) ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Collection:
    """What :func:`collect` removed (or, in a dry run, would remove)."""

    chosen: tuple[NamespaceUsage, ...]
    """Namespaces removed, least recently used first (in a dry run: to be removed)."""
    freed_bytes: int
    """Bytes freed (in a dry run: the chosen namespaces' bytes on disk)."""
    before_bytes: int
    """Bytes on disk under the root before."""
    after_bytes: int
    """Bytes on disk under the root after (in a dry run: expected)."""
    kept: tuple[NamespaceUsage, ...]
    """Namespaces left: open ones, directories not recognized as kvtier's, and
    those no rule chose."""
    target_met: bool
    """False when ``keep_bytes`` was given and could not be reached (what is
    left is open, or not kvtier's)."""


def collect(
    root: Path,
    *,
    keep_bytes: int | None = None,
    unused_for: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> Collection:
    """Remove namespaces no tier has open, by age and to a size (``kvtier gc``).

    A namespace is chosen when ``unused_for`` is given and it was last used
    at least that many seconds ago (or its last use is unknown); then, when
    ``keep_bytes`` is given, more are chosen, least recently used first,
    until the root takes at most ``keep_bytes`` on disk. Only namespaces
    recognized as kvtier's and not open are ever chosen, and only what
    kvtier wrote in them is removed (see :func:`remove_namespace`). The
    whole run holds the root lock, so no tier opens meanwhile (a dry run
    holds it shared and creates nothing).

    Parameters
    ----------
    root
        The file tier root (an existing directory).
    keep_bytes
        Bytes the root may keep on disk, everything under it counted.
    unused_for
        Seconds since the last use after which a namespace goes.
    dry_run
        Choose, remove nothing.
    now
        The time to measure ``unused_for`` from (default: now).

    Raises
    ------
    TierIOError
        When the root cannot be locked or listed.
    """
    moment = time.time() if now is None else now
    lock = lock_root_blocking(root, shared=dry_run, create=not dry_run)
    try:
        usage = scan_root(root, probe=True)
        idle = sorted(
            (ns for ns in usage.namespaces if ns.removable), key=lambda ns: ns.last_used or 0.0
        )
        chosen: list[NamespaceUsage] = []
        if unused_for is not None:
            chosen = [
                ns for ns in idle if ns.last_used is None or moment - ns.last_used >= unused_for
            ]
        left = usage.disk_bytes - sum(ns.disk_bytes for ns in chosen)
        if keep_bytes is not None:
            for ns in idle:
                if left <= keep_bytes:
                    break
                if ns not in chosen:
                    chosen.append(ns)
                    left -= ns.disk_bytes
        chosen.sort(key=lambda ns: ns.last_used or 0.0)
        if dry_run:
            freed = sum(ns.disk_bytes for ns in chosen)
            after = usage.disk_bytes - freed
        else:
            freed = 0
            for ns in chosen:
                freed += remove_namespace(ns)
                log.info("file tier: removed namespace %s", ns.describe())
            after = scan_root(root, probe=False).disk_bytes
    finally:
        if lock is not None:
            os.close(lock)
    kept = tuple(ns for ns in usage.namespaces if ns not in chosen)
    met = keep_bytes is None or after <= keep_bytes
    return Collection(tuple(chosen), freed, usage.disk_bytes, after, kept, met)
