"""What both sides of the file tier's I/O pipeline share: the records of the blocks in flight.

The pipeline (:mod:`kvtier.tiers.file._pipeline`) starts blocks; its read side
(:mod:`kvtier.tiers.file._pipeline_reads`) and its write side
(:mod:`kvtier.tiers.file._pipeline_writes`) settle them. What they both touch is
here, below the three, so that neither side imports the other nor the pipeline:
the call a block belongs to (:class:`Job`), the records of blocks queued and in
flight, the header pages, the count in flight and the parts both sides use
(:class:`Flight`), each side's busy time (:class:`BusyClock`), and the errors a
request's outcome maps to.

The records keep the shapes the hot path wants: a store keeps one small object
per block (its checksum is computed apart from its write), a load none (its
blocks are positions in lists the engine, the verification and the residency take
as they are; see :class:`Loads`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import IntegrityError, KVTierError, TierIOError
from kvtier.manager import ResidencyManager
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._slots import SlotFile
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = [
    "BusyClock",
    "Flight",
    "HeaderPages",
    "Job",
    "LoadRun",
    "Loads",
    "StoreBlock",
    "StoreRun",
    "internal_error",
    "io_error",
    "transfer_error",
]

log = logging.getLogger("kvtier.file_tier")


@dataclass(slots=True)
class Job:
    """One store or load call: the blocks still running and what they gave."""

    done: Completion[Any]
    remaining: int
    ok: list[bytes] = field(default_factory=list)
    failed: dict[bytes, KVTierError] = field(default_factory=dict)
    skipped: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    order: tuple[bytes, ...] = ()

    def ordered(self) -> tuple[bytes, ...]:
        """The blocks that succeeded, in the order of the call."""
        if len(self.ok) == len(self.order):
            return self.order  # every block succeeded (the common case)
        ok = set(self.ok)
        return tuple(k for k in self.order if k in ok)


@dataclass(slots=True)
class StoreBlock:
    """One block of a store call (a load call's blocks are :class:`Loads`)."""

    key: bytes
    view: memoryview
    job: Job
    slot: int
    """Slot of the file (not the manager's slot number)."""
    page: memoryview | None = None
    """Its header page while its write is in flight."""
    checksum: int = 0
    """XXH3 of the payload, computed off the loop before the write."""
    error: KVTierError | None = None
    """Why the block fails before its I/O (its checksum could not be computed)."""
    syncing: bool = False
    """Written, waiting for an fsync: it holds no I/O slot."""


class StoreRun:
    """Blocks of a store handed to the engine as one batch, and the lists its calls take."""

    __slots__ = ("keys", "ops", "pages", "views")

    def __init__(self, ops: list[StoreBlock], pages: list[memoryview]) -> None:
        self.ops = ops
        self.pages = pages
        """The header pages, one per block."""
        self.keys = [op.key for op in ops]
        self.views = [op.view for op in ops]


class Loads:
    """The blocks of one load call, started in order a run at a time.

    A load keeps no object per block: its blocks are positions in these lists,
    which the engine, the verification and the residency take as they are.
    """

    __slots__ = ("job", "keys", "next", "offsets", "views")

    def __init__(
        self, job: Job, keys: list[bytes], views: list[memoryview], offsets: list[int]
    ) -> None:
        self.job = job
        self.keys = keys
        self.views = views
        self.offsets = offsets
        """Each block's offset in the slot file."""
        self.next = 0
        """The first block not started yet."""


class LoadRun:
    """Blocks of one load call handed to the engine as one batch."""

    __slots__ = ("failed", "job", "keys", "left", "offsets", "pages", "views")

    def __init__(
        self,
        job: Job,
        keys: list[bytes],
        views: list[memoryview],
        offsets: list[int],
        pages: list[memoryview],
    ) -> None:
        self.job = job
        self.keys = keys
        self.views = views
        self.offsets = offsets
        self.pages = pages
        self.left = len(keys)
        """Reads not reaped yet: the sound blocks settle together once it is 0."""
        self.failed: set[int] | None = None
        """Blocks that failed (settled on their own as they were reaped)."""


class HeaderPages:
    """Page-aligned header buffers, one per block in flight (O_DIRECT needs aligned memory)."""

    def __init__(self, count: int) -> None:
        self._map = mmap.mmap(-1, count * HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._views = [self._view[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(count)]
        self._free = self._views[:]

    def take_many(self, count: int) -> list[memoryview]:
        """``count`` free pages (the caller never asks more than are free)."""
        taken = self._free[-count:]
        del self._free[-count:]
        return taken

    @property
    def memory(self) -> mmap.mmap:
        """The mapping of every page (to register with the I/O engine)."""
        return self._map

    def give_many(self, pages: list[memoryview]) -> None:
        self._free.extend(pages)

    def give(self, page: memoryview) -> None:
        self._free.append(page)

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._view.release()
        # A finished request's view may still be alive (a completion's closure):
        # the mapping is then unmapped by the garbage collector once it goes.
        with contextlib.suppress(BufferError):
            self._map.close()


class Flight:
    """What the two sides of the pipeline share: the blocks waiting to start, in
    order, the count in flight, the header pages they take, and the parts they
    are moved through and settled with.

    One object for both sides because they share one bound: a load and a store
    wait behind each other in :attr:`pending`, and each takes room of
    :attr:`active` that the other's settling frees. Plain attributes, not
    methods: a side reads and changes them a batch at a time, with no call for
    it; and the parts both sides use are wired here once, not copied into each.

    Parameters
    ----------
    loop, engine, slots, manager, namespace, on_settled
        The pipeline's own (:class:`~kvtier.tiers.file._pipeline.Pipeline`).
    pages
        One header page per block that may be in flight.
    pump
        Starts what the room in flight allows; called after blocks are queued
        or settled.
    """

    __slots__ = (
        "active",
        "block_bytes",
        "engine",
        "fd",
        "file_bytes",
        "io_alignment",
        "loop",
        "manager",
        "namespace",
        "on_settled",
        "pages",
        "pending",
        "pump",
        "slots",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        engine: IOEngine,
        slots: SlotFile,
        manager: ResidencyManager,
        namespace: bytes,
        pages: HeaderPages,
        pump: Callable[[], None],
        on_settled: Callable[[], None],
    ) -> None:
        self.loop = loop
        self.engine = engine
        self.slots = slots
        self.manager = manager
        self.namespace = namespace
        self.pages = pages
        self.pump = pump
        self.on_settled = on_settled
        # The slot file's geometry, read once: every batch uses it.
        self.block_bytes = slots.block_bytes
        self.file_bytes = slots.file_bytes
        self.io_alignment = slots.io_alignment
        self.fd = slots.fd
        self.pending: collections.deque[StoreBlock | Loads] = collections.deque()
        """Blocks not started yet: stores one by one, a load call's as one entry."""
        self.active = 0
        """Blocks started and not settled (a store waiting for its fsync is not)."""


class BusyClock:
    """Seconds during which one side (reads or writes) had blocks in flight."""

    __slots__ = ("_count", "_seconds", "_since")

    def __init__(self) -> None:
        self._count = 0
        self._since = 0.0
        self._seconds = 0.0

    def start(self, count: int) -> None:
        if not self._count:
            self._since = time.perf_counter()
        self._count += count

    def end(self, count: int) -> None:
        self._count -= count
        if not self._count:
            self._seconds += time.perf_counter() - self._since

    def seconds(self) -> float:
        """Seconds busy up to now."""
        extra = time.perf_counter() - self._since if self._count else 0.0
        return self._seconds + extra


def io_error(exc: BaseException, what: str, path: str) -> TierIOError:
    """A failed request's error as this tier's: its errno (EIO when it has
    none), what the tier was doing, and the slot file's path."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else _errno.EIO
    text = getattr(exc, "strerror", None) or exc
    return TierIOError(code, f"{what}: {text}", path)


def transfer_error(
    store: bool, offset: int, nbytes: int, exc: BaseException | None, file_bytes: int, path: str
) -> KVTierError:
    """The error of a request that failed or moved less than ``file_bytes``."""
    slot = offset // file_bytes
    if exc is not None:
        return io_error(exc, f"{'writing' if store else 'reading'} slot {slot}", path)
    what = "write" if store else "read"
    text = f"short {what} of slot {slot}: {nbytes} of {file_bytes} bytes"
    if store:
        return TierIOError(0, text, path)
    # A short read finds only part of a block: the block is bad, not the disk.
    return IntegrityError(text, path)


def internal_error(exc: Exception, count: int) -> TierIOError:
    """A bug's exception as the error of the ``count`` blocks it failed (never
    left pinned, nor the tier waiting for ever)."""
    log.exception("file tier: %d blocks failed to start", count)
    return TierIOError(_errno.EIO, f"internal error: {exc!r}")
