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
see :mod:`kvtier.tiers.block_format`) followed by the payload; a zero header is a
free slot. A store writes header and payload with one vectored ``O_DIRECT``
request at the slot's offset: no file is created, renamed or closed, so
filling a tier costs what overwriting it costs. Every read verifies the header
(magic, version, key, namespace, length, header checksum) and the payload's
XXH3; a block that fails is copied to ``quarantine/``, its slot zeroed, the
block forgotten and reported as a miss.

Residency and the byte budget belong to a
:class:`~kvtier.manager.ResidencyManager` whose slots map one to one onto
the file's slots: the manager decides, this module only moves bytes. See
``docs/file-tier.md`` for the durability rules and
``docs/lab/file-tier-design.md`` for why slots replaced one file per block.

The tier is this facade over parts, each a module with one job, owned by
:class:`FileTier` and wired at :meth:`FileTier.open`:

* :mod:`kvtier.tiers.file._slots`: the slot file (descriptors, geometry, the
  manager-to-file slot mapping, zeroing slots);
* :mod:`kvtier.tiers.file._recovery`: the scan of the slot headers at open;
* :mod:`kvtier.tiers.file._pipeline`: stores and loads of blocks through the I/O
  engine (header pages, verification, fsync batching, counters);
* :mod:`kvtier.tiers.file._quarantine`: bounded copies of blocks that failed;
* :mod:`kvtier.tiers.file._worker`: the tier's one thread (checksums, copies);
* :mod:`kvtier.tiers.file._root` (and the modules it lists: sizing, the root lock,
  the budget, deleting), :mod:`kvtier.tiers.file._namespace`,
  :mod:`kvtier.tiers.file._description`, :mod:`kvtier.tiers.block_format`: the root and
  its budget, the disk steps of an open, ``namespace.json``, the block header.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvtier._sizes import format_size
from kvtier.config import FileTierConfig
from kvtier.errors import (
    BusyError,
    CapacityError,
    ClosedError,
    InvalidArgumentError,
    KVTierError,
    TierIOError,
)
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.manager import ManagerEvent, ResidencyManager
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._description import LAYOUT_KIND, TIER_FORMAT_VERSION
from kvtier.tiers.file._namespace import Prepared, Undo, prepare, undo_under_root_lock
from kvtier.tiers.file._peers import RESCAN_S, Peers
from kvtier.tiers.file._pipeline import Pipeline
from kvtier.tiers.file._quarantine import Quarantine
from kvtier.tiers.file._recovery import Recovery
from kvtier.tiers.file._root_lock import lock_root, release_root
from kvtier.tiers.file._sizing import data_cost, metadata_estimate
from kvtier.tiers.file._slots import SlotFile, probe_range
from kvtier.tiers.file._worker import Worker
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import (
    DepthProbe,
    IOEngine,
    measure_queue_depth,
    open_io_engine,
    probe_depths,
)
from kvtier.transfer.uring import MAX_FIXED_BYTES, SPLIT_MIN

__all__ = [
    "LAYOUT_KIND",
    "TIER_FORMAT_VERSION",
    "FileTier",
    "FileTierStatistics",
    "LoadResult",
    "StoreResult",
]

try:
    # The compiled module whole, never a name from it: grimp reads .py files
    # only (tests/test_architecture.py says more).
    from kvtier.transfer import _address

    _check_views_c = _address.check_views
except ImportError:  # not built (no C compiler at install): the Python checks alone
    _check_views_c = None  # type: ignore[assignment]

_T = TypeVar("_T")

log = logging.getLogger("kvtier.file_tier")

AUTO_DEPTH_FALLBACK = 32
"""The depth of ``queue_depth="auto"`` where nothing is measured (see :func:`_measure_depth`)."""

