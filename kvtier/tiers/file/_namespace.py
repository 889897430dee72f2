"""Opening a namespace directory of the file tier: its share of the root, and undoing it.

:func:`prepare` runs in one worker thread under the root lock (see
:mod:`kvtier.tiers.file._root_lock`) and does every step of an open that touches the
disk before the tier exists: it checks the namespace (its lock, its
``namespace.json``), plans its share of the root's budget (reclaiming
namespaces not open where needed), checks that the filesystem has the free
space, then creates the directories, the description and the slot file and
reserves it. Everything it creates or grows is recorded in an :class:`Undo`,
which puts the disk back the way it was when the open fails, there or later
(a failed recovery, a cancelled open): a slot file it created is removed, one
it grew is truncated back to its old size (its blocks intact), directories
and a description it created are removed.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import json
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtier._sizes import format_size
from kvtier.config import FileTierConfig
from kvtier.errors import (
    BusyError,
    CapacityError,
    DirectIOUnsupportedError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.layout import KVLayout
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._budget import check_budget, plan_share
from kvtier.tiers.file._delete import delete_namespace_files, trim_quarantine
from kvtier.tiers.file._description import (
    DESCRIPTION_FILE,
    FORMAT_NAME,
    LAYOUT_KIND,
    MAX_PARTITIONS,
    TIER_FORMAT_VERSION,
    Description,
    partition_dir_name,
    read_description,
    split_dir_name,
)
from kvtier.tiers.file._index import INDEX_FILE
from kvtier.tiers.file._root import DATA_FILE, NAMESPACE_LOCK, RootUsage, scan_root
from kvtier.tiers.file._root_lock import lock_root_blocking, release_root
from kvtier.tiers.file._sizing import (
    allocated,
    data_cost,
    disk_usage,
    file_allowance,
    metadata_estimate,
    quarantine_keep,
    slots_within,
)

__all__ = ["Prepared", "Undo", "prepare", "undo_under_root_lock", "write_file"]

log = logging.getLogger("kvtier.file_tier")

_SUBDIRS = ("tmp", "quarantine")
_VERIFY_ROUNDS = 4
"""Times the reservation is shrunk when the filesystem allocated more than planned."""


@dataclass(slots=True)
class Undo:
    """What an open created or grew on disk, to put back when it fails."""

    ns_dir: Path
    """The namespace directory."""
    created_dir: bool = False
    """The open created the namespace directory (and so everything in it)."""
    created_subdirs: list[str] = field(default_factory=list)
    """Subdirectories it created in a directory that existed."""
    wrote_description: bool = False
    """It wrote ``namespace.json`` where there was none."""
    created_data: bool = False
    """It created ``blocks.dat``."""
    old_data_size: int | None = None
    """Size of ``blocks.dat`` before the open, when it existed."""

    def rollback(self) -> None:
        """Put the namespace directory back as it was; call it under the root lock.

        Best effort: a step that fails is logged and the others still run.
        """
        if not (
            self.created_dir
            or self.created_subdirs
            or self.wrote_description
            or self.created_data
            or self.old_data_size is not None
        ):
            return  # nothing was written
        if self.created_dir:
            delete_namespace_files(self.ns_dir)
            with contextlib.suppress(OSError):
                os.rmdir(self.ns_dir)
            return
        try:
            dfd = os.open(self.ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.error("file tier: cannot undo the failed open of %s: %s", self.ns_dir, exc)
            return
        try:
            if self.created_data:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(DATA_FILE, dir_fd=dfd)
            elif self.old_data_size is not None:
                self._truncate(dfd, self.old_data_size)
            if self.wrote_description:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(DESCRIPTION_FILE, dir_fd=dfd)
            for sub in self.created_subdirs:
                with contextlib.suppress(OSError):
                    os.rmdir(sub, dir_fd=dfd)
        finally:
            os.close(dfd)

    def _truncate(self, dfd: int, size: int) -> None:
        try:
            fd = os.open(DATA_FILE, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as exc:
            log.error("file tier: cannot shrink %s back: %s", self.ns_dir / DATA_FILE, exc)
            return
        try:
            if os.fstat(fd).st_size > size:
                # Past the old end there were no blocks: the slots below it,
                # and the blocks in them, are untouched.
                os.ftruncate(fd, size)
        except OSError as exc:
            log.error("file tier: cannot shrink %s back: %s", self.ns_dir / DATA_FILE, exc)
        finally:
            os.close(fd)


def undo_under_root_lock(root: Path, undo: Undo, *, created_root: bool = False) -> None:
    """:meth:`Undo.rollback` under the root lock (after the open released it).

    Then, as after any failed open, a root left with nothing but its lock
    loses the lock file, and the root itself when the open created it (see
    :func:`~kvtier.tiers.file._root_lock.release_root`).
    """
    fd = lock_root_blocking(root)
    if fd is None:  # only without create; kept for the type checker
        undo.rollback()
        return
    try:
        undo.rollback()
    finally:
        release_root(root, fd, created_root=created_root)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What :func:`prepare` opened; the descriptors belong to the caller."""

    lock_fd: int
    """The namespace's ``lock``, held (``flock``)."""
    ns_fd: int
    """The namespace directory."""
    data_fd: int
    """``blocks.dat``, reserved, ``O_DIRECT`` unless ``fallback`` says why not."""
    fallback: str | None
    """Why buffered I/O is used, or None."""
    slots: int
    """Slots of ``blocks.dat``."""
    undo: Undo
    """How to put the disk back if the open fails later."""


