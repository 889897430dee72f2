"""Private: the host segment's file, its header, its locks; creating, joining, removing it.

One segment per namespace: ``/dev/shm/kvtier.host.<namespace hex>`` (the
``kvtier.`` prefix with a dot keeps it out of the CPU region's reaper, which
owns ``kvtier-*``). Little-endian, every table 8-byte aligned, the rows
page-aligned::

    0            header (:data:`_HEADER`), zeros to 4096
    4096         instance table: one 64-byte entry per instance slot
                 (:mod:`kvtier.tiers.host._table` says what each word holds)
    ...          lease table: LEASES_PER_INSTANCE 32-byte entries per slot
    ...          row table: one 32-byte entry per row: seq, owner, key
    data_offset  the rows (page-aligned): each a 4096-byte block header
                 (:mod:`kvtier.tiers.block_format`) then ``row_bytes`` of payload,
                 ``row_stride`` apart

Locks are open-file-description locks (``F_OFD_SETLK``) on single bytes of
the file, which the kernel drops when the last descriptor of their holder is
closed, SIGKILL included: the **mutex** (byte 0) serializes joining, claiming
and adopting rows, closing and removing; **slot** ``i`` (byte
:data:`SLOT_LOCK_BASE` + i, exclusive) is held by the live instance in slot
``i`` for as long as it is attached. A slot whose entry says live and whose
lock nobody holds belongs to a dead instance.

Exactly one creator: the segment is made unnamed (``O_TMPFILE``), sized,
allocated, its header written and its creator registered, and only then
linked under its name; ``link`` fails with ``EEXIST`` for every other
creator, which then joins. A segment is therefore never visible half made.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvtier.errors import (
    CapacityError,
    ConfigurationError,
    InvalidArgumentError,
    NamespaceMismatchError,
    SharedRegionError,
)
from kvtier.shm import (
    PAGE_SIZE,
    acquire,
    allocate,
    check_directory,
    check_private,
    create_or_join,
    loose_mode,
    memory_bytes,
    reap_files,
    release,
    round_up,
    same_file,
)
from kvtier.shm import held_by_others as _held_by_others
from kvtier.shm import set_lock as _setlk
from kvtier.tiers.block_format import HEADER_BYTES

__all__ = [
    "FILE_PREFIX",
    "INSTANCE_ENTRY_BYTES",
    "LEASES_PER_INSTANCE",
    "LEASE_ENTRY_BYTES",
    "MAX_INSTANCES",
    "ROW_ENTRY_BYTES",
    "SHM_DIR",
    "SLOT_LOCK_BASE",
    "Geometry",
    "Segment",
    "acquire_mutex",
    "attach",
    "boot_id",
    "others_live",
    "reap",
    "release_mutex",
    "release_slot",
    "segment_path",
    "slot_live",
    "take_slot",
    "unlink_if_last",
]

SHM_DIR = "/dev/shm"
FILE_PREFIX = "kvtier.host."
MAX_INSTANCES = 256
"""Most instance slots a segment has."""
LEASES_PER_INSTANCE = 256
"""Lease entries of one instance: rows it can be copying out at once under a lease."""
INSTANCE_ENTRY_BYTES = 64
LEASE_ENTRY_BYTES = 32
ROW_ENTRY_BYTES = 32
SLOT_LOCK_BASE = 1024
"""File offset of slot 0's lock byte (a lock range, not data)."""

_MAGIC = b"KVTHOST1"
_VERSION = 2  # 2: the tables within the budget (1 put them beyond the rows)
_READY = 1
_MUTEX = 0
# magic, version, state, namespace, row_bytes, row_stride, rows, instances, leases per
# instance, budget_bytes, instances_offset, leases_offset, table_offset, data_offset,
# total_bytes, creator pid, created (ns since the epoch), boot id
_HEADER = struct.Struct("<8sII16sQQQIIQQQQQQQQ16s")
_MUTEX_WAIT = 5.0

T = TypeVar("T")


