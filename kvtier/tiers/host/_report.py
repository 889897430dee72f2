"""Private: what a host segment holds, read from outside (``kvtier inspect --shm``).

Reading a segment joins nothing: the file is opened read-only and mapped
read-only, no slot is taken and no lock either (liveness is asked of the
kernel with ``F_OFD_GETLK``, which takes none). What it reports is a
snapshot: instances store and evict while it reads.

The directory is world-writable (``/dev/shm``), so what sits under the
prefix may be anything: a FIFO (an open without ``O_NONBLOCK`` would wait
for a writer forever), a symbolic link, another user's file (which its owner
may truncate while it is mapped: a SIGBUS), a truncated or damaged segment,
garbage. Every entry is looked at with ``lstat`` first; only a regular file
of this user with a private mode is opened (``O_NOFOLLOW | O_NONBLOCK``),
checked again on its descriptor, and mapped only when its header holds and
the file is as long as the header says. Everything else is listed as a
:class:`DamagedHostSegment` saying what is wrong, never skipped in silence.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier.shm import describe_owner, held_by_others, loose_mode
from kvtier.tiers.host._janitor import JANITOR_BYTE
from kvtier.tiers.host._layout import (
    _HEADER,
    _MAGIC,
    _VERSION,
    FILE_PREFIX,
    MAX_INSTANCES,
    SHM_DIR,
    Segment,
    _read_header,
    others_live,
)
from kvtier.tiers.host._table import Table

__all__ = [
    "DamagedHostSegment",
    "HostSegmentReport",
    "HostSegmentSurvey",
    "examine",
    "inspect_host_segments",
    "survey_host_segments",
]


@dataclass(frozen=True, slots=True)
class HostSegmentReport:
    """One host segment as ``kvtier inspect --shm`` shows it."""

    path: str
    namespace: str
    """The namespace, in hex (the layout's: model identity and KV layout)."""
    row_bytes: int
    rows: int
    instances: int
    """Instance slots."""
    budget_bytes: int
    live_instances: int
    """Slots whose instance is alive now (its slot lock held)."""
    rows_held: tuple[int, ...]
    """Rows owned by each slot's live instance (0: none live there)."""
    rows_orphaned: int
    """Rows of instances that closed or died (their blocks readable, adopted by the next)."""
    rows_free: int
    blocks: int
    """Rows holding a published block (an owner, an even seq and a key)."""
    rows_writing: int
    watched: bool
    """A janitor watches it (it removes the segment once no instance held it for a while)."""
    creator_pid: int

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class DamagedHostSegment:
    """An entry under the host segments' prefix that is not a sound segment of this user."""

    path: str
    problem: str
    """What is wrong with it, in words (``"not a regular file (a FIFO)"``)."""
    owner_uid: int
    """Its owner (of the entry itself: a symbolic link's own)."""
    removable: bool
    """Whether ``kvtier gc --shm`` removes it: this user's, not a directory, and
    no live instance holds a slot lock on it."""

    def as_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready values."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class HostSegmentSurvey:
    """What ``kvtier inspect --shm`` found in one directory."""

    directory: str
    segments: tuple[HostSegmentReport, ...]
    """The sound host segments of this user, by path."""
    damaged: tuple[DamagedHostSegment, ...]
    """Everything else under the prefix, by path."""

    def as_dict(self) -> dict[str, Any]:
        """The survey as JSON-ready values."""
        return {
            "directory": self.directory,
            "segments": [r.as_dict() for r in self.segments],
            "damaged": [d.as_dict() for d in self.damaged],
        }


def survey_host_segments(directory: str = SHM_DIR) -> HostSegmentSurvey:
    """Every entry under the host segments' prefix in ``directory``: sound or what is wrong.

    Never blocks on what it finds (a FIFO, a device), never follows a symbolic
    link and never maps a file that anyone but this user could write or
    truncate. An entry removed while it is read is left out.

    Parameters
    ----------
    directory
        Where the segments live (``host_tier.directory``; ``/dev/shm`` by default).

    Returns
    -------
    HostSegmentSurvey
        The sound segments, each with what it holds, and the damaged entries,
        each with its problem: another user's file, a loose mode, not a regular
        file, too short for a header, not a kvtier host segment, another format
        version, a damaged header, a header naming another namespace, truncated.
    """
    segments: list[HostSegmentReport] = []
    damaged: list[DamagedHostSegment] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return HostSegmentSurvey(directory, (), ())
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        found = examine(os.path.join(directory, name))
        if isinstance(found, HostSegmentReport):
            segments.append(found)
        elif found is not None:
            damaged.append(found)
    return HostSegmentSurvey(directory, tuple(segments), tuple(damaged))


def inspect_host_segments(directory: str = SHM_DIR) -> list[HostSegmentReport]:
    """Every sound kvtier host segment of this user in ``directory``, by path.

    What else sits under the prefix (damaged segments, other users' files,
    FIFOs, garbage) is left out here: :func:`survey_host_segments` lists it.
    """
    return list(survey_host_segments(directory).segments)


_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def examine(path: str, *, retries: int = 3) -> HostSegmentReport | DamagedHostSegment | None:
    """The entry at ``path``: a sound segment's report, what is wrong with it, or None (gone).

    Looks at the entry with ``lstat``, then opens only a regular private file
    of this user, without following a link or blocking, and reads it only
    through that descriptor (see the module's notes). An entry replaced
    between the two is looked at again, up to ``retries`` times.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return DamagedHostSegment(path, f"cannot be looked at: {exc.strerror}", -1, False)
    mine = st.st_uid == os.geteuid()

    def damaged(problem: str, *, live: bool = False) -> DamagedHostSegment:
        removable = mine and not stat.S_ISDIR(st.st_mode) and not live
        return DamagedHostSegment(path, problem, st.st_uid, removable)

    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "of an unknown kind")
        return damaged(f"not a regular file ({kind})")
    if not mine:
        return damaged(
            f"another user's file (owner {describe_owner(st.st_uid)}; this is "
            f"{describe_owner(os.geteuid())}): never read, and no instance of this user "
            "can use the name while it is there"
        )
    if loose_mode(st):
        return damaged(
            f"mode {stat.S_IMODE(st.st_mode):04o}: other users could have written it "
            "(kvtier makes its segments 0600); never read",
            live=_held(path),
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a link since the lstat
            return damaged("not a regular file (a symbolic link)")
        return damaged(f"cannot be opened: {exc.strerror}")
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            if retries > 0:  # replaced since the lstat: look at the new one
                return examine(path, retries=retries - 1)
            return damaged("replaced again and again while read")
        problem = _header_problem(path, fd, now)
        if problem is not None:
            return damaged(problem, live=others_live(fd, MAX_INSTANCES))
        try:
            return _report(path, fd)
        except (OSError, ValueError) as exc:  # changed under us
            return damaged(f"could not be read: {exc}")
    finally:
        os.close(fd)


def _held(path: str) -> bool:
    """Whether a live instance holds a slot lock on the file at ``path`` (nothing is read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return others_live(fd, MAX_INSTANCES)
    finally:
        os.close(fd)


def _header_problem(path: str, fd: int, st: os.stat_result) -> str | None:
    """What keeps the regular file open at ``fd`` from being a sound segment; None if nothing."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) < _HEADER.size:
        return f"too short for a host segment's header ({st.st_size} bytes)"
    if raw[: len(_MAGIC)] != _MAGIC:
        return "not a kvtier host segment (no kvtier header)"
    version = int.from_bytes(raw[8:12], "little")
    if version != _VERSION:
        return f"format version {version}; this kvtier reads version {_VERSION}"
    header = _read_header(fd)
    if header is None:
        return "damaged header: its state or geometry is not one a creator writes"
    name = os.path.basename(path)
    if name != FILE_PREFIX + header.geometry.namespace.hex():
        return f"its header names namespace {header.geometry.namespace.hex()}, not its name's"
    total = header.geometry.total_bytes
    if st.st_size < total:
        return f"truncated: {st.st_size} bytes, its header says {total}"
    if st.st_size > total:
        return f"{st.st_size} bytes, its header says {total}"
    return None


def _report(path: str, fd: int) -> HostSegmentReport:
    """What the sound segment open at ``fd`` holds (its header checked, its length too)."""
    header = _read_header(fd)
    if header is None:
        raise ValueError("its header changed while read")
    g = header.geometry
    m = mmap.mmap(fd, g.total_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    table = Table(Segment(fd, path, m, g, created=False))
    try:
        live = table.live_slots(fd, -1)
        held, orphaned, free = table.rows_held(live)
        seq, owner = table.row_np[:, 0], table.row_np[:, 1]
        keyed = (table.row_np[:, 2] != 0) | (table.row_np[:, 3] != 0)
        blocks = int(np.count_nonzero((owner != 0) & ((seq & np.uint64(1)) == 0) & keyed))
        return HostSegmentReport(
            path=path,
            namespace=g.namespace.hex(),
            row_bytes=g.row_bytes,
            rows=g.rows,
            instances=g.instances,
            budget_bytes=g.budget_bytes,
            live_instances=sum(live),
            rows_held=held,
            rows_orphaned=orphaned,
            rows_free=free,
            blocks=blocks,
            rows_writing=table.writing(),
            watched=held_by_others(fd, JANITOR_BYTE),
            creator_pid=header.creator_pid,
        )
    finally:
        del seq, owner, keyed
        table.release()
        m.close()
