"""Private: :class:`HostTier`, one instance's view of the host segment, and its statistics."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import numpy.typing as npt

from kvtier.errors import ClosedError, InvalidArgumentError, SharedRegionError
from kvtier.keys import KEY_BYTES
from kvtier.shm import MADV_POPULATE_READ, madvise
from kvtier.tiers import block_format
from kvtier.tiers.block_format import HEADER_BYTES, VERIFY_OK
from kvtier.tiers.host._janitor import ensure_janitor
from kvtier.tiers.host._layout import (
    LEASES_PER_INSTANCE,
    SHM_DIR,
    Geometry,
    Segment,
    acquire_mutex,
    attach,
    release_mutex,
    release_slot,
    unlink_if_last,
)
from kvtier.tiers.host._table import Table, fence

__all__ = ["HostTier", "HostTierStatistics"]

_FIELDS = 128
"""Bytes of a block header a reader copies to verify it (its fields; the rest is padding)."""
_CLOSE_WAIT = 5.0


@dataclass(frozen=True, slots=True)
class HostTierStatistics:
    """One instance's figures, and the segment's as it sees them now."""

    path: str
    """The segment file."""
    rows: int
    """Rows of the segment (the host budget, in rows)."""
    row_bytes: int
    """Payload bytes of a row."""
    instances: int
    """Instance slots of the segment."""
    quota: int
    """Rows one instance may own (``rows // instances``)."""
    slot: int
    """This instance's slot."""
    live_instances: int
    """Instances attached now (this one included)."""
    rows_held: tuple[int, ...]
    """Rows owned by the live instance of each slot (0 for a free or dead slot)."""
    rows_orphaned: int
    """Rows of instances that closed or died, not adopted yet (their blocks stay readable)."""
    rows_free: int
    """Rows nobody owns."""
    blocks: int
    """Distinct keys the host holds, as far as this instance last refreshed."""
    own_blocks: int
    """Blocks in this instance's own rows."""
    stores: int
    """Blocks this instance stored."""
    duplicates_skipped: int
    """Stores skipped because some instance on the host held the key already."""
    stores_without_room: int
    """Stores skipped because every row this instance may use was leased by a reader."""
    own_hits: int
    """Verified loads from this instance's own rows."""
    peer_hits: int
    """Verified loads from other instances' rows."""
    stale_peer_reads: int
    """Loads of a peer's row that found it rewritten, being written, or failing its
    checksum: a miss, never wrong bytes."""
    misses: int
    """Loads of keys no row held as far as this instance knew."""
    rows_writing: int
    """Rows with an odd seq: being written now, or left so by a writer that died (never
    read; the instance that adopts them resets them)."""
    leases_outstanding: int
    """Leases held now by live readers, younger than ``lease_ttl_s``."""
    leases_expired: int
    """Lease entries of dead readers, or older than ``lease_ttl_s``, not dropped yet (no
    owner honours them)."""
    rows_adopted: int
    """Rows this instance took over from instances that closed or died."""
    rows_reset: int
    """Of those, rows whose owner died writing them (reset: they held nothing readable)."""
    evictions: int = 0
    """Blocks of this instance's rows evicted to make room for its stores."""
    integrity_failures: int = 0
    """Loads of this instance's own rows that failed verification (damaged in
    memory): dropped, a miss."""

    # The figures every tier of a chain reports (kvtier.tiers.base.TierStatistics).

    @property
    def block_bytes(self) -> int:
        """Payload bytes per block (a row's)."""
        return self.row_bytes

    @property
    def hits(self) -> int:
        """Verified loads, from this instance's rows and its peers'."""
        return self.own_hits + self.peer_hits

    @property
    def store_failures(self) -> int:
        """Stores that found no row (every row of this instance leased)."""
        return self.stores_without_room

    @property
    def bytes_read(self) -> int:
        """Payload bytes of verified loads."""
        return self.hits * self.row_bytes

    @property
    def bytes_written(self) -> int:
        """Payload bytes of this instance's stores."""
        return self.stores * self.row_bytes

    def metric_figures(self) -> dict[str, int | float | str]:
        """The host tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            "integrity_failures_total": self.integrity_failures,
            "evictions_total": self.evictions,
            "vanished_blocks_total": self.stale_peer_reads,
            "peer_blocks": self.blocks - self.own_blocks,
            "peer_hits_total": self.peer_hits,
            "stale_peer_reads_total": self.stale_peer_reads,
            "leases_outstanding": self.leases_outstanding,
            "rows_held": self.rows_held[self.slot],
            "used_bytes": self.own_blocks * self.row_bytes,
            "capacity_bytes": self.quota * self.row_bytes,
        }


class HostTier:
    """One serving instance's hold on the host tier of a namespace (one thread).

    Use :meth:`open`; see ``docs/host-tier.md``. Not wired into the chain or
    the fronts yet.
    """

    hook: Callable[[str], None] | None
    """For tests: called with ``"store"`` between the two halves of a row's payload
    being written, and with ``"load"`` between the two halves of a copy out."""

    def __init__(self, seg: Segment, table: Table, slot: int, epoch: int, ttl_s: float) -> None:
        self._seg = seg
        self._table = table
        self._g = seg.geometry
        self._slot = slot
        self._epoch = epoch
        self._ttl_ns = int(ttl_s * 1e9)
        self._closed = False
        self.hook = None
        rows = self._g.rows
        self._where: dict[bytes, list[int]] = {}
        self._row_key: list[bytes | None] = [None] * rows
        self._seen: npt.NDArray[np.uint64] = np.zeros(rows, dtype=np.uint64)
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = []
        self._own_rows: set[int] = set()
        self._lease_free = list(range(LEASES_PER_INSTANCE - 1, -1, -1))
        self._scratch = bytearray(HEADER_BYTES)
        self._stores = self._dups = self._no_room = 0
        self._own_hits = self._peer_hits = self._stale = self._misses = 0
        self._adopted = self._reset = self._evictions = self._damaged = 0
        self._evicted: list[bytes] = []
        self._changes: dict[bytes, bool] = {}
        """Keys that came to be held on the host (True) or stopped being so
        (False) since :meth:`take_changes`, as this instance saw them."""

    # -- opening and closing --------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        namespace: bytes,
        row_bytes: int,
        budget_bytes: int,
        instances: int = 1,
        *,
        directory: str = SHM_DIR,
        lease_ttl_s: float = 5.0,
        join_timeout: float = 10.0,
        orphan_grace_s: float | None = None,
    ) -> HostTier:
        """Create the host segment of ``namespace``, or join it, and take a slot in it.

        Parameters
        ----------
        namespace
            The layout's namespace (16 bytes); the segment is named after it.
        row_bytes
            Payload bytes of one row (one block).
        budget_bytes
            The host budget: every instance on the host passes the same one.
            Rows of ``4096 + row_bytes`` bytes (rounded to pages) fill it.
        instances
            Instance slots: the most instances attached at once; each may own
            an equal share, ``rows // instances``.
        directory
            Where the segment lives (a tmpfs).
        lease_ttl_s
            A reader's lease older than this is not honoured by the row's owner
            (the reader's checks after its copy still make a reuse a miss).
        join_timeout
            Seconds to wait for the segment's mutex.
        orphan_grace_s
            Make sure a janitor process watches the segment and removes it once no
            instance has held it for this long (instances all killed); ``None``:
            none is started (the last close, an adopting instance or ``kvtier gc
            --shm`` removes it).

        Raises
        ------
        NamespaceMismatchError
            A live segment of this namespace has another row size.
        ConfigurationError
            A live segment has another budget or instance count (both named).
        CapacityError
            Every slot is held by a live instance, the budget gives an instance
            no row, or the machine lacks the memory.
        SharedRegionError
            The segment's mutex stayed held past ``join_timeout``.
        InvalidArgumentError
            A namespace that is not 16 bytes, or sizes out of range.
        """
        if lease_ttl_s < 0:
            raise InvalidArgumentError(f"lease_ttl_s must be >= 0, got {lease_ttl_s}")
        g = Geometry(bytes(namespace), int(row_bytes), int(budget_bytes), int(instances))

        def register(seg: Segment) -> HostTier:
            table = Table(seg)
            try:
                slot = table.take_slot(seg.fd)
                table.sweep(seg.fd, slot)
                epoch = table.enter(slot)
                tier = cls(seg, table, slot, epoch, lease_ttl_s)
                tier._claim(g.quota)
            except BaseException:
                table.release()
                raise
            return tier

        def undo(tier: HostTier) -> None:
            tier._table.release()

        seg, tier = attach(g, directory, join_timeout, register, undo)
        if orphan_grace_s is not None:
            ensure_janitor(seg.path, seg.fd, orphan_grace_s)
        tier.refresh()
        return tier

    def _claim(self, want: int) -> int:
        """Own up to ``want`` more rows (mutex held); return how many were taken."""
        t = self._table
        blocks, empty, reset, adopted = t.claim(self._slot, self._epoch, want)
        w = t.words
        dated = []
        for r in blocks:
            o = t.row_offset(r) + 60  # the block header's "stored at"
            dated.append((int.from_bytes(self._seg.map[o : o + 4], "little"), r))
        for _, r in sorted(dated):
            key = t.key_at(r)
            if key in self._lru:  # two rows of one key (two stores raced): keep one
                t.reset_row(r)
                empty.append(r)
            else:
                self._lru[key] = r
        for r in empty:
            self._free.append(r)
            self._seen[r] = w[t.seq_word(r)]
            self._forget(r)
        self._own_rows.update(blocks)
        self._own_rows.update(empty)
        self._adopted += adopted
        self._reset += len(reset)
        return len(blocks) + len(empty)

    def prefault(self, stop: Callable[[], bool] = lambda: False, chunk: int = 64 << 20) -> int:
        """Enter every page of the segment in this process's page tables now.

        A process's first read of a page that another process wrote takes a
        minor page fault; on reads of peers' rows that was a fifth of a load's
        time (``benchmarks/host_tier.py``: a peer hit 1.22x an own hit before,
        about 1.0x after). This asks the kernel to map them all ahead
        (``MADV_POPULATE_READ``, Linux 5.14+), a ``chunk`` at a time, until
        done or ``stop()`` is true; meant for a thread of its own (the call
        runs without the GIL). The price is page tables: 2 MiB a GiB of
        segment. Returns the bytes populated (0 where the kernel refuses).
        """
        self._check_open()
        m = self._seg.map
        size = len(m)
        anchor = ctypes.c_char.from_buffer(m)  # the map's address; close waits for us
        try:
            base = ctypes.addressof(anchor)
            done = 0
            while done < size and not stop():
                n = min(chunk, size - done)
                if madvise(base + done, n, MADV_POPULATE_READ):
                    break
                done += n
            return done
        finally:
            del anchor

    def close(self) -> None:
        """Leave the segment: drop this instance's slot and leases; remove it if last.

        This instance's blocks stay readable by the others (its rows become
        orphans, adopted by the next instance to open). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        seg, t = self._seg, self._table
        try:
            if acquire_mutex(seg.fd, time.monotonic() + _CLOSE_WAIT):
                try:
                    t.leave(self._slot)
                    release_slot(seg.fd, self._slot)
                    unlink_if_last(seg)
                finally:
                    release_mutex(seg.fd)
            # Without the mutex (an instance stuck holding it) the name stays; closing
            # the descriptor drops this slot's lock, and the next joiner or reap sees it.
        finally:
            t.release()
            with contextlib.suppress(BufferError):
                seg.map.close()
            os.close(seg.fd)

    def __enter__(self) -> HostTier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the host tier is closed")

    # -- what the host holds ------------------------------------------------------------------

    @property
    def path(self) -> str:
        """The segment file."""
        return self._seg.path

    @property
    def slot(self) -> int:
        """This instance's slot."""
        return self._slot

    @property
    def geometry(self) -> Geometry:
        """The segment's geometry."""
        return self._g

    def __contains__(self, key: object) -> bool:
        """Whether some instance's row held ``key`` at the last :meth:`refresh` (no syscall)."""
        return key in self._where

    def held_anywhere(self, key: bytes) -> bool:
        """Whether any instance on the host holds ``key`` now (a :meth:`refresh` first)."""
        self.refresh()
        return key in self._where

    def held_keys(self) -> list[bytes]:
        """Every key the host held at the last :meth:`refresh`."""
        return list(self._where)

    def payload_offset(self, key: bytes) -> int | None:
        """Where ``key``'s payload starts in the segment file, if this instance's row
        holds it (for tools and tests that look at the file)."""
        row = self._lru.get(key)
        return None if row is None else self._table.row_offset(row) + HEADER_BYTES

    def owns(self, key: bytes) -> bool:
        """Whether ``key``'s block is in one of this instance's rows."""
        return key in self._lru

    def own_keys(self) -> list[bytes]:
        """Keys of the blocks in this instance's rows, least recently used first."""
        return list(self._lru)

    def refresh(self) -> int:
        """Fold what every instance changed in the row table into the key map.

        One vectorized compare of the rows' seq words (no syscall, no lock);
        returns the rows folded.
        """
        self._check_open()
        t = self._table
        t.beat(self._slot)
        changed = t.changes(self._seen)
        for row, key, _settled in changed:
            old = self._row_key[row]
            if old == key:
                continue
            if old is not None:
                self._unplace(old, row)
            self._row_key[row] = key
            if key is not None:
                self._place(key, row, first=False)
        return len(changed)

    def _place(self, key: bytes, row: int, *, first: bool) -> None:
        rows = self._where.get(key)
        if rows is None:
            self._where[key] = [row]
            self._changes[key] = True
        elif first:
            rows.insert(0, row)
        else:
            rows.append(row)

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Keys that came to be held on the host, and keys no longer held, since the
        last call (as :meth:`refresh` and this instance's own stores and evictions
        found them): ``(added, removed)``."""
        changes, self._changes = self._changes, {}
        added = [k for k, there in changes.items() if there and k in self._where]
        removed = [k for k, there in changes.items() if not there and k not in self._where]
        return added, removed

    def take_evicted(self) -> list[bytes]:
        """Keys this instance's stores evicted from its rows since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks of this instance's rows used, as a load would (others' are theirs)."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

    def _unplace(self, key: bytes, row: int) -> None:
        rows = self._where.get(key)
        if rows is None:
            return
        with contextlib.suppress(ValueError):
            rows.remove(row)
        if not rows:
            del self._where[key]
            self._changes[key] = False

    def _forget(self, row: int) -> None:
        old = self._row_key[row]
        if old is not None:
            self._unplace(old, row)
            self._row_key[row] = None

    # -- storing --------------------------------------------------------------------------------

    def store(self, key: bytes, payload: memoryview) -> bool:
        """:meth:`store_many` of one block."""
        return self.store_many([key], [payload])[0]

    def store_many(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        *,
        keep: Container[bytes] = frozenset(),
    ) -> list[bool]:
        """Store each block in a row of this instance's; True for each one stored.

        A key that any instance on the host holds is skipped (False), and so is
        one for which no row is free or reusable (every row of this instance
        is leased by a reader, or holds a block of ``keep``): the host keeps
        one copy of a block. A reused row's old block is evicted (least
        recently stored or loaded first), never one of ``keep``.

        Parameters
        ----------
        keep
            Blocks of this instance's rows that must stay: loads of them are
            queued behind this store (its caller promised them to a reader
            before this store ran), so evicting one would turn a hit the
            caller counted on into a miss.

        Raises
        ------
        InvalidArgumentError
            A key that is not 16 bytes, a payload that is not ``row_bytes``.
        ClosedError
            After :meth:`close`.
        """
        self._check_open()
        if len(keys) != len(payloads):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(payloads)} payloads")
        views = []
        for key, payload in zip(keys, payloads, strict=True):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise InvalidArgumentError(f"a key is {KEY_BYTES} bytes, got {key!r}")
            if not any(key):  # the row table's mark of a row that holds nothing
                raise InvalidArgumentError("the all-zero key cannot be stored in the host tier")
            mv = memoryview(payload).cast("B")
            if mv.nbytes != self._g.row_bytes:
                raise InvalidArgumentError(
                    f"a payload of {mv.nbytes} bytes; rows of this segment hold {self._g.row_bytes}"
                )
            views.append(mv)
        self.refresh()
        out = [False] * len(keys)
        todo: list[int] = []
        batch: set[bytes] = set()
        for i, key in enumerate(keys):
            if key in self._where or key in batch:
                self._dups += 1
            else:
                batch.add(key)
                todo.append(i)
        rows = self._take_rows(len(todo), keep)
        self._no_room += len(todo) - len(rows)
        for i, (row, seq) in zip(todo, rows, strict=False):
            self._write(row, seq, keys[i], views[i])
            out[i] = True
        return out

    def _take_rows(self, n: int, keep: Container[bytes] = frozenset()) -> list[tuple[int, int]]:
        """``n`` rows (or fewer) made odd for writing, none leased nor holding a block
        of ``keep``: ``(row, odd seq)``."""
        t, w = self._table, self._table.words
        row_key = self._row_key
        got: list[tuple[int, int]] = []
        tried: set[int] = set()
        while len(got) < n:
            cands: dict[int, int] = {}
            kept: list[int] = []
            while len(got) + len(cands) < n and self._free:
                r = self._free.pop()
                if r in tried:
                    kept.append(r)
                else:
                    cands[r] = int(w[t.seq_word(r)])
            self._free.extend(kept)
            victims = iter(self._lru.values())  # oldest first; not changed until gathered
            while len(got) + len(cands) < n:
                r = next(victims, -1)
                if r < 0:
                    break
                if r not in tried and (not keep or row_key[r] not in keep):
                    cands[r] = int(w[t.seq_word(r)])
            if not cands:
                break
            for r, seq in cands.items():
                w[t.seq_word(r)] = seq | 1
            fence()
            leased = t.leased(self._seg.fd, self._slot, cands, self._ttl_ns)
            for r, seq in cands.items():
                tried.add(r)
                key_held = self._row_key[r]
                if r in leased:
                    w[t.seq_word(r)] = seq  # nothing changed: its readers' checks pass
                    if key_held is not None and key_held in self._lru:
                        self._lru.move_to_end(key_held)
                    else:
                        self._free.insert(0, r)
                    continue
                if key_held is not None:
                    if self._lru.pop(key_held, None) is not None:
                        self._evicted.append(key_held)
                        self._evictions += 1
                    self._forget(r)
                got.append((r, seq | 1))
            if len(tried) >= len(self._own_rows):
                break
        return got

    def _write(self, row: int, seq: int, key: bytes, payload: memoryview) -> None:
        t, m = self._table, self._seg.map
        o = t.row_offset(row)
        p = o + HEADER_BYTES
        n = self._g.row_bytes
        half = n // 2
        # The checksum is taken over the caller's payload, never over the row:
        # the row is shared memory that anything mapping the segment can write
        # while it is being filled, and a sum over it would seal such bytes as
        # valid. Summed from the source, a row that differs from what this
        # instance meant to store fails verification: a miss.
        summed = block_format.checksum(payload)
        m[p : p + half] = payload[:half]
        if self.hook is not None:
            self.hook("store")
        m[p + half : p + n] = payload[half:]
        page = memoryview(m)[o : o + HEADER_BYTES]
        try:
            block_format.seal_header(page, key, self._g.namespace, n, summed, int(time.time()))
        finally:
            page.release()
        t.set_key(row, key)
        t.words[t.seq_word(row)] = seq + 1
        self._seen[row] = seq + 1
        self._row_key[row] = key
        self._place(key, row, first=True)
        self._lru[key] = row
        self._stores += 1

    def remove(self, key: bytes) -> bool:
        """Evict ``key`` from this instance's rows (others' rows are theirs); True if held."""
        self._check_open()
        row = self._lru.pop(key, None)
        if row is None:
            return False
        self._table.reset_row(row)
        self._seen[row] = self._table.words[self._table.seq_word(row)]
        self._forget(row)
        self._free.append(row)
        return True

    # -- loading --------------------------------------------------------------------------------

    def load(self, key: bytes, into: memoryview) -> bool:
        """:meth:`load_many` of one block."""
        return self.load_many([key], [into])[0]

    def load_many(self, keys: Sequence[bytes], intos: Sequence[memoryview]) -> list[bool]:
        """Copy each block held on the host into its buffer, verified; True for each copied.

        A block is read from the row the key map names (this instance's or a
        peer's) under a lease its owner honours, then checked: the row's seq
        did not move during the copy, and the copy's block header, key and
        XXH3 checksum verify. Anything else is a miss (False), and the buffer
        holds no meaningful bytes: never wrong bytes reported as a hit.

        Raises
        ------
        InvalidArgumentError
            A buffer that is not writable or not ``row_bytes``.
        ClosedError
            After :meth:`close`.
        """
        self._check_open()
        if len(keys) != len(intos):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(intos)} buffers")
        out = []
        for key, into in zip(keys, intos, strict=True):
            mv = memoryview(into).cast("B")
            if mv.readonly or mv.nbytes != self._g.row_bytes:
                raise InvalidArgumentError(
                    f"a load needs a writable buffer of {self._g.row_bytes} bytes, got "
                    f"{mv.nbytes} ({'read-only' if mv.readonly else 'writable'})"
                )
            out.append(self._load(key, mv))
        self._table.beat(self._slot)
        return out

    def _load(self, key: bytes, into: memoryview) -> bool:
        rows = self._where.get(key)
        if not rows:
            self._misses += 1
            return False
        own_row = self._lru.get(key)
        row = own_row if own_row is not None else rows[0]
        own = own_row is not None
        ok = self._copy(row, key, into, lease=not own)
        if own:
            if ok:
                self._own_hits += 1
                self._lru.move_to_end(key)
            else:  # damaged in memory (nobody else writes it): drop it
                self.remove(key)
                self._misses += 1
                self._damaged += 1
            return ok
        if ok:
            self._peer_hits += 1
        else:
            self._stale += 1
        return ok

    def _copy(self, row: int, key: bytes, into: memoryview, *, lease: bool) -> bool:
        t, w, m = self._table, self._table.words, self._seg.map
        i = t.seq_word(row)
        s1 = int(w[i])
        if s1 & 1 or t.key_at(row) != key:
            return False
        li = -1
        if lease and self._lease_free:
            li = self._lease_free.pop()
            lw = t.lease_word_of(self._slot, li)
            w[lw + 2] = time.monotonic_ns()
            w[lw + 1] = s1
            w[lw] = row + 1
            fence()
        try:
            if w[i] != s1:
                return False
            o = t.row_offset(row)
            p = o + HEADER_BYTES
            n = self._g.row_bytes
            half = n // 2
            # Through a memoryview: slicing the mmap itself would copy into a
            # new bytes first (measured: 2.8x slower for 1 MiB rows).
            with memoryview(m) as view:
                self._scratch[:_FIELDS] = view[o : o + _FIELDS]
                into[:half] = view[p : p + half]
                if self.hook is not None:
                    self.hook("load")
                into[half:] = view[p + half : p + n]
            if w[i] != s1:
                return False
        finally:
            if li >= 0:
                w[t.lease_word_of(self._slot, li)] = 0
                self._lease_free.append(li)
        code = block_format.verify_block(memoryview(self._scratch), key, self._g.namespace, into)
        return code == VERIFY_OK

    # -- upkeep ---------------------------------------------------------------------------------

    def cleanup(self) -> int:
        """Drop what dead instances left in the tables (their slots, their leases).

        Their rows stay theirs, readable, until an instance adopts them
        (:meth:`adopt`, or any instance that opens). Returns the dead slots found.

        Raises
        ------
        SharedRegionError
            The mutex stayed held past the wait (its holder is stopped or stuck).
        """
        self._check_open()
        with self._mutex():
            return len(self._table.sweep(self._seg.fd, self._slot))

    def adopt(self) -> int:
        """Take over rows of instances that closed or died, up to this instance's share.

        Opening does this already; an instance that wants the rows of one that
        died after it opened calls it. Returns the rows taken.
        """
        self._check_open()
        with self._mutex():
            self._table.sweep(self._seg.fd, self._slot)
            want = self._g.quota - self._table.owned(self._slot, self._epoch)
            taken = self._claim(want) if want > 0 else 0
        self.refresh()
        return taken

    @contextlib.contextmanager
    def _mutex(self) -> Iterator[None]:
        if not acquire_mutex(self._seg.fd, time.monotonic() + _CLOSE_WAIT):
            raise SharedRegionError(
                f"host segment {self._seg.path} stayed locked for {_CLOSE_WAIT} s: the "
                "instance holding it is stopped or stuck"
            )
        try:
            yield
        finally:
            release_mutex(self._seg.fd)

    def statistics(self) -> HostTierStatistics:
        """This instance's figures and the segment's (a syscall per live slot)."""
        self._check_open()
        t, fd = self._table, self._seg.fd
        live = t.live_slots(fd, self._slot)
        held, orphaned, free = t.rows_held(live)
        outstanding, expired = t.lease_counts(fd, self._slot, self._ttl_ns)
        return HostTierStatistics(
            path=self._seg.path,
            rows=self._g.rows,
            row_bytes=self._g.row_bytes,
            instances=self._g.instances,
            quota=self._g.quota,
            slot=self._slot,
            live_instances=sum(live),
            rows_held=held,
            rows_orphaned=orphaned,
            rows_free=free,
            blocks=len(self._where),
            own_blocks=len(self._lru),
            stores=self._stores,
            duplicates_skipped=self._dups,
            stores_without_room=self._no_room,
            own_hits=self._own_hits,
            peer_hits=self._peer_hits,
            stale_peer_reads=self._stale,
            misses=self._misses,
            rows_writing=t.writing(),
            leases_outstanding=outstanding,
            leases_expired=expired,
            rows_adopted=self._adopted,
            rows_reset=self._reset,
            evictions=self._evictions,
            integrity_failures=self._damaged,
        )
