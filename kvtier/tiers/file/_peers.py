"""The other partitions of a shared root: what they hold, and reading it, verified.

Several live instances can open one root. Each opens its own *partition* of
a namespace (``<namespace>``, ``<namespace>.1``, ...: a directory with its
slot file, lock and :mod:`index <kvtier.tiers.file._index>`) and is the
only one to write it: eviction stays its owner's decision. :class:`Peers`
is the read side of every other partition of the same namespace:

* it maps each one's ``index`` read-only and, every ``peer_poll_s``, folds
  the entries that changed into one key -> (partition, slot) map, so that a
  lookup is a dict lookup (no I/O, no syscall);
* it reads their blocks with the tier's I/O engine from a read-only
  descriptor of their slot file, into the caller's rows, and verifies each
  (magic, namespace, key, payload checksum) before reporting it loaded.

A block that does not verify was rewritten or evicted by its owner while it
was read (or after the index said so): a miss, counted as ``stale``, never
quarantined (it is not damage, and the slot is not this instance's to
touch) and never wrong bytes. A truly damaged block is quarantined by its
owner, whose own reads find it.

Partitions come and go: every second the root is listed again; a partition
whose ``index`` was replaced (a new owner adopted it) is mapped again, and
one whose directory is gone (reclaimed) is dropped with its descriptors.
A reclaim truncates the slot file before unlinking it, so its space is
freed before then; reads of it meanwhile come back short: a miss, counted
as ``stale``. A partition whose ``namespace.json`` gives another block size
(or namespace) is never mapped (opens refuse to make one; an older kvtier
might have).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import BlockNotFoundError, KVTierError, TierIOError
from kvtier.tiers import block_format
from kvtier.tiers.base import LoadResult
from kvtier.tiers.block_format import HEADER_BYTES, VERIFY_TRANSFER
from kvtier.tiers.file._description import DESCRIPTION_FILE, read_description, split_dir_name
from kvtier.tiers.file._index import INDEX_FILE, IndexReader
from kvtier.tiers.file._root import DATA_FILE
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = ["Peers"]

log = logging.getLogger("kvtier.file_tier")

RESCAN_S = 1.0
"""How often the root is listed for partitions that appeared, were adopted or vanished."""


@dataclass(slots=True, eq=False)
class _Partition:
    name: str
    dir: Path
    fd: int
    """Its slot file, read-only."""
    index: IndexReader
    keys: list[bytes | None]
    """The key each of its slots holds, as last read from its index."""
    reads: int = 0
    """Read calls in flight on ``fd``: it is closed only once none is."""
    dropped: bool = False


@dataclass(slots=True)
class _Read:
    done: Completion[LoadResult]
    order: tuple[bytes, ...]
    left: int
    loaded: list[bytes] = field(default_factory=list)
    missing: dict[bytes, KVTierError] = field(default_factory=dict)


class Peers:
    """Every other live or closed partition of one namespace on a root (loop thread only).

    Parameters
    ----------
    root
        The root directory.
    namespace
        The namespace (its bytes: written into, and checked against, every header).
    own
        This tier's partition directory's name (left out).
    block_bytes
        Payload bytes of every block.
    alignment
        O_DIRECT alignment of buffers; None reads buffered.
    engine
        The I/O engine reads go through.
    """

    def __init__(
        self,
        *,
        root: Path,
        namespace: bytes,
        own: str,
        block_bytes: int,
        alignment: int | None,
        engine: IOEngine,
    ) -> None:
        self._root = root
        self._namespace = namespace
        self._name = namespace.hex()
        self._own = own
        self._block_bytes = block_bytes
        self._file_bytes = HEADER_BYTES + block_bytes
        self._alignment = alignment
        self._engine = engine
        self._parts: dict[str, _Partition] = {}
        self._where: dict[bytes, list[tuple[_Partition, int]]] = {}
        self._changed: dict[bytes, bool] = {}
        """Keys whose presence changed since :meth:`take_changes`, with whether
        they were present before."""
        self._logged: set[str] = set()
        self.hits = 0
        """Blocks read from other partitions, verified."""
        self.stale = 0
        """Reads that found another block, or none, in the slot (a race with its owner)."""
        self.read_errors = 0
        """Reads that failed with an I/O error."""

    # -- what other partitions hold ---------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._where

    @property
    def partitions(self) -> int:
        """Other partitions mapped now."""
        return len(self._parts)

    def keys(self) -> list[bytes]:
        """Every key the other partitions hold now."""
        return list(self._where)

    @property
    def blocks(self) -> int:
        """Distinct keys the other partitions hold, as far as their indexes say."""
        return len(self._where)

    def scan(self) -> None:
        """List the root: map new partitions, remap adopted ones, drop vanished ones."""
        try:
            names = os.listdir(self._root)
        except OSError as exc:
            self._once("list", f"cannot list {self._root}: {exc}")
            return
        seen = set()
        for name in names:
            parsed = split_dir_name(name)
            if parsed is None or parsed[0] != self._name or name == self._own:
                continue
            seen.add(name)
            part = self._parts.get(name)
            if part is not None and not self._replaced(part):
                continue
            if part is not None:
                self._drop(part)
            self._map(name)
        for name in [n for n in self._parts if n not in seen]:
            self._drop(self._parts[name])

    def poll(self) -> None:
        """Fold what every partition's index changed into the key map."""
        for part in self._parts.values():
            for slot, key in part.index.changes():
                old = part.keys[slot]
                if old == key:
                    continue
                if old is not None:
                    self._unplace(old, part, slot)
                part.keys[slot] = key
                if key is not None:
                    self._place(key, part, slot)

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Keys that became readable, and keys that did not stay, since the last call."""
        if not self._changed:
            return [], []
        added, removed = [], []
        where = self._where
        for key, before in self._changed.items():
            now = key in where
            if now and not before:
                added.append(key)
            elif before and not now:
                removed.append(key)
        self._changed.clear()
        return added, removed

    # -- reading -----------------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> Completion[LoadResult]:
        """Read and verify the blocks of ``keys`` (each in :meth:`__contains__`) into ``views``."""
        done: Completion[LoadResult] = Completion()
        read = _Read(done, tuple(keys), len(keys))
        groups: dict[_Partition, list[int]] = {}
        for i, key in enumerate(keys):
            places = self._where.get(key)
            if not places:
                read.missing[key] = BlockNotFoundError(f"block {key.hex()} is in no partition")
                read.left -= 1
                continue
            groups.setdefault(places[-1][0], []).append(i)
        for part, idx in groups.items():
            self._read(read, part, [keys[i] for i in idx], [views[i] for i in idx])
        if not read.left:
            self._finish(read)
        return done

    def _read(
        self, read: _Read, part: _Partition, keys: list[bytes], views: list[memoryview]
    ) -> None:
        count = len(keys)
        pages_map = mmap.mmap(-1, count * HEADER_BYTES)
        memory = memoryview(pages_map)
        pages = [memory[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(count)]
        slots = [next(s for p, s in self._where[k] if p is part) for k in keys]
        offsets = [s * self._file_bytes for s in slots]
        left = [count]
        part.reads += 1

        def reaped(done: list[tuple[int, int, BaseException | None]]) -> None:
            bad = dict(
                block_format.verify_reaped(
                    pages, keys, self._namespace, views, done, self._file_bytes
                )
            )
            for i, _nbytes, exc in done:
                key = keys[i]
                outcome = bad.get(i)
                if outcome is None:
                    self.hits += 1
                    read.loaded.append(key)
                elif outcome == VERIFY_TRANSFER and exc is None:
                    # Short, without an error: the slot file is shorter than
                    # the slot now (its partition was reclaimed, and the file
                    # truncated, or its owner reopened it smaller). A miss.
                    self.stale += 1
                    self._unplace(key, part, slots[i])
                    read.missing[key] = BlockNotFoundError(
                        f"block {key.hex()} is gone from {part.dir.name} slot {slots[i]} "
                        "(its slot file was truncated or removed)"
                    )
                elif outcome == VERIFY_TRANSFER:
                    self.read_errors += 1
                    err = exc if isinstance(exc, KVTierError) else None
                    read.missing[key] = err or TierIOError(
                        _errno.EIO, f"reading slot {slots[i]}: {exc}", part.dir / DATA_FILE
                    )
                else:
                    # Its owner rewrote or cleared the slot meanwhile: a miss,
                    # and the key is forgotten until the index says it again.
                    self.stale += 1
                    self._unplace(key, part, slots[i])
                    read.missing[key] = BlockNotFoundError(
                        f"block {key.hex()} changed in {part.dir.name} slot {slots[i]} "
                        "while it was read (its owner rewrote the slot)"
                    )
            left[0] -= len(done)
            read.left -= len(done)
            if not left[0]:
                for p in pages:
                    p.release()
                memory.release()
                with contextlib.suppress(BufferError):
                    pages_map.close()
                part.reads -= 1
                if part.dropped and not part.reads:
                    self._release(part)
            if not read.left:
                self._finish(read)

        try:
            self._engine.submit_many(
                True,
                part.fd,
                [[page, view] for page, view in zip(pages, views, strict=True)],
                offsets,
                reaped,
                alignment=self._alignment or 1,
            )
        except KVTierError as exc:
            reaped([(i, 0, exc) for i in range(count)])

    def _finish(self, read: _Read) -> None:
        ok = set(read.loaded)
        loaded = tuple(k for k in read.order if k in ok)
        read.done.set_result(LoadResult(loaded=loaded, missing=read.missing))

    # -- inside --------------------------------------------------------------------------

    def _map(self, name: str) -> None:
        path = self._root / name
        if not self._agrees(name, path):
            return
        try:
            index = IndexReader(path / INDEX_FILE)
        except FileNotFoundError:
            return  # being created: the next scan finds it
        except (OSError, ValueError) as exc:
            self._once(name, f"cannot map the index of partition {path}: {exc}")
            return
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        if self._alignment is not None:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path / DATA_FILE, flags)
        except OSError as exc:
            index.close()
            if exc.errno != _errno.ENOENT:
                self._once(name, f"cannot open the slot file of partition {path}: {exc}")
            return
        part = _Partition(name, path, fd, index, [None] * index.slots)
        self._parts[name] = part

    def _agrees(self, name: str, path: Path) -> bool:
        """Whether the partition's ``namespace.json`` has this tier's block size and namespace.

        One that does not (written by a kvtier that did not check at open)
        is never mapped: its slots are elsewhere than this tier reads, and
        its keys must not count in lookups that every load would miss.
        """
        try:
            desc = read_description(path / DESCRIPTION_FILE)
        except TierIOError as exc:
            self._once(name, f"partition {path} is not read: {exc}")
            return False
        if desc is None:
            return False  # being created: the next listing finds it
        if desc.block_bytes != self._block_bytes or desc.namespace != self._name:
            self._once(
                name,
                f"partition {path} is not read: it holds blocks of {desc.block_bytes} bytes "
                f"for namespace {desc.namespace}, this tier {self._block_bytes}-byte blocks",
            )
            return False
        return True

    def _replaced(self, part: _Partition) -> bool:
        """Whether the partition's index is not the file mapped (a new owner replaced it)."""
        try:
            st = os.stat(part.dir / INDEX_FILE, follow_symlinks=False)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != part.index.inode

    def _drop(self, part: _Partition) -> None:
        for slot, key in enumerate(part.keys):
            if key is not None:
                self._unplace(key, part, slot)
        del self._parts[part.name]
        part.dropped = True
        if not part.reads:
            # (With reads in flight the descriptor stays open until the last
            # ends: closed now, its number could name another file meanwhile.)
            self._release(part)

    def _release(self, part: _Partition) -> None:
        part.index.close()
        os.close(part.fd)

    def _place(self, key: bytes, part: _Partition, slot: int) -> None:
        places = self._where.get(key)
        if places is None:
            self._changed.setdefault(key, False)
            self._where[key] = [(part, slot)]
        else:
            places.append((part, slot))

    def _unplace(self, key: bytes, part: _Partition, slot: int) -> None:
        places = self._where.get(key)
        if places is None:
            return
        with contextlib.suppress(ValueError):
            places.remove((part, slot))
        if not places:
            self._changed.setdefault(key, True)
            del self._where[key]

    def _once(self, what: str, message: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("file tier: %s", message)

    def close(self) -> None:
        """Drop every partition (their descriptors and mappings)."""
        for part in list(self._parts.values()):
            self._drop(part)
        self._changed.clear()
