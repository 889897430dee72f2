"""Eviction policies: which ready, unpinned block a full tier gives up first.

A :class:`CachePolicy` works on *slots* (integers in ``[0, capacity)``), in
batches, and reads the manager's per-slot :class:`SlotState` to know which slots
it may take. :class:`LRUPolicy` evicts the least recently used block;
:class:`ARCPolicy` is Megiddo and Modha's Adaptive Replacement Cache, which keeps
blocks used once (T1) apart from blocks used again (T2) and learns from recently
evicted keys (the ghost lists B1 and B2) how much room each deserves, so that
one pass over many new blocks does not flush the blocks in steady use.

How the recency lists stay cheap in pure Python
-----------------------------------------------
A recency list is a *log* of slot numbers in an ``array('I')``, oldest first,
plus a per-slot count of the slot's entries in the log. Using a block appends
its slot; a slot's latest entry is its place in the order, and older entries are
stale: eviction reads the log from the front and skips an entry while the slot
has later ones (its count is still above zero after the read). Appending is one
C-level ``extend`` per call; the log is compacted (duplicates and stale entries
dropped, in C) when it grows past a few times the capacity. That keeps the
order exact while costing 4-12 bytes per block instead of an ``OrderedDict``
node (about 70 bytes with its share of the hash table), and no Python object per
block.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from enum import IntEnum
from itertools import compress

from kvtier.errors import InvalidArgumentError

__all__ = ["ARCPolicy", "CachePolicy", "LRUPolicy", "SlotState"]


class SlotState(IntEnum):
    """What a slot holds, as the manager's per-slot ``bytearray`` records it."""

    FREE = 0
    """No block."""
    WRITING = 1
    """A block between ``prepare_store`` and ``complete_store``: not readable."""
    REMOVED_WRITING = 2
    """Removed while being written: freed when its store completes."""
    REMOVED_PINNED = 3
    """Removed while pinned by loads: freed when the last load completes."""
    PINNED = 4
    """Ready, held by at least one load in flight (or protected during an eviction)."""
    EVICTABLE = 5
    """Ready and not pinned: the only state a policy may evict."""


_EVICTABLE = int(SlotState.EVICTABLE)


