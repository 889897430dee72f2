"""``index``: which key each slot of a partition holds, published for the other instances.

A root shared by live instances gives each one a *partition* of a namespace
(its own directory, slot file and lock; see :mod:`kvtier.tiers.file._peers`).
Its owner publishes here, one fixed entry per file slot, the key of every
block whose write has completed, and withdraws it before the slot is reused;
the other instances map the file read-only and fold what changed into their
lookups (:class:`IndexReader`), so that a lookup never asks the disk.

The index is a hint, never a proof: a reader verifies every block it reads
(the key and the checksum in its header), so an entry that is stale or torn
costs a miss, never wrong bytes. That is why a plain per-entry sequence
number suffices (no lock between processes, no fsync): the owner makes an
entry's ``seq`` odd, writes the key, makes it even again; a reader takes an
entry only when its ``seq`` was even and did not move while it read the key.

Layout (little-endian)::

    0   magic "KVTIDX01" (8 bytes), slots (u64), entry bytes (u64), zeros to 64
    64  entry of file slot 0: seq (u64), key (16 bytes; zeros: empty), zeros (8)
    96  entry of file slot 1 ...

The file is replaced (a new file renamed over it), never shrunk in place:
a reader's mapping of a shorter file would fault past its end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from kvtier.keys import KEY_BYTES

__all__ = ["ENTRY_BYTES", "INDEX_FILE", "IndexReader", "SlotIndex", "index_bytes"]

INDEX_FILE = "index"
_MAGIC = b"KVTIDX01"
_HEADER = 64
ENTRY_BYTES = 32
"""Bytes of one slot's entry."""
_WORDS = ENTRY_BYTES // 8
_EMPTY = bytes(KEY_BYTES)


def index_bytes(slots: int) -> int:
    """Size of the index of ``slots`` slots."""
    return _HEADER + slots * ENTRY_BYTES


class SlotIndex:
    """The owner's side: publish and withdraw keys, one entry per file slot.

    Parameters
    ----------
    ns_dir
        The partition's directory; the index is created there, replacing
        whatever was there (a previous owner's entries are hints about slots
        whose blocks the recovery finds again, and republishes).
    slots
        File slots of the partition.
    """

    def __init__(self, ns_dir: Path, slots: int) -> None:
        self.slots = slots
        path = ns_dir / INDEX_FILE
        tmp = ns_dir / "tmp" / INDEX_FILE
        size = index_bytes(slots)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, _MAGIC + struct.pack("<QQ", slots, ENTRY_BYTES), 0)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        # Words of the file: seq of slot s is word 8 + 4 s (past the 64-byte header).
        self._words = memoryview(self._map).cast("Q")

    def publish(self, slot: int, key: bytes) -> None:
        """``slot`` now holds ``key``, written whole."""
        w = self._words
        i = 8 + _WORDS * slot
        seq = w[i] | 1
        w[i] = seq  # odd: being changed
        o = _HEADER + ENTRY_BYTES * slot + 8
        self._map[o : o + KEY_BYTES] = key
        w[i] = seq + 1

    def publish_many(self, slots: Iterable[int], keys: Iterable[bytes]) -> None:
        """:meth:`publish` of each pair."""
        for slot, key in zip(slots, keys, strict=True):
            self.publish(slot, key)

    def withdraw(self, slot: int) -> None:
        """``slot`` holds no block any more (about to be rewritten, or cleared)."""
        o = _HEADER + ENTRY_BYTES * slot + 8
        if self._map[o : o + KEY_BYTES] != _EMPTY:
            self.publish(slot, _EMPTY)

    def rebuild(self, held: Mapping[int, bytes]) -> None:
        """Publish exactly ``held`` (file slot -> key): the recovery's findings."""
        m = self._map
        for slot in range(self.slots):
            key = held.get(slot)
            if key is None:
                self.withdraw(slot)
            else:
                o = _HEADER + ENTRY_BYTES * slot + 8
                if m[o : o + KEY_BYTES] != key:  # unchanged entries stay as readers saw them
                    self.publish(slot, key)

    def close(self) -> None:
        """Unmap (the entries stay: the blocks stay readable after this owner)."""
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()


class IndexReader:
    """Another instance's side: map a partition's index and see what changed.

    Parameters
    ----------
    path
        The partition's ``index``.

    Raises
    ------
    OSError
        When it cannot be opened or mapped.
    ValueError
        When it is not an index (a bad magic or entry size, or too short).
    """

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            head = os.pread(fd, 24, 0)
            if len(head) < 24 or head[:8] != _MAGIC:
                raise ValueError(f"{path} is not a kvtier index")
            slots, entry = struct.unpack("<QQ", head[8:24])
            if entry != ENTRY_BYTES or st.st_size < index_bytes(slots):
                raise ValueError(f"{path}: {slots} slots of {entry} bytes in {st.st_size} bytes")
            self.inode = (st.st_dev, st.st_ino)
            self.slots = int(slots)
            self._map = mmap.mmap(fd, index_bytes(self.slots), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        words = np.frombuffer(self._map, dtype="<u8", count=self.slots * _WORDS, offset=_HEADER)
        self._seq = words[::_WORDS]
        self._seen = np.zeros(self.slots, dtype="<u8")

    def changes(self) -> list[tuple[int, bytes | None]]:
        """``(slot, key or None)`` of every entry that changed since the last call.

        An entry being changed right now is left for the next call.
        """
        now = self._seq.copy()
        moved = np.flatnonzero(now != self._seen)
        if not len(moved):
            return []
        out: list[tuple[int, bytes | None]] = []
        m, seq, seen = self._map, self._seq, self._seen
        for s in moved.tolist():
            v = int(now[s])
            if v & 1:
                continue  # being written: next time
            o = _HEADER + ENTRY_BYTES * s + 8
            key = m[o : o + KEY_BYTES]
            if int(seq[s]) != v:
                continue  # moved while read: next time
            seen[s] = v
            out.append((s, None if key == _EMPTY else key))
        return out

    def close(self) -> None:
        """Unmap."""
        del self._seq
        with contextlib.suppress(BufferError):
            self._map.close()
