"""Private: :class:`OwnRows`, the rows one instance owns, and which of them a store takes.

The decision half of a store: which rows this instance owns (claimed at open,
adopted from instances that left), which hold its blocks in least recently used
order, which are free, and which rows a batch of stores takes (free ones first,
then the least recently used, never one a live reader leases nor one holding a
block the caller must keep). It moves no payload; the tier writes the rows it
is given. Kept apart from the tier so the eviction and lease rules read in one
place, away from the byte copying and the public face.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.tiers.host._keymap import KeyMap
from kvtier.tiers.host._leases import Leases
from kvtier.tiers.host._membership import Membership
from kvtier.tiers.host._statistics import Counters
from kvtier.tiers.host._table import fence

__all__ = ["OwnRows"]


class OwnRows:
    """This instance's rows: those with its blocks, the free ones, and their claiming."""

    def __init__(self, member: Membership, keys: KeyMap, leases: Leases, counts: Counters) -> None:
        self._member = member
        self._keys = keys
        self._leases = leases
        self._counts = counts
        self.lru: OrderedDict[bytes, int] = OrderedDict()
        """This instance's blocks and their rows, least recently stored or loaded first."""
        self._free: list[int] = []
        self._owned: set[int] = set()
        self._evicted: list[bytes] = []

    def claim(self, want: int) -> int:
        """Own up to ``want`` more rows (mutex held); return how many were taken."""
        m = self._member
        t = m.table
        blocks, empty, reset, adopted = t.claim(m.slot, m.epoch, want)
        w = t.words
        dated = []
        for r in blocks:
            o = t.row_offset(r) + 60  # the block header's "stored at"
            dated.append((int.from_bytes(m.seg.map[o : o + 4], "little"), r))
        for _, r in sorted(dated):
            key = t.key_at(r)
            if key in self.lru:  # two rows of one key (two stores raced): keep one
                t.reset_row(r)
                empty.append(r)
            else:
                self.lru[key] = r
        for r in empty:
            self._free.append(r)
            self._keys.emptied(r, int(w[t.seq_word(r)]))
        self._owned.update(blocks)
        self._owned.update(empty)
        self._counts.rows_adopted += adopted
        self._counts.rows_reset += len(reset)
        return len(blocks) + len(empty)

    def take(self, n: int, keep: Container[bytes] = frozenset()) -> list[tuple[int, int]]:
        """``n`` rows (or fewer) made odd for writing, none leased nor holding a block
        of ``keep``: ``(row, odd seq)``."""
        t = self._member.table
        w = t.words
        row_key = self._keys.row_key
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
            victims = iter(self.lru.values())  # oldest first; not changed until gathered
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
            leased = self._leases.leased(cands)
            for r, seq in cands.items():
                tried.add(r)
                key_held = row_key[r]
                if r in leased:
                    w[t.seq_word(r)] = seq  # nothing changed: its readers' checks pass
                    if key_held is not None and key_held in self.lru:
                        self.lru.move_to_end(key_held)
                    else:
                        self._free.insert(0, r)
                    continue
                if key_held is not None:
                    if self.lru.pop(key_held, None) is not None:
                        self._evicted.append(key_held)
                        self._counts.evictions += 1
                    self._keys.forget(r)
                got.append((r, seq | 1))
            if len(tried) >= len(self._owned):
                break
        return got

    def drop(self, key: bytes) -> bool:
        """Empty the row holding ``key`` (this instance's) and free it; True if one did."""
        row = self.lru.pop(key, None)
        if row is None:
            return False
        t = self._member.table
        t.reset_row(row)
        self._keys.emptied(row, int(t.words[t.seq_word(row)]))
        self._free.append(row)
        return True

    def take_evicted(self) -> list[bytes]:
        """Keys :meth:`take` evicted since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted
