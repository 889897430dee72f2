"""The slot file ``blocks.dat`` of one open namespace: where each block lives, and clearing slots.

Slot ``i`` is ``4096 + block_bytes`` bytes at ``i * (4096 + block_bytes)``: a
header page (:mod:`kvtier.tiers.block_format`), then the payload; a zero header is
a free slot. :class:`SlotFile` holds the open descriptors and the geometry,
the fixed mapping from the manager's slot numbers to the file's, and the one
write that is not a block: zeroing a slot's header when its block is gone
(removed, failed, evicted while read), ordered before the slot's next write.

Separate from the I/O pipeline (:mod:`kvtier.tiers.file._pipeline`), which moves
blocks through these slots, and from the recovery scan
(:mod:`kvtier.tiers.file._recovery`), which reads them once at open and sets the
mapping: both ask this module where a block is and what a slot holds.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import logging
import mmap
import os
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

from kvtier.manager import ResidencyManager
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file._index import SlotIndex
from kvtier.tiers.file._root import DATA_FILE
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = ["SlotFile", "data_runs", "probe_range"]

log = logging.getLogger("kvtier.file_tier")


class SlotFile:
    """``blocks.dat``: descriptors, slot geometry, the slot mapping, and clearing slots.

    Parameters
    ----------
    ns_dir, ns_fd, data_fd, lock_fd
        The namespace directory, its descriptor, the slot file's and the lock
        file's (flock'ed); all closed by :meth:`close`.
    block_bytes
        Payload bytes of every slot.
    alignment
        O_DIRECT alignment of buffers, offsets and lengths.
    direct_fallback
        Why the slot file uses buffered I/O, or None when it uses O_DIRECT.
    engine
        The I/O engine that zeroes headers.
    manager
        The residency of the slots (one manager slot per file slot).
    on_settled
        Called on the loop after a slot is cleared, so that the tier can tell
        whether anything is still in flight.
    """

    def __init__(
        self,
        *,
        ns_dir: Path,
        ns_fd: int,
        data_fd: int,
        lock_fd: int,
        block_bytes: int,
        alignment: int,
        direct_fallback: str | None,
        engine: IOEngine,
        manager: ResidencyManager,
        on_settled: Callable[[], None],
    ) -> None:
        self.dir = ns_dir
        """The namespace directory."""
        self.path = str(ns_dir / DATA_FILE)
        """The slot file's path, named by errors."""
        self.fd = data_fd
        self._ns_fd = ns_fd
        self._lock_fd = lock_fd
        self.block_bytes = block_bytes
        self.file_bytes = HEADER_BYTES + block_bytes
        """Bytes per slot (header + payload)."""
        self.slots = manager.capacity
        self.direct = direct_fallback is None
        self.direct_fallback = direct_fallback
        self.io_alignment = alignment if self.direct else 1
        self.file_slot = array("q", range(self.slots))
        """The file slot of each manager slot: a fixed bijection, set when the
        blocks found at open are handed to the manager (which picks its own
        slot numbers). An array: 8 bytes a slot, where a list of ints costs
        about 36."""
        self._engine = engine
        self._manager = manager
        self._on_settled = on_settled
        self._zero_page = mmap.mmap(-1, HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._zeroing: dict[int, list[Callable[[], None]]] = {}
        """File slots whose header is being zeroed, with the writes waiting for it."""
        self._zero_when_free: dict[bytes, int] = {}
        """Forgotten blocks still read by a load: their slot is zeroed after the last."""
        self.index = SlotIndex(ns_dir, self.slots)
        """The keys of the slots, published for the other instances sharing the root."""

    @property
    def clearing(self) -> bool:
        """True while a slot's header is being zeroed."""
        return bool(self._zeroing)

    def slot_of(self, key: bytes) -> int | None:
        """The file slot holding ``key`` (ready or being written), or None."""
        mslot = self._manager.slot_of(key)
        return None if mslot is None else self.file_slot[mslot]

    def after_clearing(self, slot: int, then: Callable[[], None]) -> bool:
        """Call ``then`` once ``slot``'s header is zeroed; False (no call) if it is not cleared now.

        A write started now could land before the zeros, and the zeros would
        erase it.
        """
        waiting = self._zeroing.get(slot)
        if waiting is None:
            return False
        waiting.append(then)
        return True

    def forget(self, keys: list[bytes]) -> None:
        """Drop ready blocks (bad or unwanted) and zero their slots once no load reads them."""
        slots = {k: self.slot_of(k) for k in keys}
        self._manager.remove(keys)
        for key, slot in slots.items():
            if slot is None:
                continue  # not resident: nothing on disk is ours to clear
            if key in self._manager:
                self._zero_when_free[key] = slot  # a load still reads it
            else:
                self.zero(slot)

    def released(self, key: bytes) -> None:
        """A block op on ``key`` ended: zero its slot if it was forgotten while read."""
        if self._zero_when_free and key not in self._manager:
            slot = self._zero_when_free.pop(key, None)
            if slot is not None:
                self.zero(slot)

    def released_many(self, keys: list[bytes]) -> None:
        """:meth:`released` of each of ``keys`` (nothing to do, most of the time)."""
        if self._zero_when_free:
            for key in keys:
                self.released(key)

    def zero(self, slot: int) -> None:
        """Overwrite a slot's header with zeros (a free slot), ordered before its next write."""
        if slot in self._zeroing:
            return
        self.index.withdraw(slot)
        self._zeroing[slot] = []
        try:
            done = self._engine.writev(
                self.fd,
                [memoryview(self._zero_page)],
                slot * self.file_bytes,
                alignment=self.io_alignment,
            )
        except Exception as exc:
            self._zeroed(slot, exc)
            return
        done.add_done_callback(lambda c: self._zeroed(slot, _short_or_error(c, HEADER_BYTES)))

    def _zeroed(self, slot: int, exc: BaseException | None) -> None:
        if exc is not None:
            # The block stays forgotten; if it comes back after a restart, its
            # checksum still decides whether it is served.
            log.error("file tier: cannot clear slot %d of %s: %s", slot, self.path, exc)
        for then in self._zeroing.pop(slot, []):
            then()
        self._on_settled()

    def close(self) -> None:
        """Release the zero page and close the descriptors (the flock goes with the lock's)."""
        self.index.close()
        with contextlib.suppress(BufferError):
            self._zero_page.close()
        with contextlib.suppress(OSError):
            # The lock file's mtime is the namespace's last use: the root's
            # accounting reclaims the least recently used first.
            os.utime(self._lock_fd)
        for fd in (self.fd, self._ns_fd, self._lock_fd):
            # Closing the lock descriptor releases the flock.
            os.close(fd)


def _short_or_error(done: Completion[int], want: int) -> BaseException | None:
    """The request's error, an error for a short transfer, or None."""
    exc = done.exception()
    if exc is None and done.result() != want:
        exc = OSError(_errno.EIO, f"short write: {done.result()} of {want} bytes")
    return exc


def data_runs(fd: int, end: int) -> Iterator[tuple[int, int]]:
    """The runs ``[start, stop)`` of ``[0, end)`` that ``SEEK_DATA`` reports, in order.

    Ranges never written since the file was reserved (holes, and unwritten
    extents) are not data: they read back as zeros.

    Raises
    ------
    OSError
        Where the filesystem cannot say (``EINVAL``, ``EOPNOTSUPP``), or the
        call fails.
    """
    offset = 0
    while offset < end:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == _errno.ENXIO:
                return  # no data past offset
            raise
        if start >= end:
            return
        stop = min(os.lseek(fd, start, os.SEEK_HOLE), end)
        yield start, stop
        offset = max(stop, start + 1)


def probe_range(fd: int, slots: int, slot_bytes: int, want: int) -> tuple[int, int, bool] | None:
    """Whole slots of the slot file where a queue-depth probe may run: ``(offset, length, write)``.

    A never-written run (a hole, or reserved and unwritten: it reads as
    zeros, so zeros written there change nothing a reader or the recovery
    sees, even when a crash tears them) is taken for a write probe first,
    since it also spares those slots the device's first-write cost; else a
    run holding data, for a read probe, which changes nothing. None when
    neither run has ``want`` bytes of whole slots, or ``SEEK_DATA`` is
    unsupported. Called before the tier takes writes, under the namespace
    lock: nothing else writes the file meanwhile.
    """
    end = slots * slot_bytes
    try:
        data = list(data_runs(fd, end))
    except OSError:
        return None
    edges = [0, *(x for run in data for x in run), end]
    holes = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True) if b > a]
    for runs, write in ((holes, True), (data, False)):
        for start, stop in runs:
            first = -(-start // slot_bytes)  # whole slots inside the run
            length = (stop // slot_bytes - first) * slot_bytes
            if length >= want:
                return first * slot_bytes, length, write
    return None