def prepare(config: FileTierConfig, layout: KVLayout, block_bytes: int, alignment: int) -> Prepared:
    """Make the namespace directory ready and reserve its share; call it under the root lock.

    Nothing is written before the share is planned and the free space
    checked, so an open that cannot fit leaves the disk as it found it.

    Raises
    ------
    BusyError
        When every partition of the namespace is open in a live tier.
    NamespaceMismatchError
        When ``namespace.json`` describes another block size or namespace, in
        this partition or in another partition of the namespace.
    ConfigurationError
        When a live instance of the namespace was given another ``bytes_to_use``.
    CapacityError
        When the share leaves no room for one slot, or the filesystem has not
        the free space for the share.
    DirectIOUnsupportedError
        With ``direct_io="require"`` where O_DIRECT is refused.
    TierIOError
        When a file cannot be created, read or reserved (``ENOSPC`` when the
        disk filled after the check), or ``namespace.json`` is malformed
        (``EUCLEAN``). Whatever the error, what the call created or grew is
        undone and its descriptors are closed.
    """
    root = Path(config.root)
    slot_bytes = HEADER_BYTES + block_bytes
    budget = int(config.bytes_to_use)
    text = _description_text(layout, block_bytes, alignment, budget)
    fds: list[int] = []
    ns_dir, lock_fd = _pick_partition(root, layout.namespace.hex())
    undo = Undo(ns_dir)
    try:
        exists = lock_fd is not None
        desc: Description | None = None
        if lock_fd is not None:
            fds.append(lock_fd)
            for sub in _SUBDIRS:
                _check_dir(ns_dir / sub)
            desc = _check_description(ns_dir, layout, block_bytes)
            _clean_tmp(ns_dir)
        usage = scan_root(root, probe=True, skip=ns_dir.name)
        check_budget(usage, budget, layout.namespace.hex())
        _check_partitions(usage, layout, block_bytes)
        unit = usage.unit
        own = disk_usage(ns_dir) if exists else 0
        own_meta = (
            own
            - allocated(ns_dir / DATA_FILE)
            - allocated(ns_dir / INDEX_FILE)
            - _files_usage(ns_dir / "quarantine")
        )
        metadata = max(own_meta, metadata_estimate(len(text), unit))
        share = plan_share(
            usage,
            budget=budget,
            slot_bytes=slot_bytes,
            metadata=metadata,
            reclaim=config.reclaim == "lru",
            namespace=ns_dir.name,
            instances=config.instances,
        )
        slots = share.slots
        _check_free_space(root, metadata + data_cost(slots, slot_bytes, unit) - own, budget, slots)
        if not exists:
            _make_dir(ns_dir)
            undo.created_dir = True
            fds.append(_lock(ns_dir))
        for sub in _SUBDIRS:
            if _make_dir(ns_dir / sub) and not undo.created_dir:
                undo.created_subdirs.append(sub)
        # The lock file's mtime is the namespace's last use (see kvtier.tiers.file._root).
        os.utime(fds[0])
        if desc is None or desc.bytes_to_use != budget:
            # (Rewritten when the budget changed: the root's budget, recorded
            # for the other tiers opening on the root meanwhile to check.)
            undo.wrote_description = not (ns_dir / DESCRIPTION_FILE).exists()
            _write_description(ns_dir, text)
        fallback = _probe_direct_io(ns_dir / "tmp", config.direct_io, alignment)
        ns_fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        fds.append(ns_fd)
        data_fd = _open_data(ns_fd, ns_dir / DATA_FILE, fallback is None, undo)
        fds.append(data_fd)
        for _ in range(_VERIFY_ROUNDS):
            _reserve(data_fd, slots * slot_bytes, ns_dir / DATA_FILE)
            trim_quarantine(ns_dir / "quarantine", quarantine_keep(slots))
            # What the filesystem really took: extent blocks beyond the
            # allowance (a filesystem kvtier was not measured on) shrink the
            # slot file until the namespace fits its share again.
            taken = _allocated_fd(data_fd)
            over = max(0, taken - file_allowance(slots, slot_bytes, unit))
            meta_now = max(
                metadata,
                disk_usage(ns_dir)
                - taken
                - allocated(ns_dir / INDEX_FILE)
                - _files_usage(ns_dir / "quarantine"),
            )
            if meta_now + data_cost(slots, slot_bytes, unit) + over <= share.room:
                break
            slots = slots_within(share.room - meta_now - over, slot_bytes, unit)
            if slots < 1:
                raise CapacityError(
                    f"the filesystem of {root} allocated {format_size(taken)} for the slot "
                    f"file: bytes_to_use ({format_size(budget)}) leaves no room for one slot "
                    f"of {format_size(slot_bytes)}"
                )
        return Prepared(fds[0], ns_fd, data_fd, fallback, slots, undo)
    except BaseException:
        undo.rollback()
        for fd in reversed(fds):
            os.close(fd)
        raise


def _check_free_space(root: Path, need: int, budget: int, slots: int) -> None:
    """Refuse a share the filesystem cannot hold, before anything is written."""
    try:
        st = os.statvfs(root)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot stat the filesystem: {exc.strerror}", root
        ) from exc
    if st.f_blocks == 0:
        return  # no size to check against (ramfs, some virtual filesystems)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise CapacityError(
            f"the filesystem of {root} has {format_size(free)} free; the file tier needs "
            f"{format_size(need)} more for {slots:,} slots within bytes_to_use "
            f"({format_size(budget)}): free some space or lower bytes_to_use"
        )


def _allocated_fd(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def _files_usage(path: Path) -> int:
    """Bytes of the files directly in ``path`` (quarantine copies), not the directory."""
    return max(0, disk_usage(path) - allocated(path))


def _check_dir(path: Path) -> bool:
    """Whether ``path`` is an existing directory (made private); a symlink is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot stat: {exc.strerror}", path) from exc
    if not os.path.isdir(path) or os.path.islink(path):
        raise TierIOError(_errno.ENOTDIR, "not a directory (a symlink is refused)", path)
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        # Created by us with a umask that widened nothing, or by someone else:
        # the blocks of a KV cache are private either way.
        os.chmod(path, 0o700)
    return True


def _make_dir(path: Path) -> bool:
    """Create ``path`` (0700) unless it exists; whether it was created."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        _check_dir(path)
        return False
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot create the tier directories: {exc.strerror}", path
        ) from exc
    os.chmod(path, 0o700)  # whatever the umask
    return True


