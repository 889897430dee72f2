"""Deleting what kvtier wrote in a namespace directory, and nothing else.

A namespace is deleted when an open reclaims it (:mod:`kvtier.tiers.file._budget`),
by ``kvtier gc`` (:mod:`kvtier.tiers.file._gc`) and when a failed open undoes the
directory it created (:mod:`kvtier.tiers.file._namespace`). Only the files kvtier
writes there are deleted, each by name, through descriptors opened with
``O_NOFOLLOW``; anything else stays, with the directory around it, and keeps
counting in the root's budget.

A slot file is truncated to zero before it is unlinked: other instances'
readers may still hold it open for up to a second, and an unlinked file's
blocks stay allocated while a descriptor is open, where the budget would no
longer see them. Their mapped ``index`` cannot be shrunk under them (a
mapping faults past the end of its file); while an instance of its namespace
is live, a reclaimed partition's ``index`` stays counted against the share of
the open that reclaimed it (:func:`~kvtier.tiers.file._budget.plan_share`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
from pathlib import Path

from kvtier.tiers.file._description import DESCRIPTION_FILE
from kvtier.tiers.file._index import INDEX_FILE
from kvtier.tiers.file._root import DATA_FILE, NAMESPACE_LOCK, NamespaceUsage
from kvtier.tiers.file._sizing import disk_usage

__all__ = ["delete_namespace_files", "remove_namespace", "trim_quarantine"]

log = logging.getLogger("kvtier.file_tier")


def remove_namespace(ns: NamespaceUsage) -> int:
    """Delete what kvtier wrote in a namespace directory not open; the bytes freed.

    Only a directory recognized as kvtier's (``ns.removable``) is touched,
    and in it only what kvtier writes: ``blocks.dat`` first, truncated to
    zero then unlinked (so that its blocks are freed at once though other
    instances' readers still hold it open, and that a crash part way leaves
    a directory still recognized, and reclaimed later), ``index``, the files
    of ``tmp/`` and ``quarantine/``, then ``namespace.json`` and ``lock``,
    and the directories once empty. Anything
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
            _empty_dir(dfd, sub)
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


def _empty_dir(parent: int, name: str) -> None:
    """Remove the regular files of ``parent/name``, then the directory once empty."""
    try:
        sub = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
        )
    except OSError:
        return  # missing, or not a directory (a symlink): left alone
    try:
        for entry in _names(sub):
            _unlink(sub, entry)
    finally:
        os.close(sub)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)


def _names(dfd: int) -> list[str]:
    try:
        return os.listdir(dfd)
    except OSError:
        return []
