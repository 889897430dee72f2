"""The file tier: a bounded, checksummed, crash-consistent slot file on O_DIRECT.

Every block of a namespace lives in one preallocated file, at a slot::

    <root>/                               0700, created if missing; bytes_to_use is its budget
      kvtier.lock                         flock'ed while a namespace is opened (accounting)
      <namespace hex>/                    0700, one per KV layout namespace
        namespace.json                    human-readable: layout, block size, format
        lock                              flock'ed by the process that has it open;
                                          its mtime is the namespace's last use
        blocks.dat                        0600: slot i at i * slot_bytes, its size
                                          reserved at open (the namespace's share)
        tmp/                              probe files only
        quarantine/                       copies of blocks that failed verification
                                          (at most min(8, slots // 16))

A slot is a 4096-byte header (magic, key, namespace, payload length and XXH3,
see :mod:`kvtier.tiers._format`) followed by the payload; a zero header is a
free slot. A store writes header and payload with one vectored ``O_DIRECT``
request at the slot's offset: no file is created, renamed or closed, so
filling a tier costs what overwriting it costs. Every read verifies the header
(magic, version, key, namespace, length, header checksum) and the payload's
XXH3; a block that fails is copied to ``quarantine/``, its slot zeroed, the
block forgotten and reported as a miss.

Residency and the byte budget belong to a
:class:`~kvtier.manager.ResidencyManager` whose slots map one to one onto
the file's slots: the manager decides, this module only moves bytes. See
``docs/file-tier.md`` for the durability rules and why slots replaced one file
per block.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import logging
import mmap
import os
import queue
import threading
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvtier.config import FileTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    BusyError,
    CapacityError,
    ClosedError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.manager import ManagerEvent, ResidencyManager
from kvtier.tiers._description import LAYOUT_KIND, TIER_FORMAT_VERSION
from kvtier.tiers._format import (
    HEADER_BYTES,
    HeaderError,
    checksum,
    decode_header_fields,
    encode_header_fields,
    scan_header,
)
from kvtier.tiers._namespace import Prepared, prepare, undo_under_root_lock, write_file
from kvtier.tiers._root import (
    DATA_FILE,
    data_cost,
    lock_root,
    metadata_estimate,
    quarantine_keep,
    trim_quarantine,
)
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine, open_io_engine

__all__ = [
    "LAYOUT_KIND",
    "TIER_FORMAT_VERSION",
    "FileTier",
    "FileTierStatistics",
    "LoadResult",
    "StoreResult",
]

log = logging.getLogger("kvtier.file_tier")

_T = TypeVar("_T")
_RECOVERY_BATCH = 1024
_SCAN_BUFFER = 8 << 20
"""Bytes of slot headers read per batch at open (two batches in flight)."""
_SCAN_READS = 256
"""Reads per batch at open."""
_SCAN_WHOLE_SLOTS = 64 << 10
"""Slots up to this size are scanned by reading runs of whole slots (one
request per run); larger ones by one 4 KiB read per header. Measured here, a
4 KiB read costs about as much as 30-45 KiB of sequential reading."""
_WORKER_BATCH = 256


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of one :meth:`FileTier.store`, per key."""

    stored: tuple[bytes, ...]
    """Keys written and now ready."""
    skipped: tuple[bytes, ...]
    """Keys already present (ready or being written): nothing was written."""
    failed: Mapping[bytes, KVTierError]
    """Keys not stored, with why (:class:`~kvtier.errors.TierIOError` with errno and
    path, or :class:`~kvtier.errors.CapacityError`); their slots were freed."""
    evicted: tuple[bytes, ...] = ()
    """Keys evicted to make room (their slots now hold the new blocks)."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one :meth:`FileTier.load`, per key."""

    loaded: tuple[bytes, ...]
    """Keys whose bytes are now in their buffers, verified."""
    missing: Mapping[bytes, KVTierError]
    """Keys whose buffers hold no valid data, with why:
    :class:`~kvtier.errors.BlockNotFoundError` (not resident),
    :class:`~kvtier.errors.IntegrityError` or
    :class:`~kvtier.errors.NamespaceMismatchError` (block quarantined), or
    :class:`~kvtier.errors.TierIOError` (errno and path)."""


@dataclass(frozen=True, slots=True)
class FileTierStatistics:
    """State and counters of a :class:`FileTier`."""

    capacity_bytes: int
    """Bytes of the slots of ``blocks.dat`` (its size, reserved at open): the
    whole slots of this namespace's share of ``bytes_to_use``, once its
    metadata, quarantine allowance and the other namespaces are counted."""
    used_bytes: int
    """Bytes of the slots holding a block (resident or being written)."""
    blocks: int
    """Blocks resident or being written."""
    block_bytes: int
    """Payload bytes per block."""
    file_bytes: int
    """Bytes per slot (header + payload)."""
    hits: int
    """Blocks loaded and verified."""
    misses: int
    """Blocks asked for and not loaded (absent or failed)."""
    stores: int
    """Blocks written."""
    store_failures: int
    """Blocks whose write failed (I/O error or no room)."""
    evictions: int
    """Blocks evicted to make room."""
    bytes_read: int
    """Payload bytes read by successful loads."""
    bytes_written: int
    """Payload bytes written by successful stores."""
    read_gbps: float
    """``bytes_read`` over the time reads were in flight, in GB/s (1e9 B/s)."""
    write_gbps: float
    """``bytes_written`` over the time writes were in flight, in GB/s."""
    io_engine: str
    """``"io_uring"`` or ``"threads"``."""
    queue_depth: int
    """The I/O engine's queue depth."""
    direct_io: bool
    """True when the slot file uses O_DIRECT."""
    direct_io_fallback: str | None
    """Why buffered I/O is used instead of O_DIRECT, or None."""
    durability: str
    """``"none"`` or ``"fsync"``."""
    quarantined: int
    """Blocks that failed verification since the tier was opened, and slots
    found at open with a header of another namespace."""
    recovery: Literal["running", "complete", "failed"]
    """State of the rebuild from the slot file: it finishes inside
    :meth:`FileTier.open` with ``recovery="foreground"``; with ``"background"``
    it is ``"running"`` until :meth:`FileTier.wait_recovered` would return."""
    recovered_blocks: int
    """Blocks found valid at open."""
    recovery_seconds: float
    """Time the slot scan and rebuild took at open."""
    torn_slots: int
    """Slots found at open with an invalid header (an interrupted write), zeroed."""