def _pick_partition(root: Path, namespace: str) -> tuple[Path, int | None]:
    """The partition of ``namespace`` to open: the first existing one that no live
    tier holds (its lock taken, returned), else a new one (no lock yet).

    Called under the root lock: partitions are created and removed under it,
    so two tiers opening at once get two partitions.
    """
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot list the root: {exc.strerror}", root) from exc
    taken: set[int] = set()
    for name in names:
        parsed = split_dir_name(name)
        if parsed is not None and parsed[0] == namespace:
            taken.add(parsed[1])
    for n in sorted(taken):
        path = root / partition_dir_name(namespace, n)
        if not _check_dir(path):
            continue
        with contextlib.suppress(BusyError):
            return path, _lock(path)
    free = next((n for n in range(MAX_PARTITIONS) if n not in taken), None)
    if free is None:
        raise BusyError(
            f"every one of the {MAX_PARTITIONS} partitions of namespace {namespace} under "
            f"{root} is open in a live file tier"
        )
    return root / partition_dir_name(namespace, free), None


def _lock(ns_dir: Path) -> int:
    path = ns_dir / NAMESPACE_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot open the lock file: {exc.strerror}", path
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise BusyError(f"{ns_dir} is open in another file tier (process or instance)") from exc
    return fd


def _check_description(ns_dir: Path, layout: KVLayout, block_bytes: int) -> Description | None:
    """The namespace's valid description, or None when there is none (or of an older format)."""
    desc = read_description(ns_dir / DESCRIPTION_FILE)
    if desc is not None and desc.format_version < TIER_FORMAT_VERSION:
        # Its description is rewritten; what the old format left beside it is
        # not kvtier's any more: it counts in the budget and is never removed.
        log.warning(
            "file tier: %s was written in format %d; the directory is reused as a slot file "
            "and what that format left in it is kept (it counts in bytes_to_use)",
            ns_dir,
            desc.format_version,
        )
        return None
    if desc is not None and (
        desc.block_bytes != block_bytes or desc.namespace != layout.namespace.hex()
    ):
        raise NamespaceMismatchError(
            f"{ns_dir} holds blocks of {desc.block_bytes} bytes for namespace {desc.namespace}; "
            f"this tier has {block_bytes}-byte blocks for namespace {layout.namespace.hex()}"
        )
    return desc


def _check_partitions(usage: RootUsage, layout: KVLayout, block_bytes: int) -> None:
    """Refuse a block size (or namespace) another partition of the namespace does not share.

    The partitions of a namespace read each other's slots at offsets of
    their own slot size, and count each other's keys in their lookups: every
    field of ``namespace.json`` that decides where and what a slot is must
    agree (``namespace``, ``block_bytes``, hence ``slot_bytes``; the header
    size and format are fixed by the reader). Partitions open or not are
    checked alike, as this partition's own description is.
    """
    mine = layout.namespace.hex()
    for ns in usage.namespaces:
        desc = ns.description
        parsed = split_dir_name(ns.name)
        if parsed is None or parsed[0] != mine or desc is None:
            continue
        if desc.format_version < TIER_FORMAT_VERSION:
            continue  # rewritten by whoever opens it; nothing of it is read
        if desc.block_bytes != block_bytes or desc.namespace != mine:
            state = "open in a live file tier" if ns.open else "not open"
            raise NamespaceMismatchError(
                f"{ns.path} ({state}) holds blocks of {desc.block_bytes} bytes for namespace "
                f"{desc.namespace}; this tier has {block_bytes}-byte blocks for namespace "
                f"{mine}: every partition of a namespace, every instance sharing the root, "
                "must have the same block size"
            )


