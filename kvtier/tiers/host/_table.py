"""Private: the host segment's shared tables, and the protocols that keep them sound.

Every shared word has **one writer** at a time, so that no compare-and-swap
between processes is needed (Python has none): a row's entry is written by
its owner only, a lease entry by its reader only, an instance entry by its
instance only; what changes hands (claiming free rows, adopting a dead
instance's rows and slot, registering, closing) happens under the segment's
mutex (:mod:`kvtier.tiers.host._layout`). Words are 8-byte aligned and
written whole.

Row entry (32 bytes, row ``r``)::

    seq    u64  even: stable; odd: being written (never read then)
    owner  u64  0: nobody's; else (epoch << 16) | (slot + 1) of its owner
    key    16   the key its block holds; zeros: none

Instance entry (64 bytes, slot ``s``)::

    state u64 (1: live)  epoch u64  pid u64  start time u64 (clock ticks after boot)
    heartbeat u64 (CLOCK_MONOTONIC ns)  registered u64 (ns since the epoch)  boot id (16)

Lease entry (32 bytes, ``LEASES_PER_INSTANCE`` per slot)::

    row + 1 u64 (0: unused)  seq u64 (the row's seq it was taken on)  since u64 (ns)  0

**Store** (owner): ``seq`` odd -> payload, block header and key -> ``seq`` even.
**Read** (anyone): ``seq`` even and key as asked -> lease -> ``seq`` unchanged ->
copy -> ``seq`` unchanged and the copy verifies (block header, key, XXH3).
**Reuse** (owner): ``seq`` odd -> is a live reader's lease on this row's old
``seq``? then ``seq`` back to its old value (nothing changed) and another row.
A reader stores its lease, then reads ``seq``; the owner stores ``seq``, then
reads the leases; a full barrier between the store and the load on each side
(:func:`fence`) makes at least one of them see the other. Where it would
not (weaker hardware), the checks after the copy turn the race into a miss.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import numpy.typing as npt

from kvtier.errors import CapacityError
from kvtier.tiers.host._layout import (
    INSTANCE_ENTRY_BYTES,
    LEASE_ENTRY_BYTES,
    LEASES_PER_INSTANCE,
    ROW_ENTRY_BYTES,
    Segment,
    boot_id,
    slot_live,
    take_slot,
)

__all__ = ["LIVE", "Table", "fence", "owner_word", "start_ticks"]

LIVE = 1
_ROW_WORDS = ROW_ENTRY_BYTES // 8
_INST_WORDS = INSTANCE_ENTRY_BYTES // 8
_LEASE_WORDS = LEASE_ENTRY_BYTES // 8
_EMPTY_KEY = bytes(16)
_FIELDS = 128
"""Bytes of a row's block header that hold its fields (the rest is zero padding)."""
# instance entry words
_STATE, _EPOCH, _PID, _START, _BEAT, _REGISTERED, _BOOT = range(7)

_barrier = threading.Lock()


def fence() -> None:
    """A full memory barrier: a lock's acquire and release are locked instructions on x86-64."""
    _barrier.acquire()
    _barrier.release()


def owner_word(slot: int, epoch: int) -> int:
    """The row-entry owner word of the instance registered in ``slot`` at ``epoch``."""
    return ((epoch & 0xFFFF_FFFF_FFFF) << 16) | (slot + 1)