@dataclass(slots=True)
class _Job:
    """One store or load call: the blocks still running and what they gave."""

    done: Completion[Any]
    store: bool
    remaining: int
    ok: list[bytes] = field(default_factory=list)
    failed: dict[bytes, KVTierError] = field(default_factory=dict)
    skipped: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    order: tuple[bytes, ...] = ()


@dataclass(slots=True)
class _BlockOp:
    store: bool
    key: bytes
    view: memoryview
    job: _Job
    slot: int
    """Slot of the file (not the manager's slot number)."""
    page: int = -1
    checksum: int = 0
    """XXH3 of the payload (stores), computed off the loop before the write."""
    syncing: bool = False
    """Written, waiting for an fsync: it holds no I/O slot."""


class _HeaderPages:
    """Page-aligned header buffers, one per block in flight (O_DIRECT needs aligned memory)."""

    def __init__(self, count: int) -> None:
        self._map = mmap.mmap(-1, count * HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._free = list(range(count))

    def take(self) -> int:
        return self._free.pop()

    def give(self, index: int) -> None:
        self._free.append(index)

    def view(self, index: int) -> memoryview:
        return self._view[index * HEADER_BYTES : (index + 1) * HEADER_BYTES]

    def close(self) -> None:
        self._view.release()
        # A finished request's view may still be alive (a completion's closure):
        # the mapping is then unmapped by the garbage collector once it goes.
        with contextlib.suppress(BufferError):
            self._map.close()


_Then = Callable[[Any, Exception | None], None]
"""Called on the loop with a worker call's return value, or None and its error."""


class _Worker:
    """One thread computing payload checksums off the event loop.

    It also writes quarantine copies, one at a time.

    XXH3 releases the GIL and reads the payload from memory at 7-13 GB/s
    here: at 256 KiB a block it was a third of the loop's work per store.
    One busy thread takes its queue in batches and hands results back with one
    ``call_soon_threadsafe`` per batch; several threads cost more CPU per GB
    (each wakes up for every call) for no more throughput (measured on the
    former metadata threads, docs/file-tier.md).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Then] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtier-file-tier", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any], then: _Then) -> None:
        """Run ``call`` on the thread; ``then`` gets its outcome on the loop."""
        self._jobs.put((call, then))

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        jobs = self._jobs
        while True:
            batch = [jobs.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < _WORKER_BATCH:
                    batch.append(jobs.get_nowait())
            done: list[tuple[_Then, Any, Exception | None]] = []
            stop = False
            for job in batch:
                if job is None:
                    stop = True
                    continue
                call, then = job
                try:
                    result = call()
                except Exception as exc:
                    # An error must fail its block, not kill the thread (every later
                    # call would wait for ever, and aclose with them).
                    done.append((then, None, exc))
                else:
                    done.append((then, result, None))
            if done:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._loop.call_soon_threadsafe(_deliver, done)
            if stop:
                return


def _deliver(done: list[tuple[_Then, Any, Exception | None]]) -> None:
    for then, result, exc in done:
        try:
            then(result, exc)
        except Exception:
            # One failing callback must not strand the rest of the batch (their
            # blocks would stay in flight and aclose would wait forever).
            log.exception("file tier: a worker completion failed")


class FileTier:
    """Blocks in slots of one preallocated file under a root directory.

    Open with :meth:`open`; close with :meth:`aclose`. Every slot of a tier
    has ``4096 + block_bytes`` bytes, and ``blocks.dat`` has as many slots as
    the namespace's share of the root's ``bytes_to_use`` holds (see
    :mod:`kvtier.tiers._root`), reserved at open. Methods are called from the
    event loop the tier was opened on.

    Notes
    -----
    **Alignment.** With O_DIRECT active, every buffer handed to :meth:`store`
    or :meth:`load` must start at an address that is a multiple of
    ``alignment`` and be exactly ``block_bytes`` long (a multiple of
    ``alignment``); CPU-region rows are. A buffer that is not raises
    :class:`~kvtier.errors.AlignmentError` before any I/O is submitted.

    **Cancellation.** :meth:`store` and :meth:`load` return a
    :class:`~kvtier.transfer.completion.Completion`; cancelling a task that
    awaits it does not cancel the I/O. The buffers are read (store) or written
    (load) by the kernel until the completion is done: do not reuse or release
    them before. A block being written is not visible (``lookup`` misses it)
    until its write has completed (and, with ``durability="fsync"``, been
    flushed); a block being loaded is pinned and cannot be evicted until its
    load finishes or fails.
    """

    def __init__(
        self,
        *,
        config: FileTierConfig,
        layout: KVLayout,
        block_bytes: int,
        alignment: int,
        engine: IOEngine,
        owns_engine: bool,
        manager: ResidencyManager,
        ns_dir: Path,
        ns_fd: int,
        data_fd: int,
        lock_fd: int,
        direct_fallback: str | None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._config = config
        self._namespace = layout.namespace
        self._block_bytes = block_bytes
        self._file_bytes = HEADER_BYTES + block_bytes
        self._alignment = alignment
        self._engine = engine
        self._owns_engine = owns_engine
        self._manager = manager
        self._slots = manager.capacity
        self._file_slot = array("q", range(self._slots))
        """The file slot of each manager slot: a fixed bijection, set when the
        blocks found at open are handed to the manager (which picks its own
        slot numbers). An array: 8 bytes a slot, where a list of ints costs
        about 36."""
        self._dir = ns_dir
        self._data_path = str(ns_dir / DATA_FILE)
        self._ns_fd = ns_fd
        self._fd = data_fd
        self._lock_fd = lock_fd
        self._direct = direct_fallback is None
        self._direct_fallback = direct_fallback
        self._io_alignment = alignment if self._direct else 1
        self._fsync = config.durability == "fsync"
        # Two blocks per engine slot keep the queue full while completions are
        # handled, and bound the header pages.
        self._max_active = 2 * engine.queue_depth
        self._pages = _HeaderPages(self._max_active)
        self._zero_page = mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._pending: collections.deque[_BlockOp] = collections.deque()
        self._active = 0
        self._zeroing: dict[int, list[_BlockOp]] = {}
        """File slots whose header is being zeroed, with the stores waiting for it."""
        self._zero_when_free: dict[bytes, int] = {}
        """Forgotten blocks still read by a load: their slot is zeroed after the last."""
        self._sync_waiting: list[_BlockOp] = []
        self._sync_running: list[_BlockOp] | None = None
        self._worker = _Worker(self._loop)
        self._quarantining = 0
        self._closed = False
        self._idle: asyncio.Future[None] | None = None
        self._quarantine_seq = 0
        # counters
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._store_failures = 0
        self._evictions = 0
        self._bytes_read = 0
        self._bytes_written = 0
        self._busy = {True: 0, False: 0}  # blocks in flight, by "is a store"
        self._busy_since = {True: 0.0, False: 0.0}
        self._busy_seconds = {True: 0.0, False: 0.0}
        self._quarantined = 0
        self._recovered = 0
        self._recovery_seconds = 0.0
        self._torn = 0
        self._recovery: Literal["running", "complete", "failed"] = "complete"
        self._recovery_task: asyncio.Task[None] | None = None

    # -- opening ------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        config: FileTierConfig,
        layout: KVLayout,
        *,
        block_bytes: int,
        alignment: int = 4096,
        io_engine: IOEngine | None = None,
        enable_events: bool = False,
    ) -> FileTier:
        """Open (creating if needed) the tier for ``layout`` under ``config.root``.

        Parameters
        ----------
        config
            Root, byte budget, eviction policy, io engine, direct I/O mode,
            queue depth and durability.
        layout
            The KV layout; its namespace names the tier's directory and is
            written into, and checked against, every block.
        block_bytes
            Payload bytes of every block (one CPU-region row), a multiple of
            ``alignment``.
        alignment
            O_DIRECT alignment of buffers, offsets and lengths: a power of two
            from 512 to 4096.
        io_engine
            An engine to share; by default one is opened from
            ``config.io_engine`` and ``config.queue_depth`` and closed with the tier.
        enable_events
            Record residency events (see :meth:`take_events`).

        Returns
        -------
        FileTier
            Ready, with residency and usage rebuilt from the slot file.

        Raises
        ------
        InvalidArgumentError
            For a bad ``block_bytes`` or ``alignment``.
        CapacityError
            When ``bytes_to_use`` is smaller than one slot, when what the other
            namespaces of the root hold leaves no room for one (the message
            names them), or when the filesystem has not the free space for the
            share (the message names the free bytes and the budget).
        NamespaceMismatchError
            When the namespace directory was made for another block size.
        DirectIOUnsupportedError
            With ``direct_io="require"`` on a filesystem that refuses O_DIRECT.
        BusyError
            When another process has this namespace directory open.
        TierIOError
            When the directories or the slot file cannot be created, read or
            reserved (``ENOSPC`` when the disk filled after the free space was
            checked), or ``namespace.json`` is malformed (``EUCLEAN``, naming
            the field).

        Notes
        -----
        ``bytes_to_use`` is the budget of the root, every namespace under it
        and everything kvtier writes there included. Under a lock on the
        root, opening measures what the other namespaces hold (open ones
        keep their share; with ``reclaim="lru"`` namespaces no tier has open
        are deleted, least recently used first, until this one has the
        budget less what open ones hold), checks that the filesystem has the
        free space, and reserves the slots that fit in the share for
        ``blocks.dat`` with ``fallocate``, so a full disk fails here and not
        in the middle of serving; a smaller share than last time truncates
        the file (the blocks past the new end are gone). An open that fails,
        at any step or cancelled, leaves the disk as it found it: a slot file
        it created is removed, one it grew is truncated back to its old size
        (its blocks intact), a namespace directory it created is removed.
        Cancelling waits for a disk step in progress to end. It then reads the header of every
        slot that holds data (never-written ranges are skipped with
        ``SEEK_DATA``): valid blocks become resident, oldest first, and
        invalid headers (interrupted writes) are zeroed. A directory of
        format version 1 (one file per block) is discarded with a warning.

        With ``config.recovery="background"`` that scan runs after ``open``
        returns: until it ends the tier knows no block (lookups miss, loads
        report every key missing), refuses stores (each key fails with
        :class:`~kvtier.errors.BusyError`) and ignores :meth:`remove`; see
        :meth:`wait_recovered`.
        """
        if not 512 <= alignment <= HEADER_BYTES or alignment & (alignment - 1):
            raise InvalidArgumentError(
                f"alignment must be a power of two from 512 to {HEADER_BYTES}, got {alignment}"
            )
        if block_bytes <= 0 or block_bytes % alignment:
            raise InvalidArgumentError(
                f"block_bytes must be a positive multiple of {alignment}, got {block_bytes}"
            )
        file_bytes = HEADER_BYTES + block_bytes
        if int(config.bytes_to_use) < file_bytes:
            raise CapacityError(
                f"bytes_to_use ({int(config.bytes_to_use)}) holds no slot of {file_bytes} bytes"
            )
        root = Path(config.root)
        await asyncio.to_thread(_make_root, root)
        root_lock = await lock_root(root)
        try:
            # One thread does every disk step of the open under the root lock,
            # and undoes them itself when one fails.
            prepared, cancelled = await _run_to_end(prepare, config, layout, block_bytes, alignment)
            if cancelled:
                # Cancelled while the thread ran: it finished, so undo what it did.
                await _run_to_end(_abandon, prepared)
                raise asyncio.CancelledError
        finally:
            os.close(root_lock)
        undo = prepared.undo
        engine: IOEngine | None = None
        tier: FileTier | None = None
        try:
            owns = io_engine is None
            engine = io_engine or await open_io_engine(
                config.io_engine, queue_depth=config.queue_depth
            )
            manager = ResidencyManager(
                prepared.slots,
                policy=config.eviction_policy,
                enable_events=enable_events,
                tier="file",
            )
            tier = cls(
                config=config,
                layout=layout,
                block_bytes=block_bytes,
                alignment=alignment,
                engine=engine,
                owns_engine=owns,
                manager=manager,
                ns_dir=undo.ns_dir,
                ns_fd=prepared.ns_fd,
                data_fd=prepared.data_fd,
                lock_fd=prepared.lock_fd,
                direct_fallback=prepared.fallback,
            )
            if config.recovery == "background":
                tier._recovery = "running"
                tier._recovery_task = tier._loop.create_task(tier._recover_in_background())
            else:
                await tier._recover()
        except BaseException:
            # Whatever failed (the engine, the recovery, a cancellation), the
            # disk goes back to what it was before this open.
            if tier is not None:
                await _finish(tier.aclose())
            else:
                _close_prepared(prepared)
                if engine is not None and io_engine is None:
                    await _finish(engine.aclose())
            await _run_to_end(undo_under_root_lock, root, undo)
            raise
        return tier

    @staticmethod
    def budget_for(slots: int, block_bytes: int, *, unit: int = 4096) -> int:
        """The smallest ``bytes_to_use`` giving one namespace alone on its root ``slots`` slots.

        Parameters
        ----------
        slots
            Slots wanted, at least 1.
        block_bytes
            Payload bytes per block.
        unit
            The filesystem's allocation unit (``statvfs`` ``f_frsize``; 4096 on
            ext4, XFS and tmpfs).

        Returns
        -------
        int
            The slot file, the filesystem's extent blocks allowed for it (one
            unit plus 48 bytes a slot), ``min(8, slots // 16)`` quarantine copies,
            and the metadata: the root directory, the namespace's three
            directories, a ``namespace.json`` of up to one unit and the
            ``O_DIRECT`` probe file, a unit each.

        Raises
        ------
        InvalidArgumentError
            When ``slots`` is below 1 or ``block_bytes`` not positive.
        """
        if slots < 1 or block_bytes < 1:
            raise InvalidArgumentError(
                f"slots and block_bytes must be positive, got {slots} and {block_bytes}"
            )
        slot_bytes = HEADER_BYTES + block_bytes
        return unit + metadata_estimate(unit, unit) + data_cost(slots, slot_bytes, unit)

    # -- queries (no I/O) ---------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Payload bytes of every block."""
        return self._block_bytes

    @property
    def path(self) -> Path:
        """The namespace directory."""
        return self._dir

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""
        return self._closed

    @property
    def recovering(self) -> bool:
        """True while a background recovery runs (the tier knows no block yet)."""
        return self._recovery == "running"

    async def wait_recovered(self) -> None:
        """Wait until the blocks in the slot file are known (``recovery="background"``).

        Returns at once when recovery ran inside :meth:`open`. Cancelling the
        caller does not stop the recovery.

        Raises
        ------
        TierIOError
            When the recovery failed (the tier then stays empty and refuses
            stores); the cause is chained and logged.
        """
        task = self._recovery_task
        if task is not None and not task.done():
            await asyncio.shield(task)
        if self._recovery == "failed":
            raise TierIOError(_errno.EIO, "the file tier's recovery failed", self._dir)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is ready here; no I/O."""
        return self._manager.lookup(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._manager

    def is_ready(self, key: bytes) -> bool:
        """True when ``key``'s block is complete and may be loaded."""
        return self._manager.is_ready(key)

    def slot_of(self, key: bytes) -> int | None:
        """The slot of ``blocks.dat`` holding ``key`` (ready or being written), or None.

        The block starts at byte ``slot * (4096 + block_bytes)``; meant for
        tools and tests that look at the file.
        """
        mslot = self._manager.slot_of(key)
        return None if mslot is None else self._file_slot[mslot]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks used (as a hit would) without loading them; absent keys are ignored."""
        self._manager.touch(keys)

    def take_events(self) -> list[ManagerEvent]:
        """Residency events since the last call (empty unless ``enable_events``)."""
        return self._manager.take_events()

    def statistics(self) -> FileTierStatistics:
        """A snapshot of the tier's state and counters."""
        now = time.perf_counter()
        busy = {}
        for kind in (True, False):
            extra = now - self._busy_since[kind] if self._busy[kind] else 0.0
            busy[kind] = self._busy_seconds[kind] + extra
        blocks = self._manager.statistics().used
        return FileTierStatistics(
            capacity_bytes=self._slots * self._file_bytes,
            used_bytes=blocks * self._file_bytes,
            blocks=blocks,
            block_bytes=self._block_bytes,
            file_bytes=self._file_bytes,
            hits=self._hits,
            misses=self._misses,
            stores=self._stores,
            store_failures=self._store_failures,
            evictions=self._evictions,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            read_gbps=self._bytes_read / busy[False] / 1e9 if busy[False] else 0.0,
            write_gbps=self._bytes_written / busy[True] / 1e9 if busy[True] else 0.0,
            io_engine=self._engine.name,
            queue_depth=self._engine.queue_depth,
            direct_io=self._direct,
            direct_io_fallback=self._direct_fallback,
            durability=self._config.durability,
            quarantined=self._quarantined,
            recovery=self._recovery,
            recovered_blocks=self._recovered,
            recovery_seconds=self._recovery_seconds,
            torn_slots=self._torn,
        )

    # -- store --------------------------------------------------------------------------

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        """Write blocks from ``buffers``; keys already present are skipped.

        Parameters
        ----------
        keys
            Distinct 16-byte block keys.
        buffers
            One buffer of exactly ``block_bytes`` per key (a CPU-region row).

        Returns
        -------
        Completion[StoreResult]
            Resolves once every block is written (and flushed, with
            ``durability="fsync"``) or has failed; per-key outcomes are in the
            result, never raised.

        Raises
        ------
        InvalidArgumentError
            For bad keys, a count mismatch, or a buffer of the wrong size.
        AlignmentError
            For a buffer that breaks O_DIRECT alignment (before any I/O).
        ClosedError
            When the tier is closed.

        Notes
        -----
        Evicted blocks are forgotten at once and their slots overwritten by
        the new blocks. A block that fails (``ENOSPC``, ``EIO``, ``EACCES``, a
        short write) is reported in ``failed`` with a
        :class:`~kvtier.errors.TierIOError` carrying errno and path; its slot
        is zeroed and freed; the other blocks proceed. Buffers must stay
        untouched until the completion is done (see the class Notes on
        cancellation).
        """
        views = self._check_call(keys, buffers)
        done: Completion[StoreResult] = Completion(self._loop)
        if self._recovery != "complete":
            # Which slots hold blocks is not known yet: any write could destroy one.
            busy = BusyError(f"the file tier is {self._recovery_text()}: stores are refused")
            self._store_failures += len(keys)
            done.set_result(StoreResult(stored=(), skipped=(), failed=dict.fromkeys(keys, busy)))
            return done
        plan = self._manager.prepare_store(list(keys))
        if plan is None:
            present = tuple(k for k in keys if k in self._manager)
            err = CapacityError(
                f"no room for {len(keys) - len(present)} blocks in the file tier "
                f"({self._slots} slots, pinned or in flight ones cannot be evicted)"
            )
            failed: dict[bytes, KVTierError] = {k: err for k in keys if k not in present}
            self._store_failures += len(failed)
            done.set_result(StoreResult(stored=(), skipped=present, failed=failed))
            return done
        file_slot = self._file_slot
        to_write = {k: file_slot[s] for k, s in zip(plan.keys, plan.slots, strict=True)}
        evicted = tuple(plan.evicted)
        self._evictions += len(evicted)
        job = _Job(
            done,
            store=True,
            remaining=len(to_write),
            skipped=tuple(k for k in keys if k not in to_write),
            evicted=evicted,
            order=tuple(keys),
        )
        for key, view in zip(keys, views, strict=True):
            slot = to_write.get(key)
            if slot is not None:
                self._pending.append(_BlockOp(True, key, view, job, slot))
        if not to_write:
            self._finish_job(job)
        self._pump()
        return done

    # -- load ---------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        """Read blocks straight into ``buffers`` and verify them.

        Parameters
        ----------
        keys
            Distinct 16-byte block keys.
        buffers
            One writable buffer of exactly ``block_bytes`` per key.

        Returns
        -------
        Completion[LoadResult]
            Resolves once every block is read and verified or has failed. Keys
            not ready here, and blocks that fail verification or I/O, are in
            ``missing``; their buffers hold no valid data.

        Raises
        ------
        InvalidArgumentError
            For bad keys, a count mismatch, or a buffer of the wrong size or read-only.
        AlignmentError
            For a buffer that breaks O_DIRECT alignment (before any I/O).
        ClosedError
            When the tier is closed.

        Notes
        -----
        A checksum or header mismatch, or a short read, is an
        :class:`~kvtier.errors.IntegrityError` (a header naming another
        namespace a :class:`~kvtier.errors.NamespaceMismatchError`): the
        block's bytes are copied to ``quarantine/``, its slot zeroed, the
        block forgotten and never served again. Blocks are pinned against
        eviction until their own read finishes.
        """
        views = self._check_call(keys, buffers)
        for v in views:
            if v.readonly:
                raise InvalidArgumentError("load buffers must be writable")
        done: Completion[LoadResult] = Completion(self._loop)
        ready = [k for k in keys if self._manager.is_ready(k)]
        job = _Job(done, store=False, remaining=len(ready), order=tuple(keys))
        where = "file tier" if self._recovery == "complete" else self._recovery_text()
        for k in keys:
            if not self._manager.is_ready(k):
                job.failed[k] = BlockNotFoundError(f"block {k.hex()} is not in the {where}")
        if ready:
            plan = self._manager.prepare_load(ready)
            by_key = dict(zip(keys, views, strict=True))
            file_slot = self._file_slot
            for k, s in zip(plan.keys, plan.slots, strict=True):
                self._pending.append(_BlockOp(False, k, by_key[k], job, file_slot[s]))
        else:
            self._finish_job(job)
        self._pump()
        return done

    # -- removal and closing ------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget ready blocks and zero their slots; absent keys are ignored.

        A block being loaded keeps its bytes until its last load finishes; its
        slot is zeroed then.

        Raises
        ------
        ClosedError
            When the tier is closed.
        """
        self._check_open()
        check_keys(keys)
        ready = [k for k in keys if self._manager.is_ready(k)]
        if ready:
            self._forget(ready)

    async def aclose(self) -> None:
        """Wait for every block in flight, then release the tier; idempotent.

        Notes
        -----
        Queued and running stores and loads finish first (their buffers are in
        the kernel's hands); calls made after ``aclose`` started raise
        :class:`~kvtier.errors.ClosedError`. A background recovery is stopped
        (the slot file is left as it was). Cancelling the caller does not stop
        the close from completing in the background.
        """
        first = not self._closed
        self._closed = True
        task = self._recovery_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)
        if self._busy_now():
            if self._idle is None:
                self._idle = self._loop.create_future()
            await asyncio.shield(self._idle)
        if not first:
            return
        self._worker.close()
        if self._owns_engine:
            await self._engine.aclose()
        self._pages.close()
        with contextlib.suppress(BufferError):
            self._zero_page.close()
        with contextlib.suppress(OSError):
            # The lock file's mtime is the namespace's last use: the root's
            # accounting reclaims the least recently used first.
            os.utime(self._lock_fd)
        for fd in (self._fd, self._ns_fd, self._lock_fd):
            # Closing the lock descriptor releases the flock.
            os.close(fd)

    async def __aenter__(self) -> FileTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- pipeline -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the file tier is closed")

    def _check_call(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[memoryview]:
        self._check_open()
        check_keys(keys)
        if len(buffers) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
        for i, v in enumerate(views):
            if v.nbytes != self._block_bytes:
                raise InvalidArgumentError(
                    f"buffer {i} has {v.nbytes} bytes, blocks have {self._block_bytes}"
                )
            if not v.c_contiguous:
                raise InvalidArgumentError(f"buffer {i} is not contiguous")
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        IOEngine.check_aligned(views, 0, self._io_alignment)
        return views

    def _pump(self) -> None:
        while self._pending and self._active < self._max_active:
            op = self._pending.popleft()
            self._active += 1
            self._busy_start(op.store)
            self._start(op)

    def _start(self, op: _BlockOp) -> None:
        try:
            if not op.store:
                self._start_load(op)
            elif op.slot in self._zeroing:
                # The slot's previous block is being cleared; writing now could
                # land before the zeros and the zeros would erase this block.
                self._zeroing[op.slot].append(op)
            else:
                view = op.view
                self._worker.submit(lambda: checksum(view), lambda s, e: self._summed(op, s, e))
        except KVTierError as exc:
            self._block_done(op, exc)
        except Exception as exc:
            # A bug must not leave the block pinned or the tier waiting forever.
            log.exception("file tier: block %s failed to start", op.key.hex())
            self._block_done(op, TierIOError(_errno.EIO, f"internal error: {exc!r}"))

    def _busy_start(self, store: bool) -> None:
        if not self._busy[store]:
            self._busy_since[store] = time.perf_counter()
        self._busy[store] += 1

    def _busy_end(self, store: bool) -> None:
        self._busy[store] -= 1
        if not self._busy[store]:
            self._busy_seconds[store] += time.perf_counter() - self._busy_since[store]

    def _summed(self, op: _BlockOp, summed: int | None, exc: Exception | None) -> None:
        if summed is None:
            # The rows were validated, so a failed checksum is a bug: fail the block.
            self._block_done(op, TierIOError(_errno.EIO, f"internal error: checksum {exc!r}"))
            return
        op.checksum = summed
        try:
            op.page = self._pages.take()
            page = self._pages.view(op.page)
            encode_header_fields(
                page, op.key, self._namespace, self._block_bytes, summed, int(time.time())
            )
            done = self._engine.writev(
                self._fd, [page, op.view], op.slot * self._file_bytes, alignment=self._io_alignment
            )
        except KVTierError as exc:
            self._block_done(op, exc)
            return
        except Exception as exc:
            # Reached from a worker callback, outside _pump's guard: a bug must
            # not leave the block in flight and aclose waiting forever.
            log.exception("file tier: block %s failed to start", op.key.hex())
            self._block_done(op, TierIOError(_errno.EIO, f"internal error: {exc!r}"))
            return
        done.add_done_callback(lambda c: self._written(op, c))

    def _written(self, op: _BlockOp, done: Completion[int]) -> None:
        self._release_page(op)
        err: KVTierError | None = None
        exc = done.exception()
        if exc is not None:
            err = self._io_error(exc, f"writing slot {op.slot}")
        elif done.result() != self._file_bytes:
            err = TierIOError(
                0,
                f"short write of slot {op.slot}: {done.result()} of {self._file_bytes} bytes",
                self._data_path,
            )
        if err is not None or not self._fsync:
            self._block_done(op, err)
            return
        # The I/O slot is free once the data is written: a flush shared by
        # the blocks written meanwhile must not hold back the next writes.
        op.syncing = True
        self._active -= 1
        self._sync_waiting.append(op)
        self._start_sync()
        self._pump()

    def _io_error(self, exc: BaseException, what: str) -> TierIOError:
        """A failed request's error as this tier's: its errno (EIO when it has
        none), what the tier was doing, and the slot file's path."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else _errno.EIO
        text = getattr(exc, "strerror", None) or exc
        return TierIOError(code, f"{what}: {text}", self._data_path)

    def _start_sync(self) -> None:
        """Flush the slot file for every block written so far (one fsync for many)."""
        if self._sync_running is not None or not self._sync_waiting:
            return
        ops, self._sync_waiting = self._sync_waiting, []
        self._sync_running = ops
        try:
            done = self._engine.fsync(self._fd)
        except Exception as exc:
            self._synced(ops, exc)
            return
        done.add_done_callback(lambda c: self._synced(ops, c.exception()))

    def _synced(self, ops: list[_BlockOp], exc: BaseException | None) -> None:
        self._sync_running = None
        err: KVTierError | None = None
        if exc is not None:
            err = self._io_error(exc, "fsync")
        for op in ops:
            self._block_done(op, err)
        self._start_sync()

    def _start_load(self, op: _BlockOp) -> None:
        op.page = self._pages.take()
        done = self._engine.readv(
            self._fd,
            [self._pages.view(op.page), op.view],
            op.slot * self._file_bytes,
            alignment=self._io_alignment,
        )
        done.add_done_callback(lambda c: self._read(op, c))

    def _read(self, op: _BlockOp, done: Completion[int]) -> None:
        err: KVTierError | None = None
        exc = done.exception()
        if exc is not None:
            err = self._io_error(exc, f"reading slot {op.slot}")
        elif done.result() != self._file_bytes:
            err = IntegrityError(
                f"short read of slot {op.slot}: {done.result()} of {self._file_bytes} bytes",
                self._data_path,
            )
        else:
            err = self._verify(op)
        if isinstance(err, IntegrityError | NamespaceMismatchError) and op.page >= 0:
            self._quarantine(op, type(err).__name__)
        self._block_done(op, err)

    def _verify(self, op: _BlockOp) -> KVTierError | None:
        where = f"{self._data_path} slot {op.slot}"
        try:
            key, namespace, payload_bytes, _, payload_checksum = decode_header_fields(
                self._pages.view(op.page)
            )
        except HeaderError as exc:
            return IntegrityError(f"bad block header ({exc})", where)
        if namespace != self._namespace:
            return NamespaceMismatchError(
                f"{where} holds a block of namespace {namespace.hex()}, not {self._namespace.hex()}"
            )
        if key != op.key:
            return IntegrityError(f"slot holds block {key.hex()}, not {op.key.hex()}", where)
        if payload_bytes != self._block_bytes:
            return IntegrityError(
                f"payload of {payload_bytes} bytes, expected {self._block_bytes}", where
            )
        if checksum(op.view) != payload_checksum:
            return IntegrityError("payload checksum mismatch", where)
        return None

    def _release_page(self, op: _BlockOp) -> None:
        if op.page >= 0:
            self._pages.give(op.page)
            op.page = -1

    def _block_done(self, op: _BlockOp, err: KVTierError | None) -> None:
        self._release_page(op)
        job = op.job
        key = op.key
        if op.store:
            self._manager.complete_store([key], success=err is None)
            if err is None:
                self._stores += 1
                self._bytes_written += self._block_bytes
            else:
                self._store_failures += 1
                # What the failed write left in the slot is unknown: clear it so
                # that a restart cannot find a block nobody stored.
                self._zero_slot(op.slot)
        else:
            self._manager.complete_load([key])
            if err is None:
                self._hits += 1
                self._bytes_read += self._block_bytes
            elif key in self._manager and self._manager.is_ready(key):
                self._forget([key])
        if self._zero_when_free and key not in self._manager:
            slot = self._zero_when_free.pop(key, None)
            if slot is not None:
                self._zero_slot(slot)
        if err is None:
            job.ok.append(key)
        else:
            job.failed[key] = err
            log.warning("file tier: block %s: %s", key.hex(), err)
        self._busy_end(op.store)
        if op.syncing:
            op.syncing = False
        else:
            self._active -= 1
        job.remaining -= 1
        if job.remaining == 0:
            self._finish_job(job)
        self._pump()
        self._check_idle()

    def _busy_now(self) -> bool:
        return bool(
            self._active
            or self._pending
            or self._zeroing
            or self._sync_waiting
            or self._sync_running is not None
            or self._quarantining
        )

    def _check_idle(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done() and not self._busy_now():
            idle.set_result(None)

    def _finish_job(self, job: _Job) -> None:
        ok = set(job.ok)
        ordered = tuple(k for k in job.order if k in ok)
        if job.store:
            job.done.set_result(
                StoreResult(
                    stored=ordered, skipped=job.skipped, failed=job.failed, evicted=job.evicted
                )
            )
        else:
            self._misses += len(job.failed)
            if ordered:
                # A load is a use: the blocks a request hit move up the policy's order.
                self._manager.touch(list(ordered))
            job.done.set_result(LoadResult(loaded=ordered, missing=job.failed))

    # -- slots --------------------------------------------------------------------------

    def _forget(self, keys: list[bytes]) -> None:
        """Drop ready blocks (bad or unwanted) and zero their slots once no load reads them."""
        slots = {k: self.slot_of(k) for k in keys}
        self._manager.remove(keys)
        for key, slot in slots.items():
            if slot is None:
                continue  # not resident: nothing on disk is ours to clear
            if key in self._manager:
                self._zero_when_free[key] = slot  # a load still reads it
            else:
                self._zero_slot(slot)

    def _zero_slot(self, slot: int) -> None:
        """Overwrite a slot's header with zeros (a free slot), ordered before its next write."""
        if slot in self._zeroing:
            return
        self._zeroing[slot] = []
        try:
            done = self._engine.writev(
                self._fd,
                [memoryview(self._zero_page)],
                slot * self._file_bytes,
                alignment=self._io_alignment,
            )
        except Exception as exc:
            self._zeroed(slot, exc)
            return
        done.add_done_callback(lambda c: self._zeroed(slot, _short_or_error(c, HEADER_BYTES)))

    def _zeroed(self, slot: int, exc: BaseException | None) -> None:
        if exc is not None:
            # The block stays forgotten; if it comes back after a restart, its
            # checksum still decides whether it is served.
            log.error("file tier: cannot clear slot %d of %s: %s", slot, self._data_path, exc)
        for op in self._zeroing.pop(slot, []):
            self._start(op)
        self._check_idle()

    def _quarantine(self, op: _BlockOp, reason: str) -> None:
        """Keep a copy of a block that failed verification, for inspection (bounded)."""
        self._quarantine_seq += 1
        self._quarantined += 1
        keep = quarantine_keep(self._slots)
        if not keep:
            # Copies count in the root's budget: a tier this small keeps none.
            log.warning(
                "file tier: slot %d (block %s) failed verification (%s); no copy kept "
                "(a tier of %d slots keeps none)",
                op.slot,
                op.key.hex(),
                reason,
                self._slots,
            )
            return
        data = bytes(self._pages.view(op.page)) + bytes(op.view)
        name = f"{op.key.hex()}.{time.time_ns()}.{self._quarantine_seq}.{reason}"
        log.warning("file tier: slot %d (block %s) quarantined as %s", op.slot, op.key.hex(), name)
        qdir = self._dir / "quarantine"
        self._quarantining += 1
        # On the tier's one thread: copies are written and trimmed one at a time.
        self._worker.submit(
            lambda: _write_quarantine(qdir, name, data, keep), self._quarantine_done
        )

    def _quarantine_done(self, _result: object, exc: Exception | None) -> None:
        self._quarantining -= 1
        if exc is not None:
            log.error("file tier: quarantine copy failed: %s", exc)
        self._check_idle()

    # -- recovery -----------------------------------------------------------------------

    def _recovery_text(self) -> str:
        return (
            "file tier, still recovering"
            if self._recovery == "running"
            else ("file tier, whose recovery failed")
        )

    async def _recover_in_background(self) -> None:
        try:
            await self._recover()
        except asyncio.CancelledError:
            self._recovery = "failed"  # stopped by aclose
            raise
        except Exception:
            log.exception("file tier %s: recovery failed; the tier stays empty", self._dir)
            self._recovery = "failed"
        else:
            self._recovery = "complete"

    async def _recover(self) -> None:
        started = time.perf_counter()
        candidates = await asyncio.to_thread(
            _slots_with_data, self._fd, self._slots, self._file_bytes
        )
        found: dict[bytes, tuple[int, int]] = {}  # key -> (stored_at, file slot)
        bad: list[int] = []
        stale: list[int] = []
        span = self._file_bytes
        batches = _scan_batches(candidates, span)
        buffer = mmap.mmap(-1, 2 * _SCAN_BUFFER)
        view = memoryview(buffer)
        try:

            def submit(half: int, batch: list[tuple[int, int]]) -> list[Completion[int]]:
                out, at = [], half * _SCAN_BUFFER
                for first, count in batch:
                    size = (count - 1) * span + HEADER_BYTES
                    out.append(
                        self._engine.readv(
                            self._fd,
                            [view[at : at + size]],
                            first * span,
                            alignment=self._io_alignment,
                        )
                    )
                    at += size
                return out

            inflight = submit(0, batches[0]) if batches else []
            for n, batch in enumerate(batches):
                current = inflight
                # The next batch's reads run while this one is decoded.
                inflight = submit((n + 1) % 2, batches[n + 1]) if n + 1 < len(batches) else []
                at = (n % 2) * _SCAN_BUFFER
                for (first, count), done in zip(batch, current, strict=True):
                    size = (count - 1) * span + HEADER_BYTES
                    try:
                        got = await done
                    except Exception as exc:
                        log.error("file tier: cannot read slots from %d at open: %s", first, exc)
                        at += size
                        continue
                    for i in range(count):
                        offset = i * span
                        header = view[at + offset : at + offset + HEADER_BYTES]
                        valid = HEADER_BYTES if got >= offset + HEADER_BYTES else 0
                        self._classify(first + i, header, valid, found, bad, stale)
                    at += size
        finally:
            # Slices of the buffer may still be referenced by finished
            # requests; the mapping then goes with them.
            with contextlib.suppress(BufferError):
                view.release()
                buffer.close()
        for slot in bad + stale:
            self._zero_slot(slot)
        self._restore(found)
        if self._zeroing:
            # Torn headers are cleared before the tier takes writes.
            self._idle = self._loop.create_future()
            self._check_idle()
            await self._idle
            self._idle = None
        self._recovery_seconds = time.perf_counter() - started
        if found or bad:
            log.info(
                "file tier %s: recovered %d blocks in %.3f s (%d slots read, %d torn, "
                "%d of another namespace)",
                self._dir,
                self._recovered,
                self._recovery_seconds,
                len(candidates),
                self._torn,
                len(bad) - self._torn,
            )

    def _classify(
        self,
        slot: int,
        page: memoryview,
        got: int,
        found: dict[bytes, tuple[int, int]],
        bad: list[int],
        stale: list[int],
    ) -> None:
        if got == HEADER_BYTES and page[:8] != _ZERO_PAGE[:8]:
            try:
                key, namespace, payload, stored_at = scan_header(page)
            except HeaderError:
                payload = -1
            if payload != self._block_bytes:
                self._torn += 1
                bad.append(slot)
            elif namespace != self._namespace:
                self._quarantined += 1
                bad.append(slot)
            else:
                prev = found.get(key)
                # Two slots may hold one key (evicted, stored again, then a
                # crash): both are valid; keep the newer and clear the other,
                # or it would come back once the newer is removed.
                if prev is None:
                    found[key] = (stored_at, slot)
                elif prev[0] < stored_at:
                    found[key] = (stored_at, slot)
                    stale.append(prev[1])
                else:
                    stale.append(slot)
        elif got == HEADER_BYTES and page != _ZERO_PAGE:
            self._torn += 1  # a header without its magic: a write cut short
            bad.append(slot)

    def _restore(self, found: dict[bytes, tuple[int, int]]) -> None:
        """Hand the blocks found to the manager, oldest first, and fix the slot mapping."""
        order = sorted(found, key=lambda k: found[k])
        mapping = array("q", [-1]) * self._slots
        taken: set[int] = set()
        for i in range(0, len(order), _RECOVERY_BATCH):
            # The manager takes the first key of a call as the most recent:
            # each batch goes newest first, the batches oldest first.
            batch = order[i : i + _RECOVERY_BATCH][::-1]
            plan = self._manager.prepare_store(batch)
            if plan is None or plan.evicted:
                # Cannot happen: at most one block per file slot was found.
                raise TierIOError(_errno.EIO, "internal error: recovery overflowed the manager")
            for key, mslot in zip(plan.keys, plan.slots, strict=True):
                mapping[mslot] = found[key][1]
                taken.add(found[key][1])
            self._manager.complete_store(list(plan.keys), success=True)
        free = (s for s in range(self._slots) if s not in taken)
        for mslot, slot in enumerate(mapping):
            if slot < 0:
                mapping[mslot] = next(free)
        self._file_slot = mapping
        self._recovered = len(order)


_ZERO_PAGE = bytes(HEADER_BYTES)


def _short_or_error(done: Completion[int], want: int) -> BaseException | None:
    """The request's error, an error for a short transfer, or None."""
    exc = done.exception()
    if exc is None and done.result() != want:
        exc = OSError(_errno.EIO, f"short write: {done.result()} of {want} bytes")
    return exc


# -- helpers (run in worker threads where they touch the disk) -------------------------


def _scan_batches(slots: list[int], span: int) -> list[list[tuple[int, int]]]:
    """Group the slots to scan into reads ``(first slot, count)``, and reads into batches.

    A read covers ``(count - 1) * span + 4096`` bytes: from the first header to
    the end of the last one; a batch fits in :data:`_SCAN_BUFFER`.
    """
    per_read = max(1, (_SCAN_BUFFER // 4) // span) if span <= _SCAN_WHOLE_SLOTS else 1
    reads: list[tuple[int, int]] = []
    for slot in slots:
        if reads and reads[-1][0] + reads[-1][1] == slot and reads[-1][1] < per_read:
            reads[-1] = (reads[-1][0], reads[-1][1] + 1)
        else:
            reads.append((slot, 1))
    batches: list[list[tuple[int, int]]] = []
    used = _SCAN_BUFFER
    for first, count in reads:
        size = (count - 1) * span + HEADER_BYTES
        if used + size > _SCAN_BUFFER or len(batches[-1]) >= _SCAN_READS:
            batches.append([])
            used = 0
        batches[-1].append((first, count))
        used += size
    return batches


def _slots_with_data(fd: int, slots: int, slot_bytes: int) -> list[int]:
    """Slots whose header lies in a range ``SEEK_DATA`` reports (all where unsupported).

    Ranges never written since the file was reserved read back as zeros, so a
    tier opened half full reads only the headers of the slots it used.
    """
    out: list[int] = []
    end = slots * slot_bytes
    offset = 0
    try:
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == _errno.ENXIO:
                    break  # no data past offset
                raise
            stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
            # Slots whose header [s*slot_bytes, s*slot_bytes + 4096) meets [start, stop).
            first = max(0, (start - HEADER_BYTES) // slot_bytes + 1) if start >= HEADER_BYTES else 0
            last = min(slots, -(-stop // slot_bytes))
            if out and first <= out[-1]:
                first = out[-1] + 1
            out.extend(range(first, last))
            offset = max(stop, offset + 1)
    except OSError as exc:
        if exc.errno not in (_errno.EINVAL, _errno.EOPNOTSUPP):
            raise TierIOError(exc.errno or 0, f"cannot scan the slot file: {exc.strerror}") from exc
        return list(range(slots))
    return out


def _write_quarantine(qdir: Path, name: str, data: bytes, keep: int) -> None:
    """Write a quarantine copy, first deleting the oldest so that at most ``keep`` exist.

    Trimming before writing, not after, keeps the quarantine within the
    bytes the root's accounting gave it at every instant.
    """
    trim_quarantine(qdir, keep - 1)
    path = qdir / name
    try:
        write_file(path, data, os.O_EXCL)
    except OSError as exc:
        log.error("file tier: cannot write the quarantine copy %s: %s", name, exc)
        with contextlib.suppress(OSError):
            os.unlink(path)  # a partial copy is no use, and takes disk


def _make_root(root: Path) -> None:
    try:
        if not root.exists():
            root.mkdir(mode=0o700, parents=True)
            os.chmod(root, 0o700)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot create the tier root: {exc.strerror}", exc.filename or root
        ) from exc


def _close_prepared(prepared: Prepared) -> None:
    for fd in (prepared.data_fd, prepared.ns_fd, prepared.lock_fd):
        os.close(fd)


def _abandon(prepared: Prepared) -> None:
    """Undo a prepared namespace the caller no longer wants (still under the root lock)."""
    try:
        prepared.undo.rollback()
    finally:
        _close_prepared(prepared)


async def _finish(aw: Awaitable[_T]) -> tuple[_T, bool]:
    """Await ``aw`` to its end even when the caller is cancelled meanwhile.

    Returns its result and whether the caller was cancelled (the caller then
    raises ``CancelledError`` itself). A step of an open that changes the
    disk must not go on behind the caller's back: what it did is undone only
    once it is known.
    """
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = cancelled or not task.done()
        except BaseException:
            break  # the task's own error, raised by result() below
    return task.result(), cancelled


async def _run_to_end(fn: Callable[..., _T], *args: Any) -> tuple[_T, bool]:
    """:func:`_finish` of ``fn(*args)`` run in a worker thread."""
    return await _finish(asyncio.to_thread(fn, *args))
