"""The file tier: bounded, checksummed, crash-consistent block files on O_DIRECT.

One file per block under a root directory::

    <root>/                               0700, created if missing
      <namespace hex>/                    0700, one per KV layout namespace
        namespace.json                    human-readable: layout, block size, format
        lock                              flock'ed by the process that has it open
        blocks/00/ .. blocks/ff/          fan-out by the first byte of the key
          <key hex>                       header (4 KiB) + payload, mode 0600
        tmp/                              blocks being written; emptied at open
        quarantine/                       files that failed verification (bounded)

A block is written to ``tmp/`` with ``O_DIRECT``, checked for a short write,
optionally fsync'ed, and renamed into ``blocks/``: a name in ``blocks/`` always
denotes a complete file. Every read verifies the header (magic, version, key,
namespace, length, header checksum) and the payload's XXH3-64; a file that
fails is moved to ``quarantine/``, forgotten, and reported as a miss.

Residency and the byte budget belong to a
:class:`~kvtier.manager.ResidencyManager` whose slots are block files (every
file of a namespace has the same size): the manager decides, this module only
moves bytes and files. See ``docs/file-tier.md`` for the durability rules.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import fcntl
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiofiles

from kvtier.config import FileTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    BusyError,
    CapacityError,
    ClosedError,
    DirectIOUnsupportedError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.manager import ManagerEvent, ResidencyManager
from kvtier.tiers._format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    BlockHeader,
    HeaderError,
    checksum,
    decode_header,
    encode_header,
)
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine, open_io_engine

__all__ = ["FileTier", "FileTierStatistics", "LoadResult", "StoreResult"]

log = logging.getLogger("kvtier.file_tier")

_FANOUT = [f"{i:02x}" for i in range(256)]
_QUARANTINE_KEEP = 8
"""Quarantined files kept for inspection; older ones are deleted so that the
quarantine cannot grow the tier past its byte budget by more than this many files."""
_RECOVERY_BATCH = 1024
_META_BATCH = 256
_META_CREATORS = 1
"""File-creation threads of a tier, beside its ordered metadata thread (more
measured no faster: see :class:`_MetaWorkers`)."""


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
    """Keys evicted (files unlinked) to make room."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one :meth:`FileTier.load`, per key."""

    loaded: tuple[bytes, ...]
    """Keys whose bytes are now in their buffers, verified."""
    missing: Mapping[bytes, KVTierError]
    """Keys whose buffers hold no valid data, with why:
    :class:`~kvtier.errors.BlockNotFoundError` (not resident),
    :class:`~kvtier.errors.IntegrityError` or
    :class:`~kvtier.errors.NamespaceMismatchError` (file quarantined), or
    :class:`~kvtier.errors.TierIOError` (errno and path)."""


@dataclass(frozen=True, slots=True)
class FileTierStatistics:
    """State and counters of a :class:`FileTier`."""

    capacity_bytes: int
    """Bytes the tier may use: whole block files within ``bytes_to_use``."""
    used_bytes: int
    """Bytes of block files resident or being written."""
    blocks: int
    """Blocks resident or being written."""
    block_bytes: int
    """Payload bytes per block."""
    file_bytes: int
    """Bytes per block file (header + payload)."""
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
    """True when block files use O_DIRECT."""
    direct_io_fallback: str | None
    """Why buffered I/O is used instead of O_DIRECT, or None."""
    durability: str
    """``"none"`` or ``"fsync"``."""
    quarantined: int
    """Files moved to quarantine since the tier was opened (found at open included)."""
    recovery: Literal["complete"]
    """State of the rebuild from the directory; it finishes inside :meth:`FileTier.open`."""
    recovered_blocks: int
    """Blocks found valid at open."""
    recovery_seconds: float
    """Time the directory scan and rebuild took at open."""
    removed_temporaries: int
    """Leftover temporary files (interrupted writes) deleted at open."""


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
    fd: int = -1
    page: int = -1
    tmp: str = ""
    checksum: int = 0
    """XXH3 of the payload (stores), computed off the loop before the write."""
    publishing: bool = False
    """Written and closed, its rename queued: it holds no descriptor or I/O slot."""


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


_Then = Callable[[Any, OSError | None], None]
"""Called on the loop with a metadata call's return value, or None and its OSError."""


class _MetaWorkers:
    """Threads running file-system metadata calls off the event loop.

    Creating, opening, closing and renaming block files cost 20-90 us of
    kernel time each on an idle disk here, and filling a tier with new files
    while block writes stream cost 6-8 CPU s/GB (1.5-2 ms a 256 KiB block):
    on the loop they would stall every other task.

    One *ordered* thread runs every call but file creations, in submission
    order: a later rename of a key never overtakes an earlier one (such as
    the move aside of its evicted file). It also computes the checksums of
    blocks written over spare files (XXH3 releases the GIL). Creations (of
    uniquely named files, with their block's checksum) run on a separate
    *creation* thread, so that renames publishing finished blocks never wait
    behind them. Measured here, more threads did not pay: three creation
    threads filled an empty tier no faster than one, and spreading all calls
    over four threads cost 30-50% more CPU per GB in the steady state for no
    more throughput (one busy thread batches its work; several wake up for
    every call). Outcomes come back to the loop in batches, one
    ``call_soon_threadsafe`` per batch.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, creators: int) -> None:
        self._loop = loop
        self._queues: list[queue.SimpleQueue[tuple[Callable[[], Any], _Then] | None]] = [
            queue.SimpleQueue() for _ in range(1 + creators)
        ]
        self._next = 0
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"kvtier-meta-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()

    def submit(self, call: Callable[[], Any], then: _Then) -> None:
        """Run ``call`` on the ordered thread, after every call submitted before."""
        self._queues[0].put((call, then))

    def submit_create(self, call: Callable[[], Any], then: _Then) -> None:
        """Run ``call`` (a file creation) on the next creation thread."""
        self._next = self._next % (len(self._queues) - 1) + 1
        self._queues[self._next].put((call, then))

    def close(self) -> None:
        for q in self._queues:
            q.put(None)

    def _run(self, jobs: queue.SimpleQueue[tuple[Callable[[], Any], _Then] | None]) -> None:
        while True:
            batch = [jobs.get()]
            with contextlib.suppress(queue.Empty):
                while len(batch) < _META_BATCH:
                    batch.append(jobs.get_nowait())
            done: list[tuple[_Then, Any, OSError | None]] = []
            stop = False
            for job in batch:
                if job is None:
                    stop = True
                    continue
                call, then = job
                try:
                    result = call()
                except OSError as exc:
                    done.append((then, None, exc))
                except Exception as exc:
                    # A bug must fail its block, not kill the thread (every later
                    # call would wait for ever, and aclose with them).
                    log.exception("file tier: a metadata call failed")
                    done.append((then, None, OSError(_errno.EIO, f"internal error: {exc!r}")))
                else:
                    done.append((then, result, None))
            if done:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._loop.call_soon_threadsafe(_deliver, done)
            if stop:
                return


def _deliver(done: list[tuple[_Then, Any, OSError | None]]) -> None:
    for then, result, exc in done:
        try:
            then(result, exc)
        except Exception:
            # One failing callback must not strand the rest of the batch (their
            # blocks would stay in flight and aclose would wait forever).
            log.exception("file tier: a metadata completion failed")


class FileTier:
    """Block files under a root directory, bounded by a byte budget.

    Open with :meth:`open`; close with :meth:`aclose`. Every block file of a
    tier has ``4096 + block_bytes`` bytes. Methods are called from the event
    loop the tier was opened on.

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
    until its file is complete and renamed into place; a block being loaded is
    pinned and cannot be evicted until its load finishes or fails.
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
        tmp_fd: int,
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
        self._slots = int(config.bytes_to_use) // (HEADER_BYTES + block_bytes)
        self._dir = ns_dir
        self._ns_fd = ns_fd
        self._tmp_fd = tmp_fd
        self._lock_fd = lock_fd
        self._direct = direct_fallback is None
        self._direct_fallback = direct_fallback
        self._io_alignment = alignment if self._direct else 1
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self._direct else 0)
        self._write_flags = flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._read_flags = flags | os.O_RDONLY
        self._fsync = config.durability == "fsync"
        # Two blocks per engine slot keep the queue full while completions are
        # handled, and bound open descriptors and header pages.
        self._max_active = 2 * engine.queue_depth
        self._pages = _HeaderPages(self._max_active)
        self._pending: collections.deque[_BlockOp] = collections.deque()
        self._active = 0
        self._publishing = 0
        self._tmp_seq = 0
        self._spares: list[tuple[str, int]] = []
        """Evicted files moved to tmp/, each open for writing: (name, descriptor)."""
        self._meta = _MetaWorkers(self._loop, _META_CREATORS)
        self._pending_stores = 0
        self._spares_coming = 0
        self._tasks: set[asyncio.Task[None]] = set()
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
        self._removed_tmp = 0

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
            written into, and checked against, every block file.
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
            Ready, with residency and usage rebuilt from the directory.

        Raises
        ------
        InvalidArgumentError
            For a bad ``block_bytes`` or ``alignment``.
        CapacityError
            When ``bytes_to_use`` is smaller than one block file.
        NamespaceMismatchError
            When the namespace directory was made for another block size.
        DirectIOUnsupportedError
            With ``direct_io="require"`` on a filesystem that refuses O_DIRECT.
        BusyError
            When another process has this namespace directory open.
        TierIOError
            When the directories cannot be created or read.

        Notes
        -----
        Opening removes leftover temporaries (interrupted writes), quarantines
        files of the wrong size or name, and evicts by policy if the files
        found exceed the budget. The scan runs in a worker thread (the loop
        keeps running); its duration is in :meth:`statistics`.
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
        slots = int(config.bytes_to_use) // file_bytes
        if slots < 1:
            raise CapacityError(
                f"bytes_to_use ({int(config.bytes_to_use)}) holds no block file of "
                f"{file_bytes} bytes"
            )
        root = Path(config.root)
        ns_dir = root / layout.namespace.hex()
        await asyncio.to_thread(_make_dirs, root, ns_dir)
        lock_fd = _lock(ns_dir)
        fds: list[int] = [lock_fd]
        engine: IOEngine | None = None
        try:
            await _check_or_write_description(ns_dir, layout, block_bytes, alignment)
            fallback = await asyncio.to_thread(
                _probe_direct_io, ns_dir / "tmp", config.direct_io, alignment
            )
            ns_fd = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
            fds.append(ns_fd)
            tmp_fd = os.open("tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=ns_fd)
            fds.append(tmp_fd)
            owns = io_engine is None
            engine = io_engine or await open_io_engine(
                config.io_engine, queue_depth=config.queue_depth
            )
            manager = ResidencyManager(
                slots, policy=config.eviction_policy, enable_events=enable_events, tier="file"
            )
            tier = cls(
                config=config,
                layout=layout,
                block_bytes=block_bytes,
                alignment=alignment,
                engine=engine,
                owns_engine=owns,
                manager=manager,
                ns_dir=ns_dir,
                ns_fd=ns_fd,
                tmp_fd=tmp_fd,
                lock_fd=lock_fd,
                direct_fallback=fallback,
            )
        except BaseException:
            for fd in fds:
                os.close(fd)
            if engine is not None and io_engine is None:
                await engine.aclose()
            raise
        try:
            await tier._recover()
        except BaseException:
            await tier.aclose()
            raise
        return tier

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

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is ready here; no I/O."""
        return self._manager.lookup(keys)

    def __contains__(self, key: object) -> bool:
        return key in self._manager

    def is_ready(self, key: bytes) -> bool:
        """True when ``key``'s file is complete and may be loaded."""
        return self._manager.is_ready(key)

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
        mstats = self._manager.statistics()
        blocks = mstats.used
        return FileTierStatistics(
            capacity_bytes=self._manager_capacity() * self._file_bytes,
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
            recovery="complete",
            recovered_blocks=self._recovered,
            recovery_seconds=self._recovery_seconds,
            removed_temporaries=self._removed_tmp,
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
            Resolves once every block is written and renamed into place, or has
            failed; per-key outcomes are in the result, never raised.

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
        Evicted blocks are forgotten at once; their files are moved to
        ``tmp/`` and overwritten by the new blocks (or unlinked). A block
        that fails (``ENOSPC``, ``EIO``, ``EACCES``, a short write) is
        reported in ``failed`` with a :class:`~kvtier.errors.TierIOError`
        carrying errno and path; its temporary file is removed and its slot
        freed; the other blocks proceed. Buffers must stay untouched until the
        completion is done (see the class Notes on cancellation).
        """
        views = self._check_call(keys, buffers)
        done: Completion[StoreResult] = Completion(self._loop)
        plan = self._manager.prepare_store(list(keys))
        if plan is None:
            present = tuple(k for k in keys if k in self._manager)
            err = CapacityError(
                f"no room for {len(keys) - len(present)} blocks in the file tier "
                f"({self._manager_capacity()} slots, pinned or in flight ones cannot be evicted)"
            )
            failed: dict[bytes, KVTierError] = {k: err for k in keys if k not in present}
            self._store_failures += len(failed)
            done.set_result(StoreResult(stored=(), skipped=present, failed=failed))
            return done
        to_write = set(plan.keys)
        evicted = tuple(plan.evicted)
        for key in evicted:
            self._recycle_block(key)
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
            if key in to_write:
                self._pending.append(_BlockOp(True, key, view, job))
                self._pending_stores += 1
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
        A checksum or header mismatch, or a short file, is an
        :class:`~kvtier.errors.IntegrityError` (a header naming another
        namespace a :class:`~kvtier.errors.NamespaceMismatchError`): the file
        is moved to quarantine, the block forgotten, and never served again.
        Blocks are pinned against eviction until their own read finishes.
        """
        views = self._check_call(keys, buffers)
        for v in views:
            if v.readonly:
                raise InvalidArgumentError("load buffers must be writable")
        done: Completion[LoadResult] = Completion(self._loop)
        ready = [k for k in keys if self._manager.is_ready(k)]
        job = _Job(done, store=False, remaining=len(ready), order=tuple(keys))
        for k in keys:
            if not self._manager.is_ready(k):
                job.failed[k] = BlockNotFoundError(f"block {k.hex()} is not in the file tier")
        if ready:
            self._manager.prepare_load(ready)
        by_key = dict(zip(keys, views, strict=True))
        for k in ready:
            self._pending.append(_BlockOp(False, k, by_key[k], job))
        if not ready:
            self._finish_job(job)
        self._pump()
        return done

    # -- removal and closing ------------------------------------------------------------

    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget ready blocks and unlink their files; absent keys are ignored.

        Raises
        ------
        ClosedError
            When the tier is closed.
        """
        self._check_open()
        check_keys(keys)
        ready = [k for k in keys if self._manager.is_ready(k)]
        if ready:
            self._manager.remove(ready)
            for k in ready:
                self._unlink_block(k)

    async def aclose(self) -> None:
        """Wait for every block in flight, then release the tier; idempotent.

        Notes
        -----
        Queued and running stores and loads finish first (their buffers are in
        the kernel's hands); calls made after ``aclose`` started raise
        :class:`~kvtier.errors.ClosedError`. Cancelling the caller does not
        stop the close from completing in the background.
        """
        first = not self._closed
        self._closed = True
        if self._active or self._publishing or self._pending or self._spares_coming:
            if self._idle is None:
                self._idle = self._loop.create_future()
            await asyncio.shield(self._idle)
        if not first:
            return
        for name, fd in self._spares:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._tmp_fd)
        self._spares.clear()
        self._meta.close()
        if self._owns_engine:
            await self._engine.aclose()
        self._pages.close()
        for fd in (self._tmp_fd, self._ns_fd, self._lock_fd):
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
            if self._pending[0].store and not self._spares and self._spares_coming:
                # An evicted file is on its way to tmp/: overwriting it is far
                # cheaper than creating a file, so wait for it (in order).
                break
            op = self._pending.popleft()
            self._pending_stores -= op.store
            self._active += 1
            self._busy_start(op.store)
            try:
                if op.store:
                    self._start_store(op)
                else:
                    self._start_load(op)
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

    def _block_path(self, key: bytes) -> str:
        # The key's hex digest is the only way a key ever becomes a path.
        name = key.hex()
        return f"blocks/{name[:2]}/{name}"

    def _start_store(self, op: _BlockOp) -> None:
        # The checksum is computed on a metadata thread too (XXH3 releases the
        # GIL): at 256 KiB blocks it was a third of the loop's work per block.
        # Over a spare it runs on the ordered thread, which is awake anyway.
        view = op.view
        if self._spares:
            # Overwriting an evicted file in place: no inode or extent allocation.
            op.tmp, op.fd = self._spares.pop()
            self._meta.submit(lambda: checksum(view), lambda cs, exc: self._summed(op, cs, exc))
            return
        self._tmp_seq += 1
        name = f"{op.key.hex()}.{os.getpid()}.{self._tmp_seq}.tmp"
        flags, tmp_fd = self._write_flags, self._tmp_fd
        self._meta.submit_create(
            # The checksum first: if it failed after the open, the fd would leak.
            lambda: (checksum(view), os.open(name, flags, 0o600, dir_fd=tmp_fd)),
            lambda both, exc: self._created(op, name, both, exc),
        )

    def _summed(self, op: _BlockOp, summed: int | None, exc: OSError | None) -> None:
        if summed is None:
            # The rows were validated, so a failed checksum is a bug: fail the block.
            self._block_done(op, TierIOError(_errno.EIO, f"internal error: checksum {exc!r}"))
            return
        op.checksum = summed
        self._write_block(op)

    def _created(
        self, op: _BlockOp, name: str, both: tuple[int, int] | None, exc: OSError | None
    ) -> None:
        fd = None
        if both is not None:
            op.checksum, fd = both
        if exc is not None or fd is None:
            err = self._io_error(
                exc or OSError(_errno.EIO, "no descriptor"),
                "cannot create block file",
                str(self._dir / "tmp" / name),
            )
            self._block_done(op, err)
            return
        op.tmp, op.fd = name, fd
        self._write_block(op)

    def _write_block(self, op: _BlockOp) -> None:
        try:
            op.page = self._pages.take()
            page = self._pages.view(op.page)
            header = BlockHeader(op.key, self._namespace, self._block_bytes, op.checksum)
            encode_header(page, header)
            done = self._engine.writev(op.fd, [page, op.view], 0, alignment=self._io_alignment)
        except KVTierError as exc:
            self._block_done(op, exc)
            return
        except Exception as exc:
            # Reached from a metadata callback too, outside _pump's guard: a bug
            # must not leave the block in flight and aclose waiting forever.
            log.exception("file tier: block %s failed to start", op.key.hex())
            self._block_done(op, TierIOError(_errno.EIO, f"internal error: {exc!r}"))
            return
        done.add_done_callback(lambda c: self._written(op, c))

    def _written(self, op: _BlockOp, done: Completion[int]) -> None:
        self._release_page(op)
        err: KVTierError | None = None
        exc = done.exception()
        if isinstance(exc, TierIOError):
            err = TierIOError(exc.errno or 0, f"writing block: {exc.strerror}", self._abs_tmp(op))
        elif exc is not None:
            err = TierIOError(_errno.EIO, f"writing block: {exc}", self._abs_tmp(op))
        elif done.result() != self._file_bytes:
            err = TierIOError(
                0,
                f"short write: {done.result()} of {self._file_bytes} bytes",
                self._abs_tmp(op),
            )
        if err is not None:
            self._block_done(op, err)
            return
        if self._fsync:
            task = self._loop.create_task(self._sync_and_publish(op))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        # The I/O slot is free once the data is written: a rename waiting
        # behind others on the metadata thread must not hold back the next
        # writes (the device would idle).
        fd, rename = op.fd, self._rename_into_place(op)
        op.fd = -1  # closed by the metadata thread (Linux frees it even when close fails)
        op.publishing = True
        self._active -= 1
        self._publishing += 1

        def close_and_rename() -> None:
            os.close(fd)
            rename()

        self._meta.submit(close_and_rename, lambda _, exc: self._published(op, exc))
        self._pump()

    def _published(self, op: _BlockOp, exc: OSError | None) -> None:
        if exc is not None:
            err = self._io_error(exc, "cannot rename block file into place", self._abs_tmp(op))
            self._block_done(op, err)
            return
        op.tmp = ""
        self._block_done(op, None)

    async def _sync_and_publish(self, op: _BlockOp) -> None:
        err: KVTierError | None = None
        try:
            await self._engine.fsync(op.fd)
            # Through the ordered metadata thread like every other rename: its FIFO order
            # puts this rename after the spare rename of an earlier eviction of
            # the same key, which would otherwise move the new file aside.
            exc = await self._meta_call(self._rename_into_place(op))
            if exc is not None:
                raise exc
            op.tmp = ""
            # The rename is durable only once its directory is flushed.
            name = op.key.hex()
            dfd = os.open(
                f"blocks/{name[:2]}",
                os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                dir_fd=self._ns_fd,
            )
            try:
                await self._engine.fsync(dfd)
            finally:
                os.close(dfd)
        except TierIOError as exc:
            err = TierIOError(exc.errno or 0, f"fsync: {exc.strerror}", self._abs_tmp(op))
        except OSError as exc:
            err = self._io_error(exc, "fsync or rename", self._abs_tmp(op))
        if err is not None and not op.tmp:
            # Renamed but not durable: a failed block must not stay on disk
            # outside the budget (its slot is freed below).
            self._unlink_block(op.key)
        self._block_done(op, err)

    def _rename_into_place(self, op: _BlockOp) -> Callable[[], object]:
        tmp, final = op.tmp, self._block_path(op.key)
        src, dst = self._tmp_fd, self._ns_fd
        return lambda: os.rename(tmp, final, src_dir_fd=src, dst_dir_fd=dst)

    def _meta_call(self, call: Callable[[], object]) -> asyncio.Future[OSError | None]:
        """Run ``call`` on the ordered metadata thread; the future gives its OSError or None."""
        fut: asyncio.Future[OSError | None] = self._loop.create_future()

        def then(_: object, exc: OSError | None) -> None:
            if not fut.done():
                fut.set_result(exc)

        self._meta.submit(call, then)
        return fut

    def _start_load(self, op: _BlockOp) -> None:
        try:
            op.fd = os.open(self._block_path(op.key), self._read_flags, dir_fd=self._ns_fd)
        except OSError as exc:
            raise self._io_error(exc, "cannot open block file", self._abs(op.key)) from exc
        op.page = self._pages.take()
        done = self._engine.readv(
            op.fd, [self._pages.view(op.page), op.view], 0, alignment=self._io_alignment
        )
        done.add_done_callback(lambda c: self._read(op, c))

    def _read(self, op: _BlockOp, done: Completion[int]) -> None:
        err: KVTierError | None = None
        path = self._abs(op.key)
        exc = done.exception()
        if exc is not None:
            errno_ = exc.errno if isinstance(exc, OSError) and exc.errno else _errno.EIO
            err = TierIOError(errno_, f"reading block: {exc}", path)
        elif done.result() != self._file_bytes:
            err = IntegrityError(
                f"short block file: {done.result()} of {self._file_bytes} bytes", path
            )
        else:
            err = self._verify(op, path)
        self._release_page(op)
        self._block_done(op, err)

    def _verify(self, op: _BlockOp, path: str) -> KVTierError | None:
        try:
            header = decode_header(self._pages.view(op.page))
        except HeaderError as exc:
            return IntegrityError(f"bad block header ({exc})", path)
        if header.namespace != self._namespace:
            return NamespaceMismatchError(
                f"block file {path} belongs to namespace {header.namespace.hex()}, "
                f"not {self._namespace.hex()}"
            )
        if header.key != op.key:
            return IntegrityError(f"file holds block {header.key.hex()}, not {op.key.hex()}", path)
        if header.payload_bytes != self._block_bytes:
            return IntegrityError(
                f"payload of {header.payload_bytes} bytes, expected {self._block_bytes}", path
            )
        if checksum(op.view) != header.payload_checksum:
            return IntegrityError("payload checksum mismatch", path)
        return None

    def _release_page(self, op: _BlockOp) -> None:
        if op.page >= 0:
            self._pages.give(op.page)
            op.page = -1

    def _block_done(self, op: _BlockOp, err: KVTierError | None) -> None:
        if op.fd >= 0:
            os.close(op.fd)
            op.fd = -1
        self._release_page(op)
        job = op.job
        if op.store:
            if op.tmp:
                with contextlib.suppress(OSError):
                    os.unlink(op.tmp, dir_fd=self._tmp_fd)
            self._manager.complete_store([op.key], success=err is None)
            if err is None:
                self._stores += 1
                self._bytes_written += self._block_bytes
            else:
                self._store_failures += 1
        else:
            self._manager.complete_load([op.key])
            if err is None:
                self._hits += 1
                self._bytes_read += self._block_bytes
            else:
                self._forget_bad_block(op.key, err)
        if err is None:
            job.ok.append(op.key)
        else:
            job.failed[op.key] = err
            log.warning("file tier: block %s: %s", op.key.hex(), err)
        self._busy_end(op.store)
        if op.publishing:
            self._publishing -= 1
        else:
            self._active -= 1
        job.remaining -= 1
        if job.remaining == 0:
            self._finish_job(job)
        self._pump()
        self._check_idle()

    def _check_idle(self) -> None:
        idle = self._idle
        busy = self._active or self._publishing or self._pending or self._spares_coming
        if not busy and idle is not None and not idle.done():
            idle.set_result(None)

    def _forget_bad_block(self, key: bytes, err: KVTierError) -> None:
        self._manager.remove([key])
        if isinstance(err, TierIOError) and err.errno == _errno.ENOENT:
            return
        self._quarantine(self._block_path(key), key.hex(), type(err).__name__)

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

    # -- files --------------------------------------------------------------------------

    def _abs(self, key: bytes) -> str:
        return str(self._dir / self._block_path(key))

    def _abs_tmp(self, op: _BlockOp) -> str:
        return str(self._dir / "tmp" / op.tmp) if op.tmp else self._abs(op.key)

    @staticmethod
    def _io_error(exc: OSError, what: str, path: str) -> TierIOError:
        return TierIOError(exc.errno or 0, f"{what}: {exc.strerror}", path)

    def _recycle_block(self, key: bytes) -> None:
        """Move an evicted block's file aside for the next store to overwrite.

        Creating a file costs an inode and extent allocation (measured here
        from 20 us to 1 ms a file, varying with the filesystem's state);
        overwriting one of the right size costs neither. A spare lives in
        ``tmp/`` (deleted at open after a crash) and is never more than the
        stores waiting for it, so the files on disk stay within the budget.
        """
        self._tmp_seq += 1
        name = f"spare.{os.getpid()}.{self._tmp_seq}.tmp"
        src, ns_fd, tmp_fd = self._block_path(key), self._ns_fd, self._tmp_fd
        flags = self._write_flags & ~(os.O_CREAT | os.O_EXCL)
        self._spares_coming += 1
        # On the ordered metadata thread, before any later rename of the same key.
        self._meta.submit(
            lambda: _take_spare(src, name, ns_fd, tmp_fd, flags),
            lambda fd, exc: self._spare_ready(key, name, fd, exc),
        )

    def _spare_ready(self, key: bytes, name: str, fd: int | None, exc: OSError | None) -> None:
        self._spares_coming -= 1
        if exc is None and fd is not None and fd >= 0:
            if len(self._spares) < self._pending_stores:
                self._spares.append((name, fd))
            else:
                # Budget invariant: spares never outnumber the stores that will
                # overwrite them (some of those failed or found another spare).
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._tmp_fd)
        elif (
            exc is not None and not isinstance(exc, FileNotFoundError) and key not in self._manager
        ):
            # The file could not be moved aside: it must not stay on disk unaccounted.
            self._unlink_block(key)
        self._pump()
        self._check_idle()

    def _unlink_block(self, key: bytes) -> None:
        try:
            os.unlink(self._block_path(key), dir_fd=self._ns_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # The manager already forgot it; a file we cannot unlink is only logged
            # because nothing can act on it, and it is gone from the budget's view.
            log.error("file tier: cannot unlink evicted block %s: %s", key.hex(), exc)

    def _quarantine(self, rel: str, name: str, reason: str) -> None:
        self._quarantine_seq += 1
        target = f"quarantine/{name}.{time.time_ns()}.{self._quarantine_seq}.{reason}"
        try:
            os.rename(rel, target, src_dir_fd=self._ns_fd, dst_dir_fd=self._ns_fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.error("file tier: cannot quarantine %s: %s; unlinking it", rel, exc)
            with contextlib.suppress(OSError):
                os.unlink(rel, dir_fd=self._ns_fd)
            return
        self._quarantined += 1
        log.warning("file tier: quarantined %s as %s (%s)", rel, target, reason)
        _trim_quarantine(self._dir / "quarantine")

    def _manager_capacity(self) -> int:
        return self._manager.capacity

    # -- recovery -----------------------------------------------------------------------

    async def _recover(self) -> None:
        started = time.perf_counter()
        scan = await asyncio.to_thread(_scan, self._dir, self._file_bytes)
        self._removed_tmp = scan.removed_tmp
        for rel, name, reason in scan.bad:
            self._quarantine(rel, name, reason)
        found = [key for _mtime, key in sorted(scan.found)]
        # Oldest first, so that the policy's order starts close to last use.
        step = min(_RECOVERY_BATCH, self._slots)
        dropped = 0
        for i in range(0, len(found), step):
            batch = found[i : i + step]
            plan = self._manager.prepare_store(batch)
            if plan is None:
                # Cannot happen with nothing pinned and batches within capacity;
                # files that cannot be accounted for must not stay on disk.
                for key in batch:
                    self._unlink_block(key)
                dropped += len(batch)
                continue
            for key in plan.evicted:
                self._unlink_block(key)
            self._evictions += len(plan.evicted)
            self._manager.complete_store(list(plan.keys), success=True)
        self._recovered = len(found) - self._evictions - dropped
        self._recovery_seconds = time.perf_counter() - started
        if found or scan.removed_tmp or scan.bad:
            log.info(
                "file tier %s: recovered %d blocks in %.3f s (%d temporaries removed, "
                "%d files quarantined, %d evicted over budget)",
                self._dir,
                self._recovered,
                self._recovery_seconds,
                scan.removed_tmp,
                len(scan.bad),
                self._evictions,
            )


# -- directory helpers (run in worker threads where they touch many files) -------------


def _make_dir(path: Path) -> None:
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        raise TierIOError(_errno.ENOTDIR, "not a directory (a symlink is refused)", path)
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        # Created by us with a umask that widened nothing, or by someone else:
        # block files of a KV cache are private either way.
        os.chmod(path, 0o700)


def _make_dirs(root: Path, ns_dir: Path) -> None:
    try:
        if not root.exists():
            root.mkdir(mode=0o700, parents=True)
            os.chmod(root, 0o700)
        _make_dir(ns_dir)
        for sub in ("blocks", "tmp", "quarantine"):
            _make_dir(ns_dir / sub)
        blocks = ns_dir / "blocks"
        for name in _FANOUT:
            _make_dir(blocks / name)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0,
            f"cannot create the tier directories: {exc.strerror}",
            exc.filename or root,
        ) from exc


def _lock(ns_dir: Path) -> int:
    path = ns_dir / "lock"
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


async def _check_or_write_description(
    ns_dir: Path, layout: KVLayout, block_bytes: int, alignment: int
) -> None:
    path = ns_dir / "namespace.json"
    desc = {
        "format": "kvtier file tier",
        "format_version": FORMAT_VERSION,
        "namespace": layout.namespace.hex(),
        "block_bytes": block_bytes,
        "file_bytes": HEADER_BYTES + block_bytes,
        "header_bytes": HEADER_BYTES,
        "alignment": alignment,
        "layout": layout.describe(),
    }
    try:
        async with aiofiles.open(path, "rb", opener=_nofollow_opener(os.O_RDONLY)) as fh:
            existing = json.loads(await fh.read())
    except FileNotFoundError:
        existing = None
    except (OSError, ValueError) as exc:
        raise TierIOError(
            getattr(exc, "errno", 0) or 0, f"unreadable namespace.json: {exc}", path
        ) from exc
    if existing is not None:
        if (
            existing.get("block_bytes") != block_bytes
            or existing.get("namespace") != desc["namespace"]
        ):
            raise NamespaceMismatchError(
                f"{ns_dir} holds blocks of {existing.get('block_bytes')} bytes for namespace "
                f"{existing.get('namespace')}; this tier has {block_bytes}-byte blocks"
            )
        return
    # Written whole under a temporary name, then renamed: never half a description.
    # Buffered (no O_DIRECT: the text is not block-aligned, and it is written once).
    tmp = ns_dir / f"tmp/namespace.json.{os.getpid()}"
    text = json.dumps(desc, indent=2, sort_keys=True).encode() + b"\n"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    async with aiofiles.open(tmp, "wb", buffering=0, opener=_nofollow_opener(flags)) as fh:
        await fh.write(text)
    os.rename(tmp, path)


def _nofollow_opener(flags: int) -> Callable[[str, int], int]:
    def opener(path: str, _flags: int) -> int:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    return opener


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


@dataclass(slots=True)
class _Scan:
    found: list[tuple[int, bytes]] = field(default_factory=list)
    bad: list[tuple[str, str, str]] = field(default_factory=list)
    removed_tmp: int = 0


_HEX = frozenset("0123456789abcdef")


def _scan(ns_dir: Path, file_bytes: int) -> _Scan:
    """Walk the namespace directory: temporaries removed, blocks listed, strays flagged."""
    out = _Scan()
    for entry in os.scandir(ns_dir / "tmp"):
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                continue
            os.unlink(entry.path)
            out.removed_tmp += 1
    for sub in _FANOUT:
        for entry in os.scandir(ns_dir / "blocks" / sub):
            name = entry.name
            rel = f"blocks/{sub}/{name}"
            if len(name) != 32 or not _HEX.issuperset(name) or name[:2] != sub:
                out.bad.append((rel, f"{sub}-{name[:40]}", "stray"))
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not entry.is_file(follow_symlinks=False):
                out.bad.append((rel, name, "not-a-file"))
            elif st.st_size != file_bytes:
                out.bad.append((rel, name, "torn"))
            else:
                out.found.append((st.st_mtime_ns, bytes.fromhex(name)))
    return out


def _take_spare(src: str, name: str, ns_fd: int, tmp_fd: int, flags: int) -> int:
    """Move an evicted block file to ``tmp/name`` and open it for overwriting.

    Returns the descriptor, or -1 when the file was moved but cannot be opened
    (it is then unlinked: a spare nobody can write is only a budget leak).
    """
    os.rename(src, name, src_dir_fd=ns_fd, dst_dir_fd=tmp_fd)
    try:
        return os.open(name, flags, dir_fd=tmp_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=tmp_fd)
        return -1


def _trim_quarantine(qdir: Path) -> None:
    try:
        entries = sorted(os.scandir(qdir), key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
    except OSError:
        return
    for entry in entries[: max(0, len(entries) - _QUARANTINE_KEEP)]:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                continue
            os.unlink(entry.path)