def start_ticks(pid: int) -> int:
    """When process ``pid`` started, in clock ticks after boot (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text[text.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class Table:
    """The shared tables of one mapped segment, as one instance reads and writes them."""

    def __init__(self, seg: Segment) -> None:
        g = seg.geometry
        self._seg = seg
        self.rows = g.rows
        self.instances = g.instances
        self.stride = g.row_stride
        self.data_offset = g.data_offset
        self.words = memoryview(seg.map).cast("Q")
        """The whole segment as u64 words (single-word loads and stores)."""
        self.table_word = g.table_offset // 8
        self.lease_word = g.leases_offset // 8
        self.inst_word = g.instances_offset // 8
        self.row_np: npt.NDArray[np.uint64] = np.ndarray(
            (g.rows, _ROW_WORDS), dtype=np.uint64, buffer=seg.map, offset=g.table_offset
        )
        self.inst_np: npt.NDArray[np.uint64] = np.ndarray(
            (g.instances, _INST_WORDS), dtype=np.uint64, buffer=seg.map, offset=g.instances_offset
        )
        self.lease_np: npt.NDArray[np.uint64] = np.ndarray(
            (g.instances, LEASES_PER_INSTANCE, _LEASE_WORDS),
            dtype=np.uint64,
            buffer=seg.map,
            offset=g.leases_offset,
        )

    def release(self) -> None:
        """Drop every view of the mapping (before it is closed)."""
        self.words.release()
        del self.row_np, self.inst_np, self.lease_np

    # -- rows (lock-free) --------------------------------------------------------------------

    def seq_word(self, row: int) -> int:
        """Index in :attr:`words` of ``row``'s seq (owner +1, key +2 and +3)."""
        return self.table_word + _ROW_WORDS * row

    def key_at(self, row: int) -> bytes:
        """The key ``row``'s entry holds now (not checked against its seq)."""
        o = (self.table_word + _ROW_WORDS * row + 2) * 8
        return bytes(self._seg.map[o : o + 16])

    def set_key(self, row: int, key: bytes) -> None:
        o = (self.table_word + _ROW_WORDS * row + 2) * 8
        self._seg.map[o : o + 16] = key

    def row_offset(self, row: int) -> int:
        """File offset of ``row``'s block header; its payload follows at + HEADER_BYTES."""
        return self.data_offset + row * self.stride

    def reset_row(self, row: int) -> None:
        """Make ``row`` hold nothing (its owner, or the mutex holder adopting it)."""
        w = self.words
        i = self.seq_word(row)
        seq = w[i] | 1
        w[i] = seq
        self.set_key(row, _EMPTY_KEY)
        o = self.row_offset(row)
        self._seg.map[o : o + _FIELDS] = bytes(_FIELDS)  # the header's fields: no block
        w[i] = seq + 1

    def changes(self, seen: npt.NDArray[np.uint64]) -> list[tuple[int, bytes | None, bool]]:
        """``(row, key or None, settled)`` for each row whose seq moved past ``seen``.

        A row being written is reported with no key and not settled, its odd
        seq taken as seen: whatever it becomes next (written, or its old seq
        back when its owner did not reuse it after all) is reported again. A
        row that moved while its key was read is reported likewise and left
        for the next call. A settled row's ``seen`` is its seq.
        """
        now = self.row_np[:, 0].copy()
        moved = np.flatnonzero(now != seen)
        out: list[tuple[int, bytes | None, bool]] = []
        w = self.words
        for r in moved.tolist():
            v = int(now[r])
            if v & 1:
                seen[r] = v
                out.append((r, None, False))
                continue
            key = self.key_at(r)
            if w[self.seq_word(r)] != v:
                out.append((r, None, False))  # moved while read: next time
                continue
            seen[r] = v
            out.append((r, None if key == _EMPTY_KEY else key, True))
        return out

    # -- instances (under the mutex) -----------------------------------------------------------

    def _inst(self, slot: int, word: int) -> int:
        return int(self.words[self.inst_word + _INST_WORDS * slot + word])

    def _set_inst(self, slot: int, word: int, value: int) -> None:
        self.words[self.inst_word + _INST_WORDS * slot + word] = value

    def entry_live(self, slot: int) -> bool:
        """Whether slot ``slot``'s entry says live (its lock says whether it really is)."""
        return self._inst(slot, _STATE) == LIVE

    def epoch(self, slot: int) -> int:
        return self._inst(slot, _EPOCH)

    def pid(self, slot: int) -> int:
        return self._inst(slot, _PID)

    def take_slot(self, fd: int) -> int:
        """Hold the first slot whose lock nobody holds.

        Raises
        ------
        CapacityError
            Every slot is held by a live instance.
        """
        for slot in range(self.instances):
            if take_slot(fd, slot):
                return slot
        raise CapacityError(
            f"all {self.instances} instance slots of host segment {self._seg.path} are held by "
            "live instances: give every instance on the host a larger `instances` (a new "
            "segment: stop them all first)"
        )

    def sweep(self, fd: int, me: int) -> list[int]:
        """Mark the slots of dead instances free and drop their leases; return those slots.

        Dead: the entry says live, and nobody holds the slot's lock (the kernel
        dropped it when the process died), or it was written in another boot.
        """
        boot = int.from_bytes(boot_id()[:8], "little"), int.from_bytes(boot_id()[8:], "little")
        dead = []
        for slot in range(self.instances):
            if slot == me or not self.entry_live(slot):
                continue
            same_boot = (self._inst(slot, _BOOT), self._inst(slot, _BOOT + 1)) == boot
            if same_boot and slot_live(fd, slot):
                continue
            self.lease_np[slot] = 0
            self._set_inst(slot, _STATE, 0)
            dead.append(slot)
        return dead

    def enter(self, slot: int) -> int:
        """Write this process into ``slot``'s entry (a new epoch); return the epoch."""
        epoch = (self._inst(slot, _EPOCH) + 1) & 0xFFFF_FFFF_FFFF
        self.lease_np[slot] = 0
        pid = os.getpid()
        boot = boot_id()
        self._set_inst(slot, _EPOCH, epoch)
        self._set_inst(slot, _PID, pid)
        self._set_inst(slot, _START, start_ticks(pid))
        self._set_inst(slot, _BEAT, time.monotonic_ns())
        self._set_inst(slot, _REGISTERED, time.time_ns())
        self._set_inst(slot, _BOOT, int.from_bytes(boot[:8], "little"))
        self._set_inst(slot, _BOOT + 1, int.from_bytes(boot[8:], "little"))
        self._set_inst(slot, _STATE, LIVE)
        return epoch

    def leave(self, slot: int) -> None:
        """Mark ``slot`` free and drop its leases (its rows become orphans, still readable)."""
        self.lease_np[slot] = 0
        self._set_inst(slot, _STATE, 0)

    def beat(self, slot: int) -> None:
        """Record that the instance in ``slot`` is working (lock-free, its own word)."""
        self._set_inst(slot, _BEAT, time.monotonic_ns())

    def live_owners(self) -> npt.NDArray[np.uint64]:
        """Owner words of the live registrations."""
        return np.array(
            [owner_word(s, self.epoch(s)) for s in range(self.instances) if self.entry_live(s)],
            dtype=np.uint64,
        )

    def orphans(self) -> npt.NDArray[np.bool_]:
        """Rows owned by an instance that closed or died (by the entries: sweep first)."""
        owner = self.row_np[:, 1]
        orphan: npt.NDArray[np.bool_] = (owner != 0) & ~np.isin(owner, self.live_owners())
        return orphan

    def claim(self, me: int, epoch: int, want: int) -> tuple[list[int], list[int], list[int], int]:
        """Own up to ``want`` more rows: orphans holding a block, orphans their owner died
        writing, empty orphans, then free rows.

        Returns ``(blocks, empty, reset, adopted)``: the rows taken that hold a
        block (to serve as this instance's own), those that hold none, those of
        them that were reset (their owner died writing them: an odd seq), and
        how many of all were orphans (the rest were free).
        """
        word = owner_word(me, epoch)
        orphan = self.orphans()
        seqs = self.row_np[:, 0]
        has_key = (self.row_np[:, 2] | self.row_np[:, 3]) != 0
        stable = (seqs & np.uint64(1)) == 0
        adoptable = np.concatenate(
            [
                np.flatnonzero(orphan & stable & has_key),
                np.flatnonzero(orphan & ~stable),
                np.flatnonzero(orphan & stable & ~has_key),
            ]
        )
        order = np.concatenate([adoptable, np.flatnonzero(self.row_np[:, 1] == 0)])[:want]
        blocks, empty, reset = [], [], []
        w = self.words
        for r in order.tolist():
            i = self.seq_word(r)
            w[i + 1] = word
            seq = w[i]
            if seq & 1:
                self.reset_row(r)
                reset.append(r)
                empty.append(r)
            elif self.key_at(r) == _EMPTY_KEY:
                empty.append(r)
            else:
                blocks.append(r)
        return blocks, empty, reset, min(len(adoptable), len(order))

    def owned(self, me: int, epoch: int) -> int:
        """Rows the registration ``(me, epoch)`` owns."""
        return int(np.count_nonzero(self.row_np[:, 1] == np.uint64(owner_word(me, epoch))))

    # -- leases ----------------------------------------------------------------------------

    def lease_word_of(self, slot: int, index: int) -> int:
        """Index in :attr:`words` of lease ``index`` of ``slot`` (row + 1; seq +1; since +2)."""
        return self.lease_word + (slot * LEASES_PER_INSTANCE + index) * _LEASE_WORDS

    def leased(self, fd: int, me: int, candidates: dict[int, int], ttl_ns: int) -> set[int]:
        """Which of ``candidates`` (row -> its seq before this reuse) a reader holds.

        A lease counts when it names the row and that seq, is younger than
        ``ttl_ns``, and its reader is live (this instance, or a slot whose lock
        is held: one syscall per slot, only for a lease that names a candidate).
        """
        active = self.lease_np[:, :, 0].copy()  # readers change it as we look
        slots, idx = np.nonzero(active)
        if not len(slots):
            return set()
        now = time.monotonic_ns()
        live: dict[int, bool] = {}
        out: set[int] = set()
        lease = self.lease_np
        for s, i in zip(slots.tolist(), idx.tolist(), strict=True):
            row = int(lease[s, i, 0]) - 1
            seq = candidates.get(row)
            if seq is None or int(lease[s, i, 1]) != seq or now - int(lease[s, i, 2]) > ttl_ns:
                continue
            ok = live.get(s)
            if ok is None:
                ok = live[s] = s == me or (self.entry_live(s) and slot_live(fd, s))
            if ok:
                out.add(row)
        return out

    def lease_counts(self, fd: int, me: int, ttl_ns: int) -> tuple[int, int]:
        """``(outstanding, expired)``: lease entries of live readers within ``ttl_ns``, and
        entries of dead readers or older than that, not yet dropped."""
        active = self.lease_np[:, :, 0].copy()
        now = time.monotonic_ns()
        outstanding = expired = 0
        for s in range(self.instances):
            taken = np.flatnonzero(active[s])
            if not len(taken):
                continue
            alive = s == me or (self.entry_live(s) and slot_live(fd, s))
            for i in taken.tolist():
                if alive and now - int(self.lease_np[s, i, 2]) <= ttl_ns:
                    outstanding += 1
                else:
                    expired += 1
        return outstanding, expired

    def writing(self) -> int:
        """Rows being written now (or left so by a writer that died: odd seq)."""
        return int(np.count_nonzero(self.row_np[:, 0] & np.uint64(1)))

    def live_slots(self, fd: int, me: int) -> list[bool]:
        """Whether each slot holds a live instance (its entry and its lock: a syscall each)."""
        return [s == me or (self.entry_live(s) and slot_live(fd, s)) for s in range(self.instances)]

    def rows_held(self, live: list[bool]) -> tuple[tuple[int, ...], int, int]:
        """``(rows of each slot's instance if ``live``, orphaned rows, free rows)``."""
        owner = self.row_np[:, 1]
        held = [
            int(np.count_nonzero(owner == np.uint64(owner_word(s, self.epoch(s))))) if up else 0
            for s, up in enumerate(live)
        ]
        free = int(np.count_nonzero(owner == 0))
        return tuple(held), self.rows - free - sum(held), free
