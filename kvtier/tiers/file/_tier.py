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

* :mod:`kvtier.tiers.file._opening`: the steps of an open before the tier
  exists (the root locked, the namespace prepared, the engine opened at a
  measured depth) and their undoing when the open fails;
* :mod:`kvtier.tiers.file._parts`: the parts below wired together, with what
  concerns them all (whether anything is in flight, registered memory, release);
* :mod:`kvtier.tiers.file._slots`: the slot file (descriptors, geometry, the
  manager-to-file slot mapping, zeroing slots);
* :mod:`kvtier.tiers.file._recovery`: the scan of the slot headers at open;
* :mod:`kvtier.tiers.file._pipeline`: stores and loads of blocks through the I/O
  engine (header pages, verification, fsync batching, counters);
* :mod:`kvtier.tiers.file._sharing`: lookups, loads and ``watch`` listeners over
  other instances' partitions of a shared root (:mod:`kvtier.tiers.file._peers`);
* :mod:`kvtier.tiers.file._buffers`: the checks of a call's buffers, and their
  pieces for registering with the engine;
* :mod:`kvtier.tiers.file._quarantine`: bounded copies of blocks that failed;
* :mod:`kvtier.tiers.file._worker`: the tier's one thread (checksums, copies);
* :mod:`kvtier.tiers.file._statistics`: the tier's record, gathered from the parts;
* :mod:`kvtier.tiers.file._root` (and the modules it lists: sizing, the root lock,
  the budget, deleting), :mod:`kvtier.tiers.file._namespace`,
  :mod:`kvtier.tiers.file._description`, :mod:`kvtier.tiers.block_format`: the root and
  its budget, the disk steps of an open, ``namespace.json``, the block header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.config import FileTierConfig
from kvtier.errors import BusyError, ClosedError, InvalidArgumentError
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.manager import ManagerEvent
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._buffers import check_buffers
from kvtier.tiers.file._description import LAYOUT_KIND, TIER_FORMAT_VERSION
from kvtier.tiers.file._opening import Opened, open_namespace
from kvtier.tiers.file._parts import Parts
from kvtier.tiers.file._sizing import data_cost, metadata_estimate
from kvtier.tiers.file._statistics import FileTierStatistics, gather
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = [
    "LAYOUT_KIND",
    "TIER_FORMAT_VERSION",
    "FileTier",
    "FileTierStatistics",
    "LoadResult",
    "StoreResult",
]


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

    def __init__(self, config: FileTierConfig, layout: KVLayout, opened: Opened) -> None:
        self._closed = False
        self._parts = parts = Parts(config, layout, opened)
        # The parts the calls go to, by name: one attribute read per call.
        self._manager, self._slots, self._pipeline = parts.manager, parts.slots, parts.pipeline
        self._recovery, self._peers, self._sharing = parts.recovery, parts.peers, parts.sharing

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
        opened = await open_namespace(
            config,
            layout,
            block_bytes=block_bytes,
            alignment=alignment,
            io_engine=io_engine,
            enable_events=enable_events,
        )
        tier: FileTier | None = None
        try:
            tier = cls(config, layout, opened)
            # Find the blocks of the slot file again: now, or from now on.
            if config.recovery == "background":
                tier._recovery.start(tier._parts.loop)
            else:
                await tier._recovery.run()
        except BaseException:
            # Whatever failed (the parts, the recovery, a cancellation), the
            # disk goes back to what it was before this open.
            await opened.unwind(tier)
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
        return self._sharing.lookup(keys)

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
        self._sharing.watch(listener)

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
        return gather(self._parts)

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
        return self._parts.register_memory(buffers)

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
        return self._sharing.load(keys, views, where)

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
        self._sharing.stop()
        await self._recovery.stop()
        await self._parts.wait_idle()
        if first:
            await self._parts.release()

    async def __aenter__(self) -> FileTier:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- checks -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the file tier is closed")

    def _check_call(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], writable: bool = False
    ) -> list[memoryview]:
        """The call's buffers, checked (see :func:`~kvtier.tiers.file._buffers.check_buffers`)."""
        self._check_open()
        slots = self._slots
        return check_buffers(keys, buffers, slots.block_bytes, slots.io_alignment, writable)
