"""Private: removing what is damaged under the host segments' prefix (``kvtier gc --shm``).

:func:`~kvtier.tiers.host._layout.reap` removes the sound segments of this
user that no instance holds, and leaves everything else under the prefix
alone. What it leaves, :func:`reap_damaged` judges: a truncated segment, one
of another format version or with a damaged header, garbage, a loose-mode
file, a FIFO, socket or symbolic link, each of this user, goes; another
user's entry never (in a sticky ``/dev/shm`` only its owner or root could
remove it, and kvtier run as root must not), nor a directory, nor a file on
which a live instance holds a slot lock.

A regular file is removed under its mutex (byte 0, taken without waiting,
as the reaper and the joiners take it), with no slot lock held, only when it
is still damaged then and still the file under the name; another kind of
entry is removed by name, once ``lstat`` said it is this user's.
"""

from __future__ import annotations

import os
import stat

from kvtier.shm import OPEN_FLAGS
from kvtier.tiers.host._layout import (
    MAX_INSTANCES,
    SHM_DIR,
    acquire_mutex,
    others_live,
    release_mutex,
)
from kvtier.tiers.host._report import DamagedHostSegment, examine, survey_host_segments

__all__ = ["reap_damaged"]


def reap_damaged(directory: str = SHM_DIR, *, dry_run: bool = False) -> list[DamagedHostSegment]:
    """Remove this user's damaged entries under the host segments' prefix; return them.

    Parameters
    ----------
    directory
        Where the segments live (``host_tier.directory``; ``/dev/shm`` by default).
    dry_run
        Only list what would go.

    Returns
    -------
    list of DamagedHostSegment
        The entries removed (or that would be), each with what was wrong with
        it. The damaged entries that stay (another user's, a directory, one a
        live instance holds) are in :func:`~kvtier.tiers.host.survey_host_segments`.
    """
    gone: list[DamagedHostSegment] = []
    for entry in survey_host_segments(directory).damaged:
        if entry.removable and _remove(entry.path, dry_run=dry_run):
            gone.append(entry)
    return gone


def _remove(path: str, *, dry_run: bool) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != os.geteuid() or stat.S_ISDIR(st.st_mode):
        return False
    if not stat.S_ISREG(st.st_mode):
        # Nothing to lock on a FIFO or a link, and nothing maps one. In a sticky
        # directory only this user can replace an entry of this user's.
        if not dry_run:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return False
        return True
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError:
        return False
    try:
        mine = os.fstat(fd)
        if (mine.st_dev, mine.st_ino) != (st.st_dev, st.st_ino) or others_live(fd, MAX_INSTANCES):
            return False
        if not acquire_mutex(fd, 0.0):  # one try, no wait
            return False  # an instance is joining, closing or removing it: not now
        try:
            # Looked at again under the mutex: an instance may have replaced it
            # with a sound segment, or joined it, since the survey.
            if others_live(fd, MAX_INSTANCES) or not isinstance(examine(path), DamagedHostSegment):
                return False
            try:
                now = os.lstat(path)
            except FileNotFoundError:
                return False
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                return False
            if not dry_run:
                os.unlink(path)
            return True
        finally:
            release_mutex(fd)
    finally:
        os.close(fd)
