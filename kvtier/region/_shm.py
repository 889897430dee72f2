"""Private: how worker processes create, join and clean up one shared region file.

The protocol (see docs/cpu-region.md for the picture):

* The rendezvous is ``/dev/shm/kvtier-<name>``: a 4 KiB header, then (from file
  offset :data:`PMD_SIZE`, so that shmem huge pages could line up) the rows,
  unless the header names a hugetlbfs file that holds them.
* Two open-file-description locks (``F_OFD_SETLK``, per open file, not per
  process) on single header bytes: the **mutex** (byte 0, exclusive) guards the
  header; **live** (byte 1, shared) is held by every attached process until it
  closes or dies. The kernel drops both when a process dies.
* Exactly one creator: it makes an unnamed file (``O_TMPFILE``), takes the mutex
  and only then links it under the name (``link`` fails with ``EEXIST`` exactly as
  ``O_CREAT | O_EXCL`` would). The file is therefore never visible unlocked, and
  a joiner that gets the mutex while the header is not marked ready knows the
  creator died part way.
* The creator checks free space, sizes the file, allocates every page
  (``posix_fallocate``: a clear error now instead of a SIGBUS later), writes the
  header marked ready and attaches itself. Each joiner checks the geometry,
  sets its rank's bit and takes the live lock. The process whose attach makes
  the count reach ``world_size`` unlinks the name: from then on a crash of every
  process leaves nothing behind. A process that closes while no other holds the
  live lock unlinks it too.
* A **holder** (the scheduler of a split instance, ``rank=None``) maps every
  rank's slice and is one more party: the header marks it, and the name goes
  once ``world_size`` ranks and the holder attached. Usually the holder
  creates the file. Where the ranks start first (vLLM builds its workers'
  KV caches before its scheduler), the ranks say so (``holder=True``): the
  creating rank marks the header as expecting a holder, so the name stays
  until the holder has joined. A holder joins a live file only if it is
  marked so and no holder attached yet; any other live file under its name
  belongs to another instance. Without that mark the last rank would unlink
  the name and a late holder would silently create a second, separate file.
  The geometry carries an **instance** token: a party of another instance is
  refused.
* **Reaping.** A file whose name was never removed (an instance killed whole
  before every party attached; ranks that said ``holder=True`` killed before
  their holder came) is stale once no process holds its live lock: the
  kernel drops the locks of a process that dies, SIGKILL included.
  :func:`reap` removes such files of this user, under the mutex (as a joiner
  that finds one does); :func:`attach` runs it before it creates a file, for
  files left alone for :data:`REAP_AFTER` seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import struct
import time
from dataclasses import dataclass

from kvtier.errors import CapacityError, InvalidArgumentError, SharedRegionError
from kvtier.shm import (
    OPEN_FLAGS,
    PAGE_SIZE,
    PMD_SIZE,
    acquire,
    allocate,
    check_private,
    create_or_join,
    memory_bytes,
    reap_files,
    release,
    round_up,
    same_file,
)
from kvtier.shm import held_by_others as _held_by_others
from kvtier.shm import set_lock as _setlk

__all__ = [
    "FILE_PREFIX",
    "MAX_WORLD_SIZE",
    "REAP_AFTER",
    "SHM_DIR",
    "Attachment",
    "Geometry",
    "attach",
    "detach",
    "reap",
    "region_path",
]

SHM_DIR = "/dev/shm"
FILE_PREFIX = "kvtier-"
MAX_WORLD_SIZE = 1024
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")

_MAGIC = b"KVTIERRG"
_VERSION = 2
_READY = 1
# magic, version, state, data_offset, data_bytes, rows, row_stride, slice_bytes,
# alignment, world_size, creator_pid, attached, page_size, namespace, data path,
# holder (1 when a whole-row holder is a party), instance token. New fields go at
# the end: the offsets of the others stay where version 1 had them.
_HEADER = struct.Struct("<8sIIQQQQQQIIIQ16s256sI16s")
_RANKS_AT = 512
_HEADER_BYTES = _RANKS_AT + MAX_WORLD_SIZE // 8
_MUTEX, _LIVE = 0, 1
_DETACH_WAIT = 5.0
REAP_AFTER = 60.0
"""Seconds a stale file is left alone before :func:`attach` reaps it: a test
that holds a crashed instance's file to look at it is over by then."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """What every process sharing a region must agree on."""

    rows: int
    """Rows in the region."""
    row_stride: int
    """Bytes from one row to the next."""
    slice_bytes: int
    """Bytes of one worker's slice."""
    alignment: int
    """Alignment of every row."""
    world_size: int
    """Processes sharing the region."""
    namespace: bytes
    """The layout's namespace (same for every rank of one model)."""
    instance: bytes = bytes(16)
    """16 bytes naming the serving instance (its scheduler); zeros without one."""

    @property
    def data_bytes(self) -> int:
        """Bytes of all rows."""
        return self.rows * self.row_stride