_PROBE_BYTES = 64 << 20
"""Fewest bytes of slots the depth probe runs on (and at least 16 slots)."""


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
    """The I/O engine's queue depth (with ``queue_depth="auto"``, the one measured at open)."""
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
    registered_bytes: int = 0
    """Memory registered with the I/O engine by :meth:`FileTier.register_memory`
    (the caller's buffers and the tier's header pages); 0 when none is."""
    partition: str = ""
    """This tier's partition of the namespace (its directory's name): the
    namespace, then ``.<n>`` for the second and later live instances."""
    peer_partitions: int = 0
    """Other partitions of the namespace on the root (other instances, live or not)."""
    peer_blocks: int = 0
    """Blocks the other partitions hold, as their indexes say."""
    peer_hits: int = 0
    """Blocks loaded from other partitions, verified (also in ``hits``)."""
    peer_stale: int = 0
    """Reads from other partitions that found the slot rewritten or cleared by
    its owner meanwhile: misses, not damage (also in ``misses``)."""

    def metric_figures(self) -> dict[str, int | float | str]:
        """The file tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            # Every block failing verification has its slot quarantined.
            "integrity_failures_total": self.quarantined,
            "quarantined_blocks_total": self.quarantined,
            "evictions_total": self.evictions,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "recovery_blocks": self.recovered_blocks,
            "recovery_torn_slots": self.torn_slots,
            "recovery_seconds": self.recovery_seconds,
            "recovery_state": self.recovery,
            "vanished_blocks_total": self.peer_stale,
            "peer_blocks": self.peer_blocks,
        }


class FileTier(Tier):
    """Blocks in slots of one preallocated file under a root directory.

    Open with :meth:`open`; close with :meth:`aclose`. Every slot of a tier
    has ``4096 + block_bytes`` bytes, and ``blocks.dat`` has as many slots as
    the namespace's share of the root's ``bytes_to_use`` holds (see
    :mod:`kvtier.tiers.file._budget`), reserved at open. Methods are called from the
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
        self._engine = engine
        self._owns_engine = owns_engine
        self._registered = 0
        self._manager = manager
        self._closed = False
        self._idle: asyncio.Future[None] | None = None
        # The parts, each one job (see the module docstring); they report on
        # the loop when something of theirs ends, so that aclose knows when
        # nothing is in flight.
        self._worker = Worker(self._loop)
        self._slots = SlotFile(
            ns_dir=ns_dir,
            ns_fd=ns_fd,
            data_fd=data_fd,
            lock_fd=lock_fd,
            block_bytes=block_bytes,
            alignment=alignment,
            direct_fallback=direct_fallback,
            engine=engine,
            manager=manager,
            on_settled=self._check_idle,
        )
        self._quarantine = Quarantine(ns_dir, manager.capacity, self._worker, self._check_idle)
        self._pipeline = Pipeline(
            loop=self._loop,
            engine=engine,
            slots=self._slots,
            manager=manager,
            namespace=layout.namespace,
            worker=self._worker,
            quarantine=self._quarantine,
            fsync=config.durability == "fsync",
            on_settled=self._check_idle,
        )
        self._recovery = Recovery(
            slots=self._slots,
            engine=engine,
            manager=manager,
            namespace=layout.namespace,
            settle=self._settle,
        )
        self._peers = Peers(
            root=ns_dir.parent,
            namespace=layout.namespace,
            own=ns_dir.name,
            block_bytes=block_bytes,
            alignment=alignment if direct_fallback is None else None,
            engine=engine,
        )
        self._peer_reads = 0
        self._peer_misses = 0
        self._watchers: list[Callable[[Sequence[bytes], Sequence[bytes]], None]] = []
        self._next_scan = 0.0
        self._peers.scan()
        self._peers.poll()
        self._peers.take_changes()  # what is there now: watch() hands it over whole
        self._tick_handle = self._loop.call_later(config.peer_poll_s, self._tick)

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
            When the namespace directory, or another partition of the
            namespace on the root, was made for another block size.
        ConfigurationError
            When a live instance of the namespace on the root was given
            another ``bytes_to_use`` (the message names both).
        DirectIOUnsupportedError
            With ``direct_io="require"`` on a filesystem that refuses O_DIRECT.
        BusyError
            When every one of the 256 partitions of the namespace is open in a
            live tier (a tier opened while another holds the namespace takes a
            partition of its own: see ``docs/file-tier.md``, "Sharing a root").
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
        Cancelling waits for a disk step in progress to end. It then reads
        the header of every slot that holds data (never-written ranges are
        skipped with ``SEEK_DATA``): valid blocks become resident, oldest
        first, and invalid headers (interrupted writes) are zeroed. A
        directory of an older format is reused with a warning; what that
        format left in it stays and counts in ``bytes_to_use``.

        With ``config.queue_depth="auto"`` (and no ``io_engine`` given), the
        open first times the depths 1 to 32 (and on io_uring 64 for blocks of
        256 KiB up to 2 MiB, :func:`~kvtier.transfer.io_engine.probe_depths`)
        on the slot file itself: zeros written over never-written slots (which
        read as zeros already, so nothing a reader or the recovery sees
        changes), else reads of slots holding data; see ``docs/file-tier.md``
        and ``docs/lab/file-tier-design.md``, "Queue depth".

        With ``config.recovery="background"`` that scan runs after ``open``
        returns: until it ends the tier knows no block (lookups miss, loads
        report every key missing), refuses stores (each key fails with
        :class:`~kvtier.errors.BusyError`) and ignores :meth:`remove`; see
        :meth:`wait_recovered`.
        """
        _check_arguments(config, block_bytes, alignment)
        prepared, created_root = await _prepare_under_root_lock(
            config, layout, block_bytes, alignment
        )
        engine = io_engine
        tier: FileTier | None = None
        try:
            if engine is None:
                engine = await _open_engine(config, prepared, HEADER_BYTES + block_bytes, alignment)
            tier = cls._assemble(
                config,
                layout,
                prepared,
                engine,
                owns_engine=io_engine is None,
                block_bytes=block_bytes,
                alignment=alignment,
                enable_events=enable_events,
            )
            await tier._recover_at_open()
        except BaseException:
            # Whatever failed (the engine, the recovery, a cancellation), the
            # disk goes back to what it was before this open.
            owned = engine if io_engine is None else None
            await _unwind_open(Path(config.root), prepared, created_root, tier, owned)
            raise
        return tier

    @classmethod
    def _assemble(
        cls,
        config: FileTierConfig,
        layout: KVLayout,
        prepared: Prepared,
        engine: IOEngine,
        *,
        owns_engine: bool,
        block_bytes: int,
        alignment: int,
        enable_events: bool,
    ) -> FileTier:
        """The tier over a prepared namespace: its residency manager, then its parts."""
        manager = ResidencyManager(
            prepared.slots,
            policy=config.eviction_policy,
            enable_events=enable_events,
            tier="file",
        )
        return cls(
            config=config,
            layout=layout,
            block_bytes=block_bytes,
            alignment=alignment,
            engine=engine,
            owns_engine=owns_engine,
            manager=manager,
            ns_dir=prepared.undo.ns_dir,
            ns_fd=prepared.ns_fd,
            data_fd=prepared.data_fd,
            lock_fd=prepared.lock_fd,
            direct_fallback=prepared.fallback,
        )

    async def _recover_at_open(self) -> None:
        """Find the blocks of the slot file again: now, or from now on (``recovery``)."""
        if self._config.recovery == "background":
            self._recovery.start(self._loop)
        else:
            await self._recovery.run()

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
        return self._slots.block_bytes

    @property
    def path(self) -> Path:
        """The namespace directory."""
        return self._slots.dir

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has started."""
        return self._closed

    @property
    def recovering(self) -> bool:
        """True while a background recovery runs (the tier knows no block yet)."""
        return self._recovery.state == "running"

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
        await self._recovery.wait()

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is ready here; no I/O.

        Blocks of other instances sharing the root count (see :meth:`watch`).
        """
        n = self._manager.lookup(keys)
        peers, ready = self._peers, self._manager.is_ready
        if n < len(keys) and peers.blocks:
            for key in keys[n:]:
                if key not in peers and not ready(key):
                    break
                n += 1
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._manager or key in self._peers

    def is_ready(self, key: bytes) -> bool:
        """True when ``key``'s block is complete and may be loaded (here or in another
        instance's partition of the root)."""
        return self._manager.is_ready(key) or key in self._peers

    def watch(self, listener: Callable[[Sequence[bytes], Sequence[bytes]], None]) -> None:
        """Call ``listener(added, removed)`` as other instances' blocks come and go.

        ``listener`` is called on the tier's loop: at once with every block
        the other partitions of the root hold now, then, every
        ``peer_poll_s``, with the keys that became loadable from them and
        those that stopped being so (keys this tier holds itself are left
        out of ``removed``). It must not raise or block.
        """
        self._watchers.append(listener)
        listener(self._peers.keys(), ())

    def _tick(self) -> None:
        """Pick up what other instances published (every ``peer_poll_s``; rescans every second)."""
        peers = self._peers
        now = self._loop.time()
        if now >= self._next_scan:
            self._next_scan = now + RESCAN_S
            peers.scan()
        peers.poll()
        added, removed = peers.take_changes()
        if (added or removed) and self._watchers:
            ready = self._manager.is_ready
            removed = [k for k in removed if not ready(k)]
            for listener in self._watchers:
                try:
                    listener(added, removed)
                except Exception:  # a listener's bug must not stop the polling
                    log.exception("file tier: a watch listener failed")
        if not self._closed:
            self._tick_handle = self._loop.call_later(self._config.peer_poll_s, self._tick)

    def slot_of(self, key: bytes) -> int | None:
        """The slot of ``blocks.dat`` holding ``key`` (ready or being written), or None.

        The block starts at byte ``slot * (4096 + block_bytes)``; meant for
        tools and tests that look at the file.
        """
        return self._slots.slot_of(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks used (as a hit would) without loading them; absent keys are ignored."""
        self._manager.touch(keys)

    def take_recovered_keys(self) -> list[bytes]:
        """The keys of the blocks recovery found that are still here; once (no I/O).

        What a scheduler side that mirrors this tier's residency on another
        thread seeds itself with (:class:`~kvtier.chain.Chain`); after a
        background recovery, call it once :meth:`wait_recovered` returned.
        Later calls return ``[]``: the list is released.
        """
        keys, self._recovery.keys = self._recovery.keys, ()
        ready = self._manager.is_ready
        return [k for k in keys if ready(k)]

    def take_events(self) -> list[ManagerEvent]:
        """Residency events since the last call (empty unless ``enable_events``)."""
        return self._manager.take_events()

    def statistics(self) -> FileTierStatistics:
        """A snapshot of the tier's state and counters."""
        pipeline, slots, recovery = self._pipeline, self._slots, self._recovery
        read_busy, write_busy = pipeline.busy_seconds(False), pipeline.busy_seconds(True)
        blocks = self._manager.statistics().used
        return FileTierStatistics(
            capacity_bytes=slots.slots * slots.file_bytes,
            used_bytes=blocks * slots.file_bytes,
            blocks=blocks,
            block_bytes=slots.block_bytes,
            file_bytes=slots.file_bytes,
            hits=pipeline.hits + self._peers.hits,
            misses=pipeline.misses + self._peer_misses,
            stores=pipeline.stores,
            store_failures=pipeline.store_failures,
            evictions=pipeline.evictions,
            bytes_read=pipeline.bytes_read,
            bytes_written=pipeline.bytes_written,
            read_gbps=pipeline.bytes_read / read_busy / 1e9 if read_busy else 0.0,
            write_gbps=pipeline.bytes_written / write_busy / 1e9 if write_busy else 0.0,
            io_engine=self._engine.name,
            queue_depth=self._engine.queue_depth,
            direct_io=slots.direct,
            direct_io_fallback=slots.direct_fallback,
            durability=self._config.durability,
            quarantined=self._quarantine.count + recovery.foreign,
            recovery=recovery.state,
            recovered_blocks=recovery.recovered,
            recovery_seconds=recovery.seconds,
            torn_slots=recovery.torn,
            registered_bytes=self._registered,
            partition=slots.dir.name,
            peer_partitions=self._peers.partitions,
            peer_blocks=self._peers.blocks,
            peer_hits=self._peers.hits,
            peer_stale=self._peers.stale,
        )

    def register_memory(self, buffers: Sequence[object]) -> int:
        """Register the memory blocks are stored from and loaded into (the CPU region).

        A block whose buffer lies in registered memory is read or written
        without the kernel pinning its pages for each request (io_uring's
        fixed buffers; the tier's header pages are registered with it). At
        2 MiB that pinning was about a fifth of the tier's CPU per GB read
        without verification. Only blocks of at least
        :data:`~kvtier.transfer.uring.SPLIT_MIN` (1 MiB) bytes use it: below,
        the separate entry the header then needs costs more than the pinning,
        so a tier of smaller blocks registers nothing. Call it once the
        memory is mapped; a later call replaces the buffers, an empty list
        unregisters them. Blocks elsewhere are read and written as before.

        Parameters
        ----------
        buffers
            C-contiguous buffers, typically one: the whole CPU region. Each
            stays exported (an ``mmap`` cannot be closed) until the tier is
            closed or the buffers are replaced.

        Returns
        -------
        int
            Bytes registered, header pages included: 0 with the thread-pool
            engine, for blocks under 1 MiB, or when the kernel refused
            (``RLIMIT_MEMLOCK`` below the size, without ``CAP_IPC_LOCK``); the
            I/O then pins pages per request, as without this call.

        Raises
        ------
        InvalidArgumentError
            A buffer is not C-contiguous.
        """
        self._check_open()
        views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]  # type: ignore[arg-type]
        for v in views:
            if not v.c_contiguous:
                raise InvalidArgumentError("registered memory must be C-contiguous")
        if not views or self._slots.block_bytes < SPLIT_MIN:
            self._engine.unregister_memory(self)
            self._registered = 0
            return 0
        # Pieces of whole blocks (the kernel takes at most 1 GiB per buffer):
        # a row that straddled two would go as before, pages pinned per request.
        step = max(1, MAX_FIXED_BYTES // self._slots.block_bytes) * self._slots.block_bytes
        pieces: list[object] = [self._pipeline.header_memory]
        for v in views:
            v = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            pieces += [v[i : i + step] for i in range(0, v.nbytes, step)]
        self._registered = self._engine.register_memory(self, pieces)
        return self._registered

    # -- store --------------------------------------------------------------------------

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        """Write blocks from ``buffers`` (see :meth:`Tier.store`); present keys are skipped.

        Notes
        -----
        The completion resolves once every block is written, and flushed with
        ``durability="fsync"``. Evicted blocks are forgotten at once and their
        slots overwritten by the new blocks. A block that fails (``ENOSPC``,
        ``EIO``, ``EACCES``, a short write) is in ``failed`` with a
        :class:`~kvtier.errors.TierIOError` carrying errno and path; its slot
        is zeroed and freed; the other blocks proceed. While a background
        recovery runs, every block is in ``failed`` with a
        :class:`~kvtier.errors.BusyError`.
        """
        views = self._check_call(keys, buffers)
        if self._recovery.state != "complete":
            # Which slots hold blocks is not known yet: any write could destroy one.
            busy = BusyError(f"the file tier is {self._recovery.text()}: stores are refused")
            return self._pipeline.refuse(keys, busy)
        return self._pipeline.store(keys, views)

    # -- load ---------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        """Read blocks straight into ``buffers`` and verify them (see :meth:`Tier.load`).

        Notes
        -----
        A checksum or header mismatch, or a short read, is an
        :class:`~kvtier.errors.IntegrityError` (a header naming another
        namespace a :class:`~kvtier.errors.NamespaceMismatchError`): the
        block's bytes are copied to ``quarantine/``, its slot zeroed, the
        block forgotten and never served again. Blocks are pinned against
        eviction until their own read finishes.
        """
        views = self._check_call(keys, buffers, writable=True)
        where = "file tier" if self._recovery.state == "complete" else self._recovery.text()
        peers, own = self._peers, self._manager
        theirs = (
            [i for i, k in enumerate(keys) if k in peers and k not in own] if peers.blocks else []
        )
        if not theirs:
            return self._pipeline.load(keys, views, where)
        # Blocks of other instances' partitions: read and verified beside ours.
        mine = sorted(set(range(len(keys))) - set(theirs))
        parts = [
            self._pipeline.load([keys[i] for i in mine], [views[i] for i in mine], where),
            peers.load([keys[i] for i in theirs], [views[i] for i in theirs]),
        ]
        done: Completion[LoadResult] = Completion(self._loop)
        self._peer_reads += 1
        order = tuple(keys)

        def ended(_c: Completion[LoadResult]) -> None:
            if not all(p.done() for p in parts):
                return
            self._peer_reads -= 1
            loaded: set[bytes] = set()
            missing: dict[bytes, KVTierError] = {}
            for p in parts:
                result = p.result()
                loaded.update(result.loaded)
                missing.update(result.missing)
            self._peer_misses += len(parts[1].result().missing)
            done.set_result(
                LoadResult(loaded=tuple(k for k in order if k in loaded), missing=missing)
            )
            self._check_idle()

        for p in parts:
            p.add_done_callback(ended)
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
            self._slots.forget(ready)

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
        self._tick_handle.cancel()
        await self._recovery.stop()
        if self._busy_now():
            if self._idle is None:
                self._idle = self._loop.create_future()
            await asyncio.shield(self._idle)
        if not first:
            return
        self._worker.close()
        if self._owns_engine:
            await self._engine.aclose()
        else:
            self._engine.unregister_memory(self)
        self._registered = 0
        self._pipeline.close()
        self._peers.close()
        self._slots.close()

    async def __aenter__(self) -> FileTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- checks and idleness ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the file tier is closed")

    def _check_call(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], writable: bool = False
    ) -> list[memoryview]:
        """The call's buffers as 1-D byte views, each one block, aligned for the
        slot file's I/O (and writable for a load); raises InvalidArgumentError
        (AlignmentError) naming the first that is not."""
        self._check_open()
        check_keys(keys)
        if len(buffers) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        block_bytes = self._slots.block_bytes
        if (
            _check_views_c is not None
            and type(buffers) is list
            and _check_views_c(buffers, block_bytes, self._slots.io_alignment, writable) < 0
        ):
            # The usual call (rows of a region, as views): checked in one
            # compiled call, no copy. Anything else takes the checks below,
            # which convert what can be and name what cannot.
            return list(buffers)
        views = [b if isinstance(b, memoryview) else memoryview(b) for b in buffers]
        for i, v in enumerate(views):
            if v.nbytes != block_bytes:
                raise InvalidArgumentError(
                    f"buffer {i} has {v.nbytes} bytes, blocks have {block_bytes}"
                )
            if not v.c_contiguous:
                raise InvalidArgumentError(f"buffer {i} is not contiguous")
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        IOEngine.check_aligned(views, 0, self._slots.io_alignment)
        if writable:
            for v in views:
                if v.readonly:
                    raise InvalidArgumentError("load buffers must be writable")
        return views

    def _busy_now(self) -> bool:
        return (
            self._pipeline.busy
            or self._slots.clearing
            or self._quarantine.busy
            or bool(self._peer_reads)
        )

    def _check_idle(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done() and not self._busy_now():
            idle.set_result(None)

    async def _settle(self) -> None:
        """Wait until nothing is in flight (the recovery's slot zeroing, at open)."""
        self._idle = self._loop.create_future()
        self._check_idle()
        await self._idle
        self._idle = None


# -- opening helpers (run in worker threads where they touch the disk) ------------------


def _check_arguments(config: FileTierConfig, block_bytes: int, alignment: int) -> None:
    """Refuse what no root could hold, before anything is created (see :meth:`FileTier.open`)."""
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
            f"bytes_to_use ({format_size(int(config.bytes_to_use))}) holds no slot of "
            f"{format_size(file_bytes)}"
        )


async def _prepare_under_root_lock(
    config: FileTierConfig, layout: KVLayout, block_bytes: int, alignment: int
) -> tuple[Prepared, bool]:
    """The namespace made ready and its share reserved, under the root lock.

    Returns what :func:`~kvtier.tiers.file._namespace.prepare` opened and
    whether this open created the root. The root lock is released on return;
    a refused or cancelled open leaves the disk as it found it.
    """
    root = Path(config.root)
    root_lock, created_root = await _make_and_lock_root(root)
    try:
        # One thread does every disk step of the open under the root lock,
        # and undoes them itself when one fails.
        prepared, cancelled = await _run_to_end(prepare, config, layout, block_bytes, alignment)
        if cancelled:
            # Cancelled while the thread ran: it finished, so undo what it did.
            await _run_to_end(_abandon, prepared)
            raise asyncio.CancelledError
    except BaseException:
        # Refused: a root the open left with nothing but its lock goes back
        # to what it was (no lock file; no root if the open made it).
        release_root(root, root_lock, created_root=created_root)
        raise
    os.close(root_lock)
    return prepared, created_root


async def _make_and_lock_root(root: Path) -> tuple[int, bool]:
    """The root lock, held, of a root made if missing; and whether this call made the root."""
    while True:
        created_root = await asyncio.to_thread(_make_root, root)
        try:
            return await lock_root(root), created_root
        except TierIOError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Removed meanwhile by another process's refused open of the
            # empty root it had made (see release_root): make it again.


async def _open_engine(
    config: FileTierConfig, prepared: Prepared, slot_bytes: int, alignment: int
) -> IOEngine:
    """The tier's own I/O engine: at ``config.queue_depth``, or at the depth measured."""
    depth = config.queue_depth
    if depth == "auto":
        probe = await _measure_depth(config, prepared, slot_bytes, alignment)
        depth = probe.depth if probe is not None else AUTO_DEPTH_FALLBACK
    return await open_io_engine(config.io_engine, queue_depth=depth)


async def _unwind_open(
    root: Path,
    prepared: Prepared,
    created_root: bool,
    tier: FileTier | None,
    engine: IOEngine | None,
) -> None:
    """Put everything back as it was before an open that failed after its disk steps.

    ``tier`` is closed when it was made (with the engine it owns), else the
    descriptors of ``prepared`` and ``engine`` (the open's own, None when the
    caller gave one). Then, under the root lock, the disk is undone.
    """
    if tier is not None:
        await _finish(tier.aclose())
    else:
        _close_prepared(prepared)
        if engine is not None:
            await _finish(engine.aclose())
    await _run_to_end(_undo, root, prepared.undo, created_root)


def _make_root(root: Path) -> bool:
    """Create the root (0700) unless it exists; whether this call created it."""
    try:
        try:
            root.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            # There already, or made by another process opening the root at the
            # same moment (a test-then-create would race it): what it is gets
            # checked when it is opened.
            return False
        os.chmod(root, 0o700)
        return True
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot create the tier root: {exc.strerror}", exc.filename or root
        ) from exc


