"""The root lock: one ``flock`` on ``<root>/kvtier.lock`` around every change of shares.

Every step that decides or changes shares of the root's budget runs under an
exclusive ``flock`` on ``<root>/kvtier.lock`` (:data:`ROOT_LOCK`): opening a
namespace (from its accounting until its slot file is reserved), undoing a
failed open, and ``kvtier gc``. A namespace's own ``lock`` is taken only
under that lock, so a process holding it can ask each namespace whether it is
open (a non-blocking ``flock`` on its ``lock``,
:func:`~kvtier.tiers.file._root.probe_open`) without racing an opening tier;
``kvtier inspect`` does so under a shared lock. Whoever takes the root lock
checks, once it holds it, that the file it locked is still
``<root>/kvtier.lock`` (else it opens that again and retries): so an open
that fails on a root holding nothing else may remove the lock file it holds
(:func:`release_root`) without letting two holders in.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as _errno
import fcntl
import os
from pathlib import Path

from kvtier.errors import TierIOError

__all__ = ["ROOT_LOCK", "lock_root", "lock_root_blocking", "release_root"]

ROOT_LOCK = "kvtier.lock"
"""The root's lock file (empty: it takes no disk blocks)."""


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

    For commands and worker threads: it blocks the calling thread.

    Parameters
    ----------
    root
        The file tier root (an existing directory).
    shared
        Take it shared: several readers (``kvtier inspect``) at once, and no
        open or ``gc`` meanwhile; else exclusive.
    create
        Create the lock file when missing; without it, a root that has none
        (no tier ever opened there) gives None.

    Returns
    -------
    int | None
        The locked descriptor; close it to release the lock.

    Raises
    ------
    TierIOError
        When the lock file cannot be opened (``ENOENT`` when ``root`` vanished).
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
