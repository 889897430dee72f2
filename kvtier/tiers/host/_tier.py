"""Private: :class:`HostTier`, one instance's view of the host segment.

The tier keeps the public face and the paths that move a block: checking
what it is given, writing a row, choosing the row a load reads and counting
the outcome. Its collaborators, each an object it owns, keep the rest:

* ``_membership``: joining the segment (slot, epoch, janitor), its mutex, leaving;
* ``_keymap``: which rows hold which key, over every instance's rows;
* ``_own_rows``: the rows this instance owns, and which of them a store takes;
* ``_leases``: copying a row out under a lease, and which rows readers lease;
* ``_statistics``: :class:`HostTierStatistics` and the counts behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from types import TracebackType

from kvtier.errors import ClosedError, InvalidArgumentError
from kvtier.keys import KEY_BYTES
from kvtier.tiers import block_format
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.host._keymap import KeyMap
from kvtier.tiers.host._layout import SHM_DIR, Geometry
from kvtier.tiers.host._leases import Leases
from kvtier.tiers.host._membership import Membership
from kvtier.tiers.host._own_rows import OwnRows
from kvtier.tiers.host._statistics import Counters, HostTierStatistics, collect

__all__ = ["HostTier"]


class HostTier:
    """One serving instance's hold on the host tier of a namespace (one thread).

    Use :meth:`open`; see ``docs/host-tier.md``. In a chain it is the first
    tier below the CPU tier (:class:`~kvtier.tiers.host.ChainedHostTier`).
    """

    def __init__(self, member: Membership, ttl_s: float) -> None:
        self._member = member
        # The membership's fixed parts as the tier's own attributes: the store and
        # load paths read them per block, without a hop through it.
        self._seg = member.seg
        self._table = member.table
        self._g = member.seg.geometry
        self._slot = member.slot
        self._epoch = member.epoch
        self._closed = False
        self._hook: Callable[[str], None] | None = None
        self._keys = KeyMap(member.table, self._g.rows)
        # The key map's table of keys (never rebound by it), for the same reason.
        self._where = self._keys.where
        self._leases = Leases(member, ttl_s)
        self._counts = Counters()
        self._rows = OwnRows(member, self._keys, self._leases, self._counts)
        # Its blocks' order, read and bumped per block on the store and load paths.
        self._lru = self._rows.lru

    @property
    def hook(self) -> Callable[[str], None] | None:
        """For tests: called with ``"store"`` between the two halves of a row's payload
        being written, and with ``"load"`` between the two halves of a copy out."""
        return self._hook

    @hook.setter
    def hook(self, hook: Callable[[str], None] | None) -> None:
        # Kept in two places so neither path pays a property call per block.
        self._hook = self._leases.hook = hook

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

        def build(member: Membership) -> HostTier:
            tier = cls(member, lease_ttl_s)
            tier._rows.claim(g.quota)
            return tier

        tier = Membership.join(g, directory, join_timeout, orphan_grace_s, build)
        tier.refresh()
        return tier

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
        return self._member.populate(stop, chunk)

    def close(self) -> None:
        """Leave the segment: drop this instance's slot and leases; remove it if last.

        This instance's blocks stay readable by the others (its rows become
        orphans, adopted by the next instance to open). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._member.leave()

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
        self._table.beat(self._slot)
        return self._keys.refresh()

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Keys that came to be held on the host, and keys no longer held, since the
        last call (as :meth:`refresh` and this instance's own stores and evictions
        found them): ``(added, removed)``."""
        return self._keys.take_changes()

    def take_evicted(self) -> list[bytes]:
        """Keys this instance's stores evicted from its rows since the last call."""
        return self._rows.take_evicted()

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks of this instance's rows used, as a load would (others' are theirs)."""
        lru = self._lru
        for key in keys:
            if key in lru:
                lru.move_to_end(key)

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
                self._counts.duplicates_skipped += 1
            else:
                batch.add(key)
                todo.append(i)
        rows = self._rows.take(len(todo), keep)
        self._counts.stores_without_room += len(todo) - len(rows)
        for i, (row, seq) in zip(todo, rows, strict=False):
            self._write(row, seq, keys[i], views[i])
            out[i] = True
        return out

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
        if self._hook is not None:
            self._hook("store")
        m[p + half : p + n] = payload[half:]
        page = memoryview(m)[o : o + HEADER_BYTES]
        try:
            block_format.seal_header(page, key, self._g.namespace, n, summed, int(time.time()))
        finally:
            page.release()
        t.set_key(row, key)
        t.words[t.seq_word(row)] = seq + 1
        self._keys.stored(row, key, seq + 1)
        self._lru[key] = row
        self._counts.stores += 1

    def remove(self, key: bytes) -> bool:
        """Evict ``key`` from this instance's rows (others' rows are theirs); True if held."""
        self._check_open()
        return self._rows.drop(key)

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
            self._counts.misses += 1
            return False
        own_row = self._lru.get(key)
        row = own_row if own_row is not None else rows[0]
        own = own_row is not None
        ok = self._leases.copy(row, key, into, lease=not own)
        if own:
            if ok:
                self._counts.own_hits += 1
                self._lru.move_to_end(key)
            else:  # damaged in memory (nobody else writes it): drop it
                self.remove(key)
                self._counts.misses += 1
                self._counts.integrity_failures += 1
            return ok
        if ok:
            self._counts.peer_hits += 1
        else:
            self._counts.stale_peer_reads += 1
        return ok

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
        with self._member.mutex():
            return len(self._table.sweep(self._seg.fd, self._slot))

    def adopt(self) -> int:
        """Take over rows of instances that closed or died, up to this instance's share.

        Opening does this already; an instance that wants the rows of one that
        died after it opened calls it. Returns the rows taken.
        """
        self._check_open()
        with self._member.mutex():
            self._table.sweep(self._seg.fd, self._slot)
            want = self._g.quota - self._table.owned(self._slot, self._epoch)
            taken = self._rows.claim(want) if want > 0 else 0
        self.refresh()
        return taken

    def statistics(self) -> HostTierStatistics:
        """This instance's figures and the segment's (a syscall per live slot)."""
        self._check_open()
        return collect(self._member, self._leases, self._counts, len(self._where), len(self._lru))