def boot_id() -> bytes:
    """This boot's id (16 bytes; zeros where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):  # pragma: no cover - every Linux has it
        return bytes(16)


@dataclass(frozen=True, slots=True)
class Geometry:
    """What every instance sharing a segment must agree on, and what follows from it."""

    namespace: bytes
    """The layout's namespace (16 bytes): names the segment, written into every row."""
    row_bytes: int
    """Payload bytes of one row (one block)."""
    budget_bytes: int
    """The host budget: the rows' bytes, headers included, fit in it."""
    instances: int
    """Instance slots: the most instances attached at once; each may own ``rows // instances``."""

    @property
    def row_stride(self) -> int:
        """Bytes from one row to the next: a header page, then the payload rounded to pages."""
        return HEADER_BYTES + round_up(self.row_bytes, PAGE_SIZE)

    @property
    def rows(self) -> int:
        """Rows of the segment: as many as the budget holds with the tables beside them.

        The budget is the whole segment, so the tables (a header page, the
        instance and lease tables, a row entry per row, rounded to a page)
        come out of it: the most rows ``r`` with ``data_offset(r) + r *
        row_stride <= budget_bytes``.
        """
        fixed = self._tables_before_rows
        per_row = self.row_stride + ROW_ENTRY_BYTES
        r = max((self.budget_bytes - fixed) // per_row, 0)
        # The table's rounding to a page can cost up to one page more than the
        # estimate above: step down until the segment fits (at most a few steps).
        while r > 0 and _data_offset(fixed, r) + r * self.row_stride > self.budget_bytes:
            r -= 1
        return r

    @property
    def _tables_before_rows(self) -> int:
        """Bytes of the header and the instance and lease tables: what the rows' table follows."""
        return PAGE_SIZE + self.instances * (
            INSTANCE_ENTRY_BYTES + LEASES_PER_INSTANCE * LEASE_ENTRY_BYTES
        )

    @staticmethod
    def budget_for(row_bytes: int, rows: int, instances: int = 1) -> int:
        """The smallest host budget whose segment holds ``rows`` rows of ``row_bytes``.

        The tables' bytes included: the segment of ``Geometry(ns, row_bytes,
        budget_for(row_bytes, rows, instances), instances)`` is exactly that
        budget and has exactly ``rows`` rows.
        """
        g = Geometry(bytes(16), row_bytes, 0, instances)
        return _data_offset(g._tables_before_rows, rows) + rows * g.row_stride

    @property
    def quota(self) -> int:
        """Rows one instance may own: an equal share."""
        return self.rows // self.instances

    @property
    def instances_offset(self) -> int:
        return PAGE_SIZE

    @property
    def leases_offset(self) -> int:
        return self.instances_offset + self.instances * INSTANCE_ENTRY_BYTES

    @property
    def table_offset(self) -> int:
        return self.leases_offset + self.instances * LEASES_PER_INSTANCE * LEASE_ENTRY_BYTES

    @property
    def data_offset(self) -> int:
        return _data_offset(self.table_offset, self.rows)

    @property
    def total_bytes(self) -> int:
        """Bytes of the segment file: the tables, then the rows; never above ``budget_bytes``."""
        return self.data_offset + self.rows * self.row_stride

    def check(self) -> None:
        """Refuse a geometry no segment can have.

        Raises
        ------
        InvalidArgumentError
            A namespace that is not 16 bytes, a row size or instance count out of range.
        CapacityError
            A budget that gives an instance no row.
        """
        if not isinstance(self.namespace, bytes) or len(self.namespace) != 16:
            raise InvalidArgumentError(
                f"namespace must be 16 bytes (KVLayout.namespace), got {self.namespace!r}"
            )
        if self.row_bytes <= 0:
            raise InvalidArgumentError(f"row_bytes must be positive, got {self.row_bytes}")
        if not 1 <= self.instances <= MAX_INSTANCES:
            raise InvalidArgumentError(
                f"instances must be in [1, {MAX_INSTANCES}], got {self.instances}"
            )
        if self.budget_bytes < 0 or self.quota < 1:
            need = Geometry.budget_for(self.row_bytes, self.instances, self.instances)
            raise CapacityError(
                f"a host budget of {self.budget_bytes} bytes holds {self.rows} rows of "
                f"{self.row_stride} bytes ({self.row_bytes} of payload and a "
                f"{HEADER_BYTES}-byte header) beside the segment's tables: none for each of "
                f"{self.instances} instances; raise the budget to at least {need} bytes"
            )


def _data_offset(table_offset: int, rows: int) -> int:
    """Where the rows start: after the row table of ``rows`` entries, on a page."""
    return round_up(table_offset + rows * ROW_ENTRY_BYTES, PAGE_SIZE)


def segment_path(namespace: bytes, directory: str = SHM_DIR) -> str:
    """The segment file of ``namespace`` in ``directory``."""
    return os.path.join(directory, FILE_PREFIX + namespace.hex())


@dataclass(slots=True)
class Segment:
    """One instance's hold on a segment: its descriptor (with its locks) and its mapping."""

    fd: int
    """The file; its open file description carries this instance's locks."""
    path: str
    map: mmap.mmap
    """The whole file, shared, read-write."""
    geometry: Geometry
    created: bool
    """True in the instance that created the file."""


# -- locks ------------------------------------------------------------------------------------


def acquire_mutex(fd: int, deadline: float) -> bool:
    """Take the segment's mutex, polling until ``deadline`` (monotonic); False if not."""
    return acquire(fd, _MUTEX, deadline)


def release_mutex(fd: int) -> None:
    """Give the mutex back."""
    release(fd, _MUTEX)


def take_slot(fd: int, slot: int) -> bool:
    """Hold slot ``slot``'s lock (no wait); False when a live instance holds it."""
    return _setlk(fd, fcntl.F_WRLCK, SLOT_LOCK_BASE + slot)


def release_slot(fd: int, slot: int) -> None:
    """Drop slot ``slot``'s lock."""
    _setlk(fd, fcntl.F_UNLCK, SLOT_LOCK_BASE + slot)


def slot_live(fd: int, slot: int) -> bool:
    """Whether another open file description holds slot ``slot``'s lock (one syscall)."""
    return _held_by_others(fd, SLOT_LOCK_BASE + slot)


def others_live(fd: int, instances: int) -> bool:
    """Whether any other description holds any slot's lock (one syscall for all slots)."""
    return _held_by_others(fd, SLOT_LOCK_BASE, instances)


# -- header -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Header:
    geometry: Geometry
    offsets: tuple[int, int, int, int, int]
    """instances, leases, table, data offsets and total bytes as written."""
    creator_pid: int
    boot: bytes


def _pack_header(g: Geometry) -> bytes:
    return _HEADER.pack(
        _MAGIC,
        _VERSION,
        _READY,
        g.namespace,
        g.row_bytes,
        g.row_stride,
        g.rows,
        g.instances,
        LEASES_PER_INSTANCE,
        g.budget_bytes,
        g.instances_offset,
        g.leases_offset,
        g.table_offset,
        g.data_offset,
        g.total_bytes,
        os.getpid(),
        time.time_ns(),
        boot_id(),
    )


def _read_header(fd: int) -> _Header | None:
    """The header, or None when it is not a ready kvtier host segment of this version."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) < _HEADER.size:
        return None
    (
        magic,
        version,
        state,
        namespace,
        row_bytes,
        row_stride,
        rows,
        instances,
        leases,
        budget,
        inst_off,
        lease_off,
        table_off,
        data_off,
        total,
        pid,
        _created,
        boot,
    ) = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION or state != _READY:
        return None
    g = Geometry(namespace, row_bytes, budget, instances)
    if (
        not 1 <= instances <= MAX_INSTANCES
        or leases != LEASES_PER_INSTANCE
        or row_bytes <= 0
        or row_stride != g.row_stride
        or rows != g.rows
        or (inst_off, lease_off, table_off, data_off, total)
        != (g.instances_offset, g.leases_offset, g.table_offset, g.data_offset, g.total_bytes)
    ):
        return None  # damaged: nothing that a creator writes
    return _Header(g, (inst_off, lease_off, table_off, data_off, total), pid, boot)


def _mismatch(path: str, theirs: Geometry, mine: Geometry) -> Exception:
    if theirs.namespace != mine.namespace:
        return NamespaceMismatchError(
            f"host segment {path} holds namespace {theirs.namespace.hex()}, this instance's "
            f"is {mine.namespace.hex()}"
        )
    if theirs.row_bytes != mine.row_bytes:
        return NamespaceMismatchError(
            f"host segment {path} holds rows of {theirs.row_bytes} bytes; this instance's rows "
            f"are {mine.row_bytes} bytes: every instance of a namespace must have one layout"
        )
    problems = tuple(
        (
            field,
            f"the live segment has {getattr(theirs, field)}, "
            f"this instance asks for {getattr(mine, field)}",
        )
        for field in ("budget_bytes", "instances")
        if getattr(theirs, field) != getattr(mine, field)
    )
    text = "; ".join(f"{f}: {p}" for f, p in problems)
    return ConfigurationError(
        f"host segment {path} was created with another host budget ({text}): every instance "
        "on the host must be given the same budget and instance count",
        problems,
    )


# -- attach -----------------------------------------------------------------------------------


def attach(
    geometry: Geometry,
    directory: str,
    join_timeout: float,
    register: Callable[[Segment], T],
    undo: Callable[[T], None],
) -> tuple[Segment, T]:
    """Create the segment of ``geometry.namespace`` or join it; run ``register`` on it.

    ``register`` runs with the segment mapped and, once it is named, under its
    mutex: a creator runs it before linking the file, so the first instance is
    registered before anyone can see it (``undo`` drops what it returned when
    another creator linked first). What it raises undoes the attach.

    A named segment that no live instance holds is joined as it is when its
    geometry is the same (its rows are adopted), and removed and made afresh
    when it differs, its header is damaged or it dates from another boot.

    A named segment whose mode lets anyone else read or write it is never
    joined: removed and made afresh when no live instance holds it, refused
    when one does.

    Raises
    ------
    UnsafeSharedFileError
        ``directory`` lets other users replace files in it, or a file under
        the name is a symbolic link, not a regular file, another user's, or
        loose and held by a live instance (the path, mode and owner named).
    NamespaceMismatchError
        A live segment of another row size (or namespace).
    ConfigurationError
        A live segment of another budget or instance count (naming both).
    SharedRegionError
        The mutex stayed held past ``join_timeout`` (its holder stopped or stuck),
        or the name kept being removed under us.
    CapacityError
        The directory or the machine lacks the room (nothing is left behind).
    """
    geometry.check()
    check_directory(directory, "host segment")
    path = segment_path(geometry.namespace, directory)
    deadline = time.monotonic() + join_timeout
    return create_or_join(
        path,
        "host segment",
        lambda: (
            None
            if os.path.lexists(path)
            else _try_create(path, directory, geometry, register, undo)
        ),
        lambda fd: _join(fd, path, geometry, deadline, join_timeout, register),
        deadline,
        join_timeout,
    )


def _map(fd: int, length: int) -> mmap.mmap:
    return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _try_create(
    path: str,
    directory: str,
    g: Geometry,
    register: Callable[[Segment], T],
    undo: Callable[[T], None],
) -> tuple[Segment, T] | None:
    total = g.total_bytes
    available = memory_bytes()[1]
    if total > available:
        raise CapacityError(
            f"a host segment of {total} bytes ({g.rows} rows of {g.row_stride} bytes) exceeds "
            f"this machine's available memory ({available} bytes): lower the host budget"
        )
    fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    seg: Segment | None = None
    try:
        os.fchmod(fd, 0o600)
        st = os.fstatvfs(fd)
        if st.f_bavail * st.f_frsize < total:
            raise CapacityError(
                f"{directory} has {st.f_bavail * st.f_frsize} bytes free but the host segment "
                f"needs {total} ({g.rows} rows of {g.row_stride} bytes): lower the host budget"
            )
        os.ftruncate(fd, total)
        allocate(fd, 0, total, f"host segment {path}")
        os.pwrite(fd, _pack_header(g), 0)
        seg = Segment(fd, path, _map(fd, total), g, created=True)
        result = register(seg)
        try:
            # Plain link(2) would link the /proc symlink itself; a dir_fd makes Python
            # call linkat(2) with AT_SYMLINK_FOLLOW, which links the file.
            proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
            finally:
                os.close(proc)
        except BaseException:
            undo(result)
            raise
    except FileExistsError:
        _unmap(seg)
        os.close(fd)
        return None
    except BaseException:
        _unmap(seg)
        os.close(fd)
        raise
    return seg, result


def _unmap(seg: Segment | None) -> None:
    if seg is not None:
        with contextlib.suppress(BufferError):
            seg.map.close()


def _join(
    fd: int,
    path: str,
    g: Geometry,
    deadline: float,
    join_timeout: float,
    register: Callable[[Segment], T],
) -> tuple[Segment, T] | None:
    # create_or_join opened it as a regular file of this user (no symbolic link
    # followed, nothing else). Its mode is judged here: a segment anyone else
    # could have written since it was made is never adopted (its rows could be
    # planted, and XXH3 is no key) nor served.
    loose = loose_mode(os.fstat(fd))
    if not acquire_mutex(fd, deadline):
        raise SharedRegionError(
            f"host segment {path} stayed locked for join_timeout={join_timeout} s: the "
            "instance holding it is stopped or stuck"
        )
    try:
        if os.fstat(fd).st_nlink == 0:
            return None  # the last instance closed it, or it was reaped: start over
        live = others_live(fd, MAX_INSTANCES)
        if loose:
            if live:  # in use: refuse, naming the path, the mode and the owner
                check_private(os.fstat(fd), path, "host segment")
            _unlink(path, fd)  # nobody holds it: replaced by a fresh private one
            return None
        h = _read_header(fd)
        if h is None or h.boot != boot_id() or os.fstat(fd).st_size != h.offsets[4]:
            if live:
                raise SharedRegionError(
                    f"host segment {path} has a damaged header but live instances: remove it "
                    "once they are stopped"
                )
            _unlink(path, fd)
            return None
        if h.geometry != g:
            if live:
                raise _mismatch(path, h.geometry, g)
            _unlink(path, fd)  # nobody uses it: a segment of the old configuration
            return None
        seg = Segment(fd, path, _map(fd, g.total_bytes), g, created=False)
        try:
            return seg, register(seg)
        except BaseException:
            _unmap(seg)
            raise
    finally:
        release_mutex(fd)


def _unlink(path: str, fd: int) -> None:
    if same_file(path, fd):
        os.unlink(path)


def unlink_if_last(seg: Segment) -> bool:
    """Remove the name when no other instance holds a slot (caller holds the mutex)."""
    if os.fstat(seg.fd).st_nlink and not others_live(seg.fd, MAX_INSTANCES):
        _unlink(seg.path, seg.fd)
        return True
    return False


def reap(
    directory: str = SHM_DIR, *, dry_run: bool = False, namespace: bytes | None = None
) -> list[str]:
    """Remove the host segments of this user that no live instance holds; return their paths.

    ``namespace`` narrows it to that namespace's segment; ``dry_run`` only lists.

    A segment goes only when its mutex can be taken without waiting (nobody is
    joining or closing it) and no open file description holds any slot lock
    (no instance is attached, whatever its state). Files under the prefix that
    are not host segments, and other users' files, stay.
    """
    prefix = FILE_PREFIX if namespace is None else FILE_PREFIX + namespace.hex()

    def idle(fd: int, _st: os.stat_result) -> bool:
        # No slot lock held; kvtier's header (a creator links only a file with it).
        return not others_live(fd, MAX_INSTANCES) and os.pread(fd, len(_MAGIC), 0) == _MAGIC

    return reap_files(
        directory,
        (lambda name: name == prefix) if namespace is not None else _has_prefix,
        mutex=_MUTEX,
        idle=idle,
        remove=_unlink,
        dry_run=dry_run,
    )


def _has_prefix(name: str) -> bool:
    return name.startswith(FILE_PREFIX)