@dataclass(slots=True)
class Attachment:
    """One process's hold on a shared region file."""

    fd: int
    """The header file; its open file description holds the live lock."""
    data_fd: int
    """The file holding the rows (``fd`` unless hugetlbfs backs them)."""
    data_offset: int
    """File offset of row 0 in ``data_fd``."""
    map_length: int
    """Bytes to map (rows, rounded to the backing's page size)."""
    backing: str
    """``"shm"`` or ``"hugetlbfs"``."""
    page_size: int
    """Page size of the backing."""
    created: bool
    """True in the one process that created the file."""
    path: str
    """The rendezvous file."""
    data_path: str | None
    """The hugetlbfs file, if any."""


def region_path(name: str) -> str:
    """The rendezvous file of region ``name``; raise for names that are not plain."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidArgumentError(
            f"shared_name must be 1-200 characters of [A-Za-z0-9._-] (no slashes), got {name!r}"
        )
    return os.path.join(SHM_DIR, FILE_PREFIX + name)


# -- locks --------------------------------------------------------------------------------


def _acquire_mutex(fd: int, deadline: float) -> bool:
    return acquire(fd, _MUTEX, deadline, first_pause=0.0005)


def _release_mutex(fd: int) -> None:
    release(fd, _MUTEX)


# -- names ----------------------------------------------------------------------------------


def _unlink_names(att_path: str, fd: int, data_path: str | None) -> None:
    """Remove the names (only if ``path`` still names our file); the memory stays mapped."""
    if same_file(att_path, fd):
        os.unlink(att_path)
        if data_path is not None:  # pragma: no cover - needs reserved huge pages
            with contextlib.suppress(FileNotFoundError):
                os.unlink(data_path)


def _hugetlbfs_dir(need: int) -> tuple[str, int] | None:
    """A writable hugetlbfs mount with ``need`` bytes of free huge pages, if any."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free = int(info["HugePages_Free"].split()[0])
        default_size = int(info["Hugepagesize"].split()[0]) * 1024
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except (OSError, KeyError, ValueError):  # pragma: no cover - exotic /proc
        return None
    for _dev, where, fstype, options, *_ in mounts:
        if fstype != "hugetlbfs":
            continue
        size = default_size  # pragma: no cover - needs a hugetlbfs mount
        for opt in options.split(","):  # pragma: no cover - needs a hugetlbfs mount
            if opt.startswith("pagesize="):
                text = opt.removeprefix("pagesize=").upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                size = int(text.rstrip("KMG")) * mult
        if size != default_size:  # pragma: no cover - HugePages_Free counts default pages
            continue
        if free * size >= round_up(need, size) and os.access(where, os.W_OK):  # pragma: no cover
            return where, size
    return None


# -- header -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Header:
    state: int
    data_offset: int
    data_bytes: int
    geometry: Geometry
    creator_pid: int
    attached: int
    page_size: int
    data_path: str | None
    ranks: bytearray
    holder: int = 0


def _read_header(fd: int) -> _Header | None:
    raw = os.pread(fd, _HEADER_BYTES, 0)
    if len(raw) < _HEADER_BYTES:
        return None
    f = _HEADER.unpack_from(raw)
    if f[0] != _MAGIC or f[1] != _VERSION:
        return None
    try:
        path = f[14].rstrip(b"\0").decode()
    except UnicodeDecodeError:
        path = "\0"  # not a path kvtier wrote: _check_fields refuses it
    return _Header(
        state=f[2],
        data_offset=f[3],
        data_bytes=f[4],
        geometry=Geometry(f[5], f[6], f[7], f[8], f[9], f[13], f[16]),
        creator_pid=f[10],
        attached=f[11],
        page_size=f[12],
        data_path=path or None,
        ranks=bytearray(raw[_RANKS_AT:_HEADER_BYTES]),
        holder=f[15],
    )


