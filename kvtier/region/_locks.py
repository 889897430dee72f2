"""Locks on bytes of a shared file, held by an open file description (``F_OFD_SETLK``),
the loop that creates such a file or joins it, and the allocation of its bytes.

The primitives of kvtier's shared mappings (the CPU region shared by a
host's worker processes, the host tier): a lock belongs to the descriptor
that took it, not to the process, so it goes with the descriptor's last
close, and with the process when it dies (SIGKILL included). That makes a
held lock a liveness signal no pid can fake, and a free one proof that its
holder is gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.errors import CapacityError, SharedRegionError

__all__ = ["acquire", "allocate", "create_or_join", "held_by_others", "release", "set_lock"]

T = TypeVar("T")

_FLOCK = struct.Struct("@hhqqi4x")  # struct flock on 64-bit Linux


def set_lock(fd: int, ltype: int, start: int, length: int = 1) -> bool:
    """Set (``F_WRLCK``, ``F_RDLCK``) or drop (``F_UNLCK``) a lock without waiting;
    False when another description holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(ltype, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def held_by_others(fd: int, start: int, length: int = 1) -> bool:
    """Whether another open file description holds a lock on these bytes."""
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query)
    return bool(_FLOCK.unpack(answer)[0] != fcntl.F_UNLCK)


def acquire(fd: int, byte: int, deadline: float, *, first_pause: float = 0.0002) -> bool:
    """Take the write lock on ``byte``, polling until ``deadline`` (monotonic); False if not.

    Polled, not ``F_OFD_SETLKW``: a blocking wait cannot be bounded in time.
    """
    pause = first_pause
    while not set_lock(fd, fcntl.F_WRLCK, byte):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True


def release(fd: int, byte: int) -> None:
    """Drop the lock on ``byte``."""
    set_lock(fd, fcntl.F_UNLCK, byte)


def create_or_join(
    path: str,
    what: str,
    try_create: Callable[[], T | None],
    join: Callable[[int], T | None],
    deadline: float,
    join_timeout: float,
) -> T:
    """Create the shared file at ``path``, or join it, until one of them succeeds.

    ``try_create()`` links a fully made file under ``path`` (None when the name
    is taken); ``join(fd)`` attaches to the file open at ``fd`` (None when it
    was removed under us: the loop tries again; ``fd`` is closed then, and on
    an error). ``what`` names the file in errors (``"shared region"``).

    Raises
    ------
    SharedRegionError
        ``path`` cannot be opened, or kept being removed past ``deadline``.
    """
    while True:
        created = try_create()
        if created is not None:
            return created
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # removed between the link attempt and the open: create again
        except OSError as exc:
            raise SharedRegionError(f"cannot open {what} {path}: {exc}") from exc
        try:
            joined = join(fd)
        except BaseException:
            os.close(fd)
            raise
        if joined is not None:
            return joined
        os.close(fd)
        if time.monotonic() >= deadline:
            raise SharedRegionError(
                f"could not join {what} {path} within {join_timeout} s: it kept being "
                "removed under us"
            )


def allocate(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate ``length`` bytes of a shared file at ``offset`` now (``posix_fallocate``).

    A tmpfs that cannot hold them says so here, as a :class:`CapacityError` naming
    ``what``, rather than as a SIGBUS at a later first touch. A filesystem that
    cannot preallocate (``EOPNOTSUPP``, ``EINVAL``) is left to allocate on touch.
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise CapacityError(
                f"could not allocate {length} bytes for {what}: {os.strerror(exc.errno)}"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # pragma: no cover
            raise