class CachePolicy(ABC):
    """Chooses the blocks a :class:`~kvtier.manager.ResidencyManager` evicts.

    The manager calls the policy in batches, with slot numbers; "first is most
    recent" holds for every list of slots it passes. A policy instance serves
    one manager (:meth:`bind` is called once, by the manager's constructor).

    Notes
    -----
    Only slots whose state is :attr:`SlotState.EVICTABLE` may be returned by
    :meth:`evict`: pinned blocks, blocks being written and blocks the current
    ``prepare_store`` names all have other states while :meth:`evict` runs. The
    manager calls :meth:`evict` only when enough evictable slots exist. Every
    method must be O(1) per slot amortized and do no I/O.
    """

    __slots__ = ("_bound", "capacity", "keys", "states")

    def __init__(self) -> None:
        self._bound = False
        self.capacity = 0
        self.states = bytearray()
        self.keys: list[bytes | None] = []

    def bind(self, capacity: int, states: bytearray, keys: list[bytes | None]) -> None:
        """Attach to a manager: its capacity, its slot states and its slot -> key table.

        Both containers belong to the manager and change under the policy; the
        policy only reads them.

        Raises
        ------
        InvalidArgumentError
            When the instance already serves another manager.
        """
        if self._bound:
            raise InvalidArgumentError(
                f"{type(self).__name__} instance already serves a manager; pass a new one"
            )
        self._bound = True
        self.capacity = capacity
        self.states = states
        self.keys = keys
        self.clear()

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (the manager was reset)."""

    def missed(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Blocks not resident are about to be stored (a policy may learn from it).

        Called by ``prepare_store`` with the new keys before it evicts; the
        blocks may still fail to store (then :meth:`discarded` follows).
        """

    @abstractmethod
    def inserted(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks became ready: from now on they are candidates; first most recent."""

    @abstractmethod
    def touched(self, slots: Sequence[int]) -> None:
        """Resident blocks were used; first most recent. Slots the policy does
        not hold (being written) must be ignored."""

    @abstractmethod
    def evict(self, n: int) -> list[int]:
        """Forget and return exactly ``n`` evictable slots, least valuable first."""

    @abstractmethod
    def discarded(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Blocks left without being evicted (removed, or their store failed).

        Slots the policy does not hold must be ignored.
        """


class _Recency:
    """One exact recency list as a log of slots (see the module docstring)."""

    __slots__ = ("code", "head", "limit", "log", "occ", "size", "where")

    def __init__(self, capacity: int, where: bytearray, code: int) -> None:
        self.where = where
        """Per slot: which list holds it (shared by the lists of one policy)."""
        self.code = code
        """This list's value in :attr:`where`."""
        self.log = array("I")
        self.head = 0
        """Entries before ``head`` were read by eviction already."""
        self.occ = array("I", bytes(4 * capacity))
        """Per slot: how many of its entries are in the log from ``head`` on."""
        self.size = 0
        """Slots in this list."""
        # Compacting costs O(log); doing it after ~3x capacity appends keeps its
        # share of each append small while the log stays within 12 bytes a slot.
        self.limit = 3 * capacity + 4096

    def push(self, slots: Sequence[int]) -> None:
        """Append uses, first most recent (so it is appended last)."""
        occ = self.occ
        for s in slots:
            occ[s] += 1
        log = self.log
        log.extend(reversed(slots))
        if len(log) - self.head > self.limit:
            self.compact()

    def take(self, n: int, states: bytearray, out: list[int]) -> int:
        """Move up to ``n`` evictable slots, least recent first, from the list to ``out``."""
        log, occ, where, code = self.log, self.occ, self.where, self.code
        i, end, got = self.head, len(log), 0
        passed: list[int] = []
        while got < n and i < end:
            s = log[i]
            i += 1
            c = occ[s] - 1
            occ[s] = c
            if c or where[s] != code:
                continue  # a later entry of this slot exists, or it left the list
            if states[s] == _EVICTABLE:
                where[s] = 0
                out.append(s)
                got += 1
            else:
                passed.append(s)
        # Pinned blocks passed over keep their place: write them back in front
        # (the positions just read are free), so the order stays exact.
        for s in reversed(passed):
            i -= 1
            log[i] = s
            occ[s] += 1
        self.head = i
        self.size -= got
        if i > 4096 and 2 * i > len(log):
            del log[:i]
            self.head = 0
        return got

    def compact(self) -> None:
        """Drop stale entries: one entry per member, in recency order."""
        member = self.where.translate(_MEMBER[self.code])
        live = self.log[self.head :]
        latest = dict.fromkeys(reversed(live))  # each slot once, most recent first
        keep = list(compress(latest, map(member.__getitem__, latest)))
        keep.reverse()
        self.log = array("I", keep)
        self.head = 0
        self.occ = array("I", list(member))

    def clear(self) -> None:
        self.log = array("I")
        self.head = 0
        self.occ = array("I", bytes(4 * len(self.occ)))
        self.size = 0


# bytes.translate tables: list code -> 1, anything else -> 0.
_MEMBER = {code: bytes(int(i == code) for i in range(256)) for code in (1, 2)}


class LRUPolicy(CachePolicy):
    """Least recently used: evicts the block whose last use is oldest.

    Notes
    -----
    A block is used when it becomes ready (``complete_store``) and when it is
    touched. Pinned blocks are passed over and keep their place in the order.
    """

    __slots__ = ("_list", "_where")

    def __init__(self) -> None:
        super().__init__()
        self._where = bytearray()
        self._list = _Recency(0, self._where, 1)

    def clear(self) -> None:
        self._where = bytearray(self.capacity)
        self._list = _Recency(self.capacity, self._where, 1)

    def inserted(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        where = self._where
        for s in slots:
            where[s] = 1
        self._list.size += len(slots)
        self._list.push(slots)

    def touched(self, slots: Sequence[int]) -> None:
        # Entries of slots not in the list are stale from the start: no filter needed.
        self._list.push(slots)

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        self._list.take(n, self.states, out)
        return out

    def discarded(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        where = self._where
        left = 0
        for s in slots:
            if where[s]:
                where[s] = 0
                left += 1
        self._list.size -= left

    @property
    def size(self) -> int:
        """Blocks in the recency order (the ready ones)."""
        return self._list.size


_GHOST_TOP = 0x80000000  # set in every ghost entry, so that 0 means empty
_GHOST_B2 = 1  # low bit of an entry: which ghost list


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), adapted to batches and pins.

    T1 holds blocks used once since they entered, T2 blocks used again. A block
    enters T1 when its store completes and moves to T2 when touched. Eviction
    takes from T1 while T1 is larger than the adaptive target ``p``, else from
    T2. An evicted key is remembered as a ghost (B1 if it left T1, B2 if it left
    T2); storing a key that is a B1 ghost shows that T1 was too small and raises
    ``p``, a B2 ghost lowers it, and either ghost re-enters straight into T2.

    Notes
    -----
    Differences from the paper, all for O(1) batches in pure Python:

    * Ghosts are 32-bit fingerprints (CRC-32 of the key) in one direct-mapped
      table of at least ``capacity`` entries: a ghost is forgotten when a newer
      one lands on its entry rather than in exact LRU order. A false ghost hit
      needs a 31-bit collision; a lost ghost only means a missed adaptation.
    * A batch of stores adapts ``p`` for all its ghost hits first, then chooses
      all its victims against the new ``p``.
    * Pinned blocks are passed over and keep their place; when the list ``p``
      points at has nothing evictable, the other list gives the victim.
    """

    __slots__ = ("_b1", "_b2", "_ghosts", "_mask", "_p", "_pending", "_t1", "_t2", "_where")

    def __init__(self) -> None:
        super().__init__()
        self._where = bytearray()
        self._t1 = _Recency(0, self._where, 1)
        self._t2 = _Recency(0, self._where, 2)
        self._ghosts = array("I")
        self._mask = 0
        self._b1 = 0
        self._b2 = 0
        self._p = 0.0
        self._pending: set[bytes] = set()

    def clear(self) -> None:
        cap = self.capacity
        self._where = bytearray(cap)
        self._t1 = _Recency(cap, self._where, 1)
        self._t2 = _Recency(cap, self._where, 2)
        size = 1 << max(10, (cap - 1).bit_length())
        self._ghosts = array("I", bytes(4 * size))
        self._mask = size - 1
        self._b1 = self._b2 = 0
        self._p = 0.0
        self._pending = set()

    # -- introspection (tests, metrics) --------------------------------------------------

    @property
    def target(self) -> float:
        """``p``: how many ready blocks T1 should hold."""
        return self._p

    @property
    def t1_size(self) -> int:
        """Blocks used once since they entered."""
        return self._t1.size

    @property
    def t2_size(self) -> int:
        """Blocks used at least twice."""
        return self._t2.size

    @property
    def b1_size(self) -> int:
        """Ghosts of blocks evicted from T1."""
        return self._b1

    @property
    def b2_size(self) -> int:
        """Ghosts of blocks evicted from T2."""
        return self._b2

    def in_t2(self, slot: int) -> bool:
        """Whether ``slot`` is in T2 (used again since it entered)."""
        return self._where[slot] == 2

    # -- the policy ----------------------------------------------------------------------

    def missed(self, keys: Sequence[bytes]) -> None:
        ghosts, mask, crc = self._ghosts, self._mask, zlib.crc32
        for k in keys:
            h = crc(k)
            i = h & mask
            v = ghosts[i]
            if not v:
                continue
            base = (h | _GHOST_TOP) & ~_GHOST_B2
            if v == base:  # B1: T1 was too small for this block
                self._p = min(float(self.capacity), self._p + max(1.0, self._b2 / self._b1))
                self._b1 -= 1
            elif v == base | _GHOST_B2:  # B2: T2 was too small
                self._p = max(0.0, self._p - max(1.0, self._b1 / self._b2))
                self._b2 -= 1
            else:
                continue
            ghosts[i] = 0
            self._pending.add(k)

    def inserted(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        where = self._where
        pending = self._pending
        if pending:
            ones: list[int] = []
            twos: list[int] = []
            for k, s in zip(keys, slots, strict=True):
                if k in pending:
                    pending.discard(k)
                    where[s] = 2
                    twos.append(s)
                else:
                    where[s] = 1
                    ones.append(s)
            self._t1.size += len(ones)
            self._t1.push(ones)
            self._t2.size += len(twos)
            self._t2.push(twos)
            return
        for s in slots:
            where[s] = 1
        self._t1.size += len(slots)
        self._t1.push(slots)

    def touched(self, slots: Sequence[int]) -> None:
        where = self._where
        used: list[int] = []
        moved = 0
        for s in slots:
            w = where[s]
            if w:
                if w == 1:
                    where[s] = 2  # its T1 entries are stale from now on
                    moved += 1
                used.append(s)
        self._t1.size -= moved
        self._t2.size += moved
        self._t2.push(used)

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        t1, t2, states = self._t1, self._t2, self.states
        want1 = n if not t2.size else min(n, max(0, math.ceil(t1.size - self._p)))
        got1 = t1.take(want1, states, out) if want1 else 0
        got2 = t2.take(n - got1, states, out) if got1 < n else 0
        if got1 + got2 < n:
            # T2 ran out of evictable blocks (pinned): T1 gives the rest.
            got1 += t1.take(n - got1 - got2, states, out)
        self._remember(out[:got1], 0)
        self._remember(out[got1:], _GHOST_B2)
        return out

    def _remember(self, slots: list[int], tag: int) -> None:
        ghosts, mask, keys, crc = self._ghosts, self._mask, self.keys, zlib.crc32
        lost1 = lost2 = 0
        for s in slots:
            h = crc(keys[s] or b"")  # an evictable slot always has its key
            i = h & mask
            old = ghosts[i]
            if old:
                if old & _GHOST_B2:
                    lost2 += 1
                else:
                    lost1 += 1
            ghosts[i] = ((h | _GHOST_TOP) & ~_GHOST_B2) | tag
        if tag:
            self._b2 += len(slots)
        else:
            self._b1 += len(slots)
        self._b1 -= lost1
        self._b2 -= lost2

    def discarded(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        pending = self._pending
        if pending:
            pending.difference_update(keys)
        where = self._where
        for s in slots:
            w = where[s]
            if w:
                where[s] = 0
                if w == 1:
                    self._t1.size -= 1
                else:
                    self._t2.size -= 1