def _write_header(fd: int, h: _Header) -> None:
    g = h.geometry
    packed = _HEADER.pack(
        _MAGIC,
        _VERSION,
        h.state,
        h.data_offset,
        h.data_bytes,
        g.rows,
        g.row_stride,
        g.slice_bytes,
        g.alignment,
        g.world_size,
        h.creator_pid,
        h.attached,
        h.page_size,
        g.namespace,
        (h.data_path or "").encode(),
        h.holder,
        g.instance,
    )
    buf = packed.ljust(_RANKS_AT, b"\0") + bytes(h.ranks)
    if os.pwrite(fd, buf, 0) != len(buf):  # pragma: no cover - tmpfs writes whole
        raise SharedRegionError("short write of the shared region header")


def _attach_rank(fd: int, h: _Header, rank: int | None, path: str) -> None:
    if rank is not None:
        h.ranks[rank // 8] |= 1 << (rank % 8)
    h.attached += 1
    _write_header(fd, h)
    _setlk(fd, fcntl.F_RDLCK, _LIVE)
    if h.attached >= h.geometry.world_size + h.holder:
        # Every process has the file open (and maps it through that descriptor):
        # the name is no longer needed, and without it a crash leaves nothing.
        _unlink_names(path, fd, h.data_path)


# -- attach / detach ------------------------------------------------------------------------


def attach(
    name: str,
    geometry: Geometry,
    rank: int | None,
    join_timeout: float,
    *,
    holder: bool = False,
) -> Attachment:
    """Create the region file ``name``, or join it; see the module docstring.

    ``rank=None`` attaches the holder, which maps every slice: it creates, or
    joins a file whose ranks came first and expect it. ``holder=True`` (ranks
    only) says the instance has a holder that may attach after the ranks.

    Raises
    ------
    UnsafeSharedFileError
        A file under the name that is not this user's private regular file (a
        symbolic link, another user's, a mode with group or other bits).
    SharedRegionError
        The creator died part way (its file is removed), it did not finish
        within ``join_timeout``, the file was made for another geometry (or
        instance), ``rank`` is already attached, or a holder finds the name
        live and not expecting it (another instance uses it).
    CapacityError
        ``/dev/shm`` (or the huge page pool) lacks the room; nothing is left behind.
    """
    path = region_path(name)
    deadline = time.monotonic() + join_timeout
    reap(REAP_AFTER)
    return create_or_join(
        path,
        "shared region",
        lambda: _try_create(path, geometry, rank, holder),
        lambda fd: _join(fd, path, geometry, rank, deadline, join_timeout),
        deadline,
        join_timeout,
    )


def _try_create(path: str, geometry: Geometry, rank: int | None, holder: bool) -> Attachment | None:
    fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        _setlk(fd, fcntl.F_WRLCK, _MUTEX)
        os.fchmod(fd, 0o600)
        # Plain link(2) would link the /proc symlink itself; a dir_fd makes
        # Python call linkat(2) with AT_SYMLINK_FOLLOW, which links the file.
        proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
        finally:
            os.close(proc)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        att = _initialize(fd, path, geometry, rank, holder)
    except BaseException:
        _unlink_names(path, fd, None)
        os.close(fd)
        raise
    _release_mutex(fd)
    return att


def _initialize(
    fd: int, path: str, geometry: Geometry, rank: int | None, holder: bool
) -> Attachment:
    data_bytes = geometry.data_bytes
    huge = _hugetlbfs_dir(data_bytes)
    data_fd, data_path, page_size = fd, None, PAGE_SIZE
    data_offset, map_length, backing = PMD_SIZE, data_bytes, "shm"
    if huge is not None:  # pragma: no cover - needs reserved huge pages
        where, page_size = huge
        data_path = os.path.join(where, os.path.basename(path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(data_path)  # a leftover of a crash: we hold the name now
        data_fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        data_offset, map_length, backing = 0, round_up(data_bytes, page_size), "hugetlbfs"
    try:
        st = os.fstatvfs(data_fd)
        free = st.f_bavail * st.f_frsize
        need = map_length + (_HEADER_BYTES if data_fd == fd else 0)
        # hugetlbfs without a size= limit reports no blocks at all; its pool was
        # checked against HugePages_Free, and fallocate below reserves the pages.
        if (st.f_blocks or data_fd == fd) and free < need:
            raise CapacityError(
                f"{os.path.dirname(data_path or path)} has {free} bytes free but the shared "
                f"region needs {need} ({geometry.rows} rows of {geometry.row_stride} bytes): "
                "lower cpu_bytes_to_use"
            )
        if data_fd == fd:
            # tmpfs is sized at half of RAM by default but its pages are memory: a
            # region within /dev/shm's size and above what is available would be
            # paid for by the OOM killer, as a private region would.
            total, available = memory_bytes()
            if map_length > available:
                raise CapacityError(
                    f"a shared CPU region of {map_length} bytes ({geometry.rows} rows of "
                    f"{geometry.row_stride} bytes) exceeds this machine's available memory "
                    f"({available} bytes of {total}): lower cpu_bytes_to_use"
                )
        os.ftruncate(fd, data_offset + map_length if data_fd == fd else _HEADER_BYTES)
        if data_fd != fd:  # pragma: no cover - needs reserved huge pages
            os.ftruncate(data_fd, map_length)
        allocate(data_fd, data_offset, map_length, f"shared region {path}")
        header = _Header(
            state=_READY,
            data_offset=data_offset,
            data_bytes=data_bytes,
            geometry=geometry,
            creator_pid=os.getpid(),
            attached=0,
            page_size=page_size,
            data_path=data_path,
            ranks=bytearray(MAX_WORLD_SIZE // 8),
            holder=int(rank is None or holder),
        )
        _attach_rank(fd, header, rank, path)
    except BaseException:
        if data_fd != fd:  # pragma: no cover - needs reserved huge pages
            if data_path is not None:
                os.unlink(data_path)
            os.close(data_fd)
        raise
    return Attachment(
        fd, data_fd, data_offset, map_length, backing, page_size, True, path, data_path
    )


def _join(
    fd: int,
    path: str,
    geometry: Geometry,
    rank: int | None,
    deadline: float,
    join_timeout: float,
) -> Attachment | None:
    # create_or_join opened a regular file of this user; a mode that lets
    # anyone else write it is refused before its mutex is even taken (the
    # region's holders and ranks are this user's processes: one of them never
    # makes a loose file, so one here was changed or planted).
    check_private(os.fstat(fd), path, "shared region")
    if not _acquire_mutex(fd, deadline):
        raise SharedRegionError(
            f"shared region {path} was not ready within join_timeout={join_timeout} s: "
            "its creator is alive but has not finished (stopped or stuck?)"
        )
    try:
        if os.fstat(fd).st_nlink == 0:
            return None  # complete and unlinked, or removed as stale: start over
        h = _read_header(fd)
        if h is None or h.state != _READY:
            _unlink_names(path, fd, None if h is None else h.data_path)
            pid = "" if h is None else f" (pid {h.creator_pid})"
            raise SharedRegionError(
                f"the creator of shared region {path}{pid} died before the region was "
                "ready; the partial file was removed, so creating it again will start afresh"
            )
        if not _held_by_others(fd, _LIVE):
            # Ready, but every process that attached has gone: nobody can still
            # rely on its bytes. Remove it and create a fresh one.
            _unlink_names(path, fd, h.data_path)
            return None
        if rank is None and (not h.holder or _holder_attached(h)):
            # The holder is the instance's scheduler: a live file under its
            # name that does not wait for it is another instance's.
            raise SharedRegionError(
                f"shared region {path} is in use by another instance (pid "
                f"{h.creator_pid} created it): choose another name"
            )
        _check_geometry(path, h.geometry, geometry)
        _check_fields(path, h)
        if rank is not None and h.ranks[rank // 8] & (1 << (rank % 8)):
            raise SharedRegionError(f"rank {rank} is already attached to shared region {path}")
        data_fd = fd
        if h.data_path is not None:  # pragma: no cover - needs reserved huge pages
            data_fd = os.open(h.data_path, OPEN_FLAGS)
            try:
                check_private(os.fstat(data_fd), h.data_path, "shared region's huge pages")
            except BaseException:
                os.close(data_fd)
                raise
        map_length = round_up(h.data_bytes, h.page_size)
        _attach_rank(fd, h, rank, path)
        backing = "shm" if h.data_path is None else "hugetlbfs"
        return Attachment(
            fd, data_fd, h.data_offset, map_length, backing, h.page_size, False, path, h.data_path
        )
    finally:
        _release_mutex(fd)


def _holder_attached(h: _Header) -> bool:
    """Whether the holder attached: attachments beyond the ranks' bits (never reset)."""
    return h.attached > sum(bin(b).count("1") for b in h.ranks)


def _check_geometry(path: str, theirs: Geometry, mine: Geometry) -> None:
    if theirs == mine:
        return
    diffs = [
        f"{field}: region has {getattr(theirs, field)!r}, "
        f"this process asks {getattr(mine, field)!r}"
        for field in Geometry.__slots__
        if getattr(theirs, field) != getattr(mine, field)
    ]
    raise SharedRegionError(
        f"shared region {path} was created for another geometry ({'; '.join(diffs)}); "
        "every worker must pass the same layout namespace, budget, world_size and alignment, "
        "and belong to the instance that created it"
    )


def _check_fields(path: str, h: _Header) -> None:
    """Refuse a header whose other fields are not what a creator writes.

    The file is writable by every process of the user: a damaged one must be
    a clear error, never a mapping of some other size or file.
    """
    ps = h.page_size
    problems = []
    if ps < PAGE_SIZE or ps & (ps - 1):
        problems.append(f"page_size {ps} is not a power of two >= {PAGE_SIZE}")
    elif h.data_offset % ps or h.data_offset not in (0, PMD_SIZE):
        problems.append(f"data_offset {h.data_offset} is not where a creator puts the rows")
    if h.data_bytes != h.geometry.data_bytes:
        problems.append(f"data_bytes {h.data_bytes} is not {h.geometry.data_bytes}")
    if h.data_path is not None and (
        "\0" in h.data_path or not os.path.isabs(h.data_path) or h.data_offset != 0
    ):
        problems.append(f"data_path {h.data_path!r} is not a hugetlbfs file a creator made")
    if problems:
        raise SharedRegionError(
            f"shared region {path} has a damaged header ({'; '.join(problems)}); "
            "remove the file to start afresh"
        )


def reap(
    older_than: float = 0.0,
    directory: str = SHM_DIR,
    *,
    dry_run: bool = False,
    prefix: str = FILE_PREFIX,
) -> list[str]:
    """Remove the region files of this user that no live process holds; return their paths.

    See :func:`kvtier.region.reap_shared_regions` (``older_than``, ``dry_run``);
    ``prefix`` narrows the names looked at (a test reaps only its own: other
    test runs on the machine may be looking at theirs). A file goes
    only when its header mutex can be taken without waiting (nobody is
    creating or joining it) and no open file description holds its live lock
    (no process is attached, whatever its state). Files of other users, and
    files under the prefix that kvtier did not write, stay.
    """
    now = time.time()

    def idle(fd: int, st: os.stat_result) -> bool:
        if now - st.st_mtime < older_than or _held_by_others(fd, _LIVE):
            return False
        magic = os.pread(fd, len(_MAGIC), 0)
        # kvtier's header, or nothing yet (its creator died before writing it).
        return magic == _MAGIC or not magic.strip(b"\0")

    def remove(path: str, fd: int) -> None:
        h = _read_header(fd)
        _unlink_names(path, fd, None if h is None else h.data_path)

    return reap_files(
        directory,
        lambda name: name.startswith(FILE_PREFIX) and name.startswith(prefix),
        mutex=_MUTEX,
        idle=idle,
        remove=remove,
        dry_run=dry_run,
    )


def detach(att: Attachment) -> None:
    """Drop this process's hold; remove the names if no other process holds the region."""
    try:
        if _acquire_mutex(att.fd, time.monotonic() + _DETACH_WAIT):
            try:
                _setlk(att.fd, fcntl.F_UNLCK, _LIVE)
                if os.fstat(att.fd).st_nlink and not _held_by_others(att.fd, _LIVE):
                    _unlink_names(att.path, att.fd, att.data_path)
            finally:
                _release_mutex(att.fd)
        # Without the mutex (a stuck creator holds it) the name stays; the next
        # joiner finds nobody live and removes it.
    finally:
        if att.data_fd != att.fd:  # pragma: no cover - needs reserved huge pages
            os.close(att.data_fd)
        os.close(att.fd)
