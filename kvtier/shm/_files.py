"""Private: locks on bytes of a shared file, held by an open file description (``F_OFD_SETLK``),
the loop that creates such a file or joins it, and the allocation of its bytes.

The primitives of kvtier's shared mappings (the CPU region shared by a
host's worker processes, the host tier): a lock belongs to the descriptor
that took it, not to the process, so it goes with the descriptor's last
close, and with the process when it dies (SIGKILL included). That makes a
held lock a liveness signal no pid can fake, and a free one proof that its
holder is gone.

And the checks every such file passes before kvtier maps it. A shared file
holds users' prompts as KV, and ``/dev/shm`` is writable by every local
user: kvtier joins only this user's own private regular files (owner, mode
without any group or other bit, no symbolic link followed), in a directory
nobody else can rename files in, and creates its files unnamed
(``O_TMPFILE``) with mode 0600, linking them under their name only once
made (``link`` fails with ``EEXIST`` as ``O_CREAT | O_EXCL`` would).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import struct
import time
from collections.abc import Callable
from typing import TypeVar

from kvtier.errors import CapacityError, SharedRegionError, UnsafeSharedFileError

__all__ = [
    "OPEN_FLAGS",
    "acquire",
    "allocate",
    "check_directory",
    "check_private",
    "create_or_join",
    "describe_owner",
    "held_by_others",
    "loose_mode",
    "open_shared",
    "reap_files",
    "release",
    "same_file",
    "set_lock",
]

OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""How kvtier opens a named shared file: never through a symbolic link, never
blocking (a FIFO planted under the name must not hang the opener)."""

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
    is taken); ``join(fd)`` attaches to the file open at ``fd``, a regular file
    of this user (:func:`open_shared`; its mode is the caller's to judge: a
    loose one of its own may be replaced) (None when it
    was removed under us: the loop tries again; ``fd`` is closed then, and on
    an error). ``what`` names the file in errors (``"shared region"``).

    Raises
    ------
    UnsafeSharedFileError
        ``path`` is a symbolic link, not a regular file, or another user's.
    SharedRegionError
        ``path`` cannot be opened, or kept being removed past ``deadline``.
    """
    while True:
        created = try_create()
        if created is not None:
            return created
        try:
            fd = open_shared(path, what)
        except FileNotFoundError:
            continue  # removed between the link attempt and the open: create again
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


# -- who may have written a shared file ----------------------------------------------------------


def describe_owner(uid: int) -> str:
    """``uid`` with its user name where the system knows it: ``"1000 (alice)"``."""
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def loose_mode(st: os.stat_result) -> bool:
    """Whether the file's mode gives its group or others any access."""
    return bool(stat.S_IMODE(st.st_mode) & 0o077)


def check_private(st: os.stat_result, path: str, what: str, *, mode: bool = True) -> None:
    """Refuse a shared file that anyone but this user could have written (or can read).

    Parameters
    ----------
    st
        The file's ``fstat`` (of the descriptor kvtier holds, never of the name:
        the name can be swapped between a check and an open).
    path, what
        The file's path and what it is (``"host segment"``), for the message.
    mode
        Also refuse a mode with any group or other bit (False: the caller judges
        the mode, e.g. to replace a loose file of its own that nobody holds).

    Raises
    ------
    UnsafeSharedFileError
        Not a regular file, owned by another user, or (with ``mode``) a loose mode;
        the message names the path, the mode and the owner.
    """
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = "belongs to another user"
    elif mode and loose_mode(st):
        problem = "is readable or writable by other users"
    if problem is not None:
        raise UnsafeSharedFileError(
            f"{what} {path} {problem} (mode {stat.filemode(st.st_mode)}, "
            f"{stat.S_IMODE(st.st_mode):04o}, owner {describe_owner(st.st_uid)}; "
            f"this process runs as {describe_owner(os.geteuid())}): kvtier maps only its "
            "user's own private files, since anyone who could write this one could plant "
            "blocks in it; remove it, or give this instance a directory of its own",
            path,
        )


def open_shared(path: str, what: str) -> int:
    """Open the named shared file at ``path`` read-write: a regular file of this user.

    Opened with :data:`OPEN_FLAGS` (no symbolic link followed, no blocking on
    a FIFO), then checked on the descriptor (:func:`check_private` without the
    mode, which the caller judges). The caller closes the descriptor.

    Raises
    ------
    FileNotFoundError
        Nothing is at ``path``.
    UnsafeSharedFileError
        A symbolic link, not a regular file, or another user's file.
    SharedRegionError
        Any other failure to open it.
    """
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeSharedFileError(
                f"{what} {path} is a symbolic link: kvtier never follows one to a shared "
                "file (it could point at another user's file); remove it",
                path,
            ) from exc
        raise SharedRegionError(f"cannot open {what} {path}: {exc}") from exc
    try:
        check_private(os.fstat(fd), path, what, mode=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_directory(directory: str, what: str) -> None:
    """Refuse a directory in which another user could rename or replace kvtier's files.

    A directory that others may write is safe only with the sticky bit set
    (``/dev/shm``, ``/tmp``: a file there can be removed or renamed only by
    its owner); one owned by another user (not root) could be changed by them
    at any time.

    Raises
    ------
    UnsafeSharedFileError
        The directory is writable by others without the sticky bit, or another
        user's; the message names it, its mode and its owner.
    """
    st = os.stat(directory)
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid not in (0, os.geteuid()):
        problem = "belongs to another user"
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        problem = "is writable by other users and has no sticky bit"
    if problem is not None:
        raise UnsafeSharedFileError(
            f"the directory {directory} of the {what} {problem} (mode "
            f"{stat.filemode(st.st_mode)}, owner {describe_owner(st.st_uid)}): another user "
            "could replace the files kvtier shares in it; use a directory of this user's "
            "(mode 0700) or a sticky one such as /dev/shm",
            directory,
        )


# -- removing what nobody holds -------------------------------------------------------------------


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) still names the file open at ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def reap_files(
    directory: str,
    accept: Callable[[str], bool],
    *,
    mutex: int,
    idle: Callable[[int, os.stat_result], bool],
    remove: Callable[[str, int], None],
    dry_run: bool = False,
) -> list[str]:
    """Remove this user's shared files in ``directory`` that nobody holds; their paths.

    The one way kvtier's shared files (the CPU region's, the host tier's) are
    reaped. A file goes only when its name passes ``accept``, it is a regular
    file of this user, ``idle(fd, stat)`` says nobody holds it (its liveness
    locks free, its header kvtier's), and its ``mutex`` byte can be locked
    without waiting (nobody is joining or closing it); then, under that
    mutex, it is checked again (still linked, still idle) and ``remove(path,
    fd)`` unlinks it (``dry_run``: only listed). Every open is
    :data:`OPEN_FLAGS`: a link is not followed, a FIFO does not block.
    Anything else, another user's files included, stays.
    """
    reaped: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:  # pragma: no cover - no such directory
        return reaped
    for name in names:
        if not accept(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, OPEN_FLAGS)
        except OSError:
            continue  # gone, another user's, not a file
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.geteuid()
                or not idle(fd, st)
                or not set_lock(fd, fcntl.F_WRLCK, mutex)
            ):
                continue
            try:
                # Under the mutex, again: an instance may have attached meanwhile.
                st = os.fstat(fd)
                if st.st_nlink == 0 or not idle(fd, st):
                    continue
                if not dry_run:
                    remove(path, fd)
                reaped.append(path)
            finally:
                release(fd, mutex)
        except OSError:  # pragma: no cover - removed or changed under us
            continue
        finally:
            os.close(fd)
    return reaped