async def _measure_depth(
    config: FileTierConfig, prepared: Prepared, slot_bytes: int, alignment: int
) -> DepthProbe | None:
    """Time the queue depths on the slot file itself; None where nothing can be measured.

    Requests of one slot at slot offsets, on a never-written run of slots
    (zeros, written once untimed first: a thin-provisioned disk pays for the
    first write of a block) or else on slots holding data (read); see
    :func:`~kvtier.transfer.io_engine.measure_queue_depth`. Nothing is
    measured with buffered I/O (the page cache would be timed), or on a file
    with no run of ``max(64 MiB, 16 slots)`` of one kind. A probe that fails
    is logged and the fallback depth used: the blocks' own I/O reports errors.
    """
    if prepared.fallback is not None:
        return None
    want = max(_PROBE_BYTES, 16 * slot_bytes)
    where = probe_range(prepared.data_fd, prepared.slots, slot_bytes, want)
    if where is None:
        return None
    offset, length, write = where
    # Writes: only the first ``want`` bytes of the run, written once untimed
    # then rewritten at each depth (what the open costs stays bounded on a
    # large file). Reads: up to six times as much, so that each depth reads
    # other slots than the one before (a cache under the disk would time
    # itself, not the device).
    length = min(length, want if write else 6 * want) // slot_bytes * slot_bytes
    engine = await open_io_engine(config.io_engine, queue_depth=max(probe_depths(slot_bytes)))
    depths = probe_depths(slot_bytes, engine.name)
    try:
        probe = await measure_queue_depth(
            engine,
            prepared.data_fd,
            offset=offset,
            length=length,
            request_bytes=slot_bytes,
            write=write,
            alignment=alignment,
            depths=depths,
            warm_up=write,
        )
    except (OSError, KVTierError) as exc:
        log.warning(
            "file tier: cannot measure the queue depth (%s); using %d", exc, AUTO_DEPTH_FALLBACK
        )
        return None
    finally:
        await engine.aclose()
    log.info(
        "file tier: queue depth %d, measured %s %d-byte slots in %.2f s (GB/s by depth: %s)",
        probe.depth,
        "writing" if write else "reading",
        slot_bytes,
        probe.seconds,
        ", ".join(f"{d}: {r:.2f}" for d, r in probe.gbps),
    )
    return probe


def _undo(root: Path, undo: Undo, created_root: bool) -> None:
    undo_under_root_lock(root, undo, created_root=created_root)


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