def _clean_tmp(ns_dir: Path) -> None:
    """Delete what a crash left in ``tmp/`` (probe files, a half-written description)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(ns_dir / "tmp") as it:
        for entry in it:
            with contextlib.suppress(OSError):
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.path)


def _description_text(layout: KVLayout, block_bytes: int, alignment: int, budget: int) -> bytes:
    desc = {
        "bytes_to_use": budget,
        "format": FORMAT_NAME,
        "format_version": TIER_FORMAT_VERSION,
        "layout_kind": LAYOUT_KIND,
        "namespace": layout.namespace.hex(),
        "block_bytes": block_bytes,
        "slot_bytes": HEADER_BYTES + block_bytes,
        "header_bytes": HEADER_BYTES,
        "alignment": alignment,
        "layout": layout.describe(),
    }
    return json.dumps(desc, indent=2, sort_keys=True).encode() + b"\n"


def _write_description(ns_dir: Path, text: bytes) -> None:
    # Written whole under a temporary name, then renamed: never half a description.
    # Buffered (the text is not block-aligned, and it is written once).
    tmp = ns_dir / f"tmp/{DESCRIPTION_FILE}.{os.getpid()}"
    try:
        write_file(tmp, text, os.O_TRUNC)
        os.rename(tmp, ns_dir / DESCRIPTION_FILE)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise TierIOError(
            exc.errno or 0,
            f"cannot write namespace.json: {exc.strerror}",
            ns_dir / DESCRIPTION_FILE,
        ) from exc


def write_file(path: Path, data: bytes, flag: int) -> None:
    """Write ``data`` to a new file (0600, never through a symlink); ``flag``: O_TRUNC or O_EXCL."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flag | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _probe_direct_io(tmp_dir: Path, mode: str, alignment: int) -> str | None:
    """None when O_DIRECT works in ``tmp_dir``; else the reason buffered I/O is used."""
    if mode == "off":
        return "direct_io is off in the configuration"
    path = tmp_dir / f"direct-probe.{os.getpid()}"
    buf = mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    reason: str | None = None
    err = 0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        err = exc.errno or 0
        reason = f"the filesystem of {tmp_dir} refuses O_DIRECT ({exc.strerror})"
    else:
        try:
            # Some filesystems accept the flag and fail the first I/O instead.
            os.pwritev(fd, [buf], 0)
            os.preadv(fd, [buf], 0)
        except OSError as exc:
            err = exc.errno or 0
            reason = f"O_DIRECT I/O fails on {tmp_dir} ({exc.strerror})"
        finally:
            os.close(fd)
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    if reason is None:
        return None
    if mode == "require":
        raise DirectIOUnsupportedError(err or _errno.EINVAL, reason, tmp_dir)
    log.warning("file tier: %s; falling back to buffered I/O", reason)
    return reason


def _open_data(ns_fd: int, path: Path, direct: bool, undo: Undo) -> int:
    """Open ``blocks.dat``, creating it if missing; ``undo`` learns which, and its old size."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
    try:
        try:
            fd = os.open(DATA_FILE, flags, dir_fd=ns_fd)
        except FileNotFoundError:
            fd = os.open(DATA_FILE, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=ns_fd)
            undo.created_data = True
            return fd
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot open the slot file: {exc.strerror}", path
        ) from exc
    undo.old_data_size = os.fstat(fd).st_size
    return fd


def _reserve(fd: int, size: int, path: Path) -> None:
    """Make the slot file exactly ``size`` bytes, its blocks allocated where supported."""
    try:
        current = os.fstat(fd).st_size
        if current > size:
            log.warning(
                "file tier: %s shrinks from %d to %d bytes (a smaller share of the budget); "
                "the blocks past the new end are dropped",
                path,
                current,
                size,
            )
            os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (_errno.EOPNOTSUPP, _errno.EINVAL, _errno.ENOSYS):
                raise
            # No fallocate here (glibc's emulation cannot write through
            # O_DIRECT): a sparse file, and ENOSPC comes with the writes.
            log.warning("file tier: %s cannot be preallocated (%s)", path, exc.strerror)
            os.ftruncate(fd, size)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot reserve {size} bytes for the slot file: {exc.strerror}", path
        ) from exc
