"""The residency manager: which blocks one tier holds, in which state, in which slot.

A tier (the CPU region, the file tier) has ``capacity`` slots. The manager hands
slots out to blocks and takes them back; it does no I/O. The data plane asks it
where to write (:meth:`ResidencyManager.prepare_store`) and read
(:meth:`ResidencyManager.prepare_load`), and reports when the hardware is done
(:meth:`~ResidencyManager.complete_store`, :meth:`~ResidencyManager.complete_load`).

Block states::

                prepare_store             complete_store(ok)
    (absent) ─────────────────> WRITING ─────────────────────> READY  <──┐
        ^                          │   complete_store(failed)    │ │      │ complete_load
        └──────────────────────────┘                             │ │      │ (last pin)
        ^                                 evict / remove         │ │ prepare_load
        └────────────────────────────────────────────────────────┘ └──> PINNED

Memory and time
---------------
Everything per block lives in compact containers: one ``dict`` from key to slot
(its int), a slot -> key ``list``, a one-byte state per slot, and the policy's
arrays; pins are counted in a ``dict`` that holds only pinned slots. Calls loop
over their keys once or twice, mostly inside C (``map``, ``dict.update``,
``array.extend``), so each costs a few hundred nanoseconds per key at any
capacity; ``docs/manager.md`` has the figures.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from itertools import filterfalse

from kvtier.errors import (
    BlockNotFoundError,
    BusyError,
    InvalidArgumentError,
    ProtocolError,
)
from kvtier.manager.events import BlockRemoved, BlockStored, ManagerEvent
from kvtier.manager.plans import LoadPlan, ManagerStatistics, StorePlan
from kvtier.manager.policies import ARCPolicy, CachePolicy, LRUPolicy, SlotState

__all__ = ["ResidencyManager"]

_FREE = int(SlotState.FREE)
_WRITING = int(SlotState.WRITING)
_REMOVED_WRITING = int(SlotState.REMOVED_WRITING)
_REMOVED_PINNED = int(SlotState.REMOVED_PINNED)
_PINNED = int(SlotState.PINNED)
_EVICTABLE = int(SlotState.EVICTABLE)

_BYTES_ONLY = frozenset({bytes})
_EMPTY_PLAN = StorePlan((), (), (), ())

# A dict that has seen many deletions grows its table to 3x its entries at the
# next resize (CPython's GROWTH_RATE), up to ~105 bytes an entry. Past this many
# bytes an entry, the index is copied into a table sized for its entries.
_INDEX_BYTES_PER_ENTRY = 96


def _check(keys: Sequence[bytes], what: str) -> None:
    """Raise unless ``keys`` is a sequence of distinct bytes keys (cheap: two C loops)."""
    if (
        type(keys) is not list
        and type(keys) is not tuple
        and (
            isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence)
        )
    ):
        raise InvalidArgumentError(f"{what}: keys must be a sequence of bytes, got {keys!r}")
    if not _BYTES_ONLY.issuperset(map(type, keys)):
        bad = next(k for k in keys if type(k) is not bytes)
        raise InvalidArgumentError(f"{what}: every key must be bytes, got {bad!r}")
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"{what}: duplicate keys in one call")


def _make_policy(policy: str | CachePolicy) -> CachePolicy:
    if isinstance(policy, CachePolicy):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "arc":
        return ARCPolicy()
    raise InvalidArgumentError(
        f"policy must be 'lru', 'arc' or a CachePolicy instance, got {policy!r}"
    )


class ResidencyManager:
    """Residency of the blocks of one tier: the two-phase store / load protocol.

    Parameters
    ----------
    capacity_slots
        Slots in the tier (CPU region rows, file-tier files); slots are the
        integers ``0 .. capacity_slots - 1``.
    policy
        ``"lru"``, ``"arc"``, or a fresh :class:`CachePolicy` instance.
    enable_events
        Record :class:`BlockStored` / :class:`BlockRemoved` events for
        :meth:`take_events`.
    tier
        The tier's name, carried by events.

    Raises
    ------
    InvalidArgumentError
        For a capacity that is not a positive int, an unknown policy name, or
        a policy instance that already serves another manager.

    Notes
    -----
    Every method is synchronous, does no I/O, and costs O(1) per key amortized.
    Keys are ``bytes``; a call with a key of another type, or with the same key
    twice, raises :class:`~kvtier.errors.InvalidArgumentError` and changes
    nothing. Every method that raises changes nothing.

    A block is *being written* from :meth:`prepare_store` to
    :meth:`complete_store`: it occupies its slot, is not a hit, cannot be loaded
    and cannot be evicted. It is then *ready*. A ready block is *pinned* by each
    :meth:`prepare_load` until the matching :meth:`complete_load`; pins count, so
    loads may overlap. A pinned block is never evicted and its slot never
    reused. Only ready, unpinned blocks are evicted.
    """

    __slots__ = (
        "_capacity",
        "_events",
        "_evictable",
        "_evictions",
        "_free",
        "_fresh",
        "_hits",
        "_index",
        "_index_limit",
        "_keys",
        "_misses",
        "_pins",
        "_policy",
        "_states",
        "_tier",
    )

    def __init__(
        self,
        capacity_slots: int,
        policy: str | CachePolicy = "lru",
        *,
        enable_events: bool = False,
        tier: str = "cpu",
    ) -> None:
        if (
            isinstance(capacity_slots, bool)
            or not isinstance(capacity_slots, int)
            or capacity_slots < 1
        ):
            raise InvalidArgumentError(
                f"capacity_slots must be a positive int, got {capacity_slots!r}"
            )
        if not isinstance(tier, str):
            raise InvalidArgumentError(f"tier must be a str, got {tier!r}")
        self._capacity = capacity_slots
        self._tier = tier
        self._events: list[ManagerEvent] | None = [] if enable_events else None
        self._policy = _make_policy(policy)
        self._states = bytearray(capacity_slots)
        self._keys: list[bytes | None] = [None] * capacity_slots
        self._policy.bind(capacity_slots, self._states, self._keys)
        self._clear()

    def _clear(self) -> None:
        self._index: dict[bytes, int] = {}
        self._index_limit = 0
        self._pins: dict[int, int] = {}
        # Slots never handed out are counted, not listed: no int per free slot.
        self._free: list[int] = []
        self._fresh = 0
        self._evictable = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    # -- read-only views -----------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots in the tier."""
        return self._capacity

    @property
    def tier(self) -> str:
        """The tier's name, as events carry it."""
        return self._tier

    @property
    def policy(self) -> CachePolicy:
        """The eviction policy instance."""
        return self._policy

    def __len__(self) -> int:
        """Blocks that occupy a slot, in any state."""
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` occupies a slot, in any state (being written included)."""
        return key in self._index

    def is_ready(self, key: bytes) -> bool:
        """Whether ``key`` is resident and ready (loadable); pinned blocks are ready."""
        s = self._index.get(key)
        return s is not None and self._states[s] >= _PINNED

    def slot_of(self, key: bytes) -> int | None:
        """The slot ``key`` occupies in any state, or None when it is not resident."""
        return self._index.get(key)

    def pins(self, key: bytes) -> int:
        """How many loads in flight pin ``key`` (0 when absent or unpinned)."""
        s = self._index.get(key)
        return 0 if s is None else self._pins.get(s, 0)

    # -- the protocol --------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is resident and ready.

        Parameters
        ----------
        keys
            Block keys of one sequence, in chain order.

        Returns
        -------
        int
            ``n`` such that ``keys[:n]`` can be loaded now.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A block being written is not a hit. Counts ``n`` hits and
        ``len(keys) - n`` misses in :meth:`statistics`; changes nothing else
        (not even recency: call :meth:`touch` for that). The result may be stale
        by the next call that evicts: pin with :meth:`prepare_load` before use.
        """
        _check(keys, "lookup")
        get, states = self._index.get, self._states
        n = 0
        for k in keys:
            s = get(k)
            if s is None or states[s] < _PINNED:
                break
            n += 1
        self._hits += n
        self._misses += len(keys) - n
        return n

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Reserve slots for the keys not yet resident, evicting as needed.

        Parameters
        ----------
        keys
            Keys of the blocks to store. Keys already resident in any state are
            skipped (their data is, or is about to be, there).

        Returns
        -------
        StorePlan or None
            The keys to write and their slots (in the order of ``keys``), and
            the blocks evicted to make room with the slots they held; an empty
            plan when every key is resident. None when the new blocks cannot
            all be placed: then nothing changed.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        The new blocks are *being written*: not hits, not loadable, not
        evictable, until :meth:`complete_store`. Eviction takes just enough
        ready, unpinned blocks, as the policy orders them, and never one of
        ``keys``. Evicted blocks are gone on return (a :class:`BlockRemoved`
        event records them); a write-back tier copies each victim's row out of
        ``evicted_slots`` before it writes the new block into that slot.
        """
        _check(keys, "prepare_store")
        index = self._index
        new = list(filterfalse(index.__contains__, keys))
        if not new:
            return _EMPTY_PLAN
        n = len(new)
        free = self._free
        unused = self._capacity - self._fresh
        need = n - len(free) - unused
        victims: list[int] = []
        evicted: list[bytes] = []
        policy = self._policy
        if need > 0:
            states = self._states
            # Present blocks of this call must survive it: hide them from the policy.
            shielded: list[int] = []
            if n < len(keys):
                for s in map(index.get, keys):
                    if s is not None and states[s] == _EVICTABLE:
                        states[s] = _PINNED
                        shielded.append(s)
            if need > self._evictable - len(shielded):
                for s in shielded:
                    states[s] = _EVICTABLE
                return None
            policy.missed(new)
            victims = policy.evict(need)
            for s in shielded:
                states[s] = _EVICTABLE
            if len(victims) != need:
                raise ProtocolError(
                    f"policy {type(policy).__name__} returned {len(victims)} victims, not {need}"
                )
            slot_keys = self._keys
            evicted = [slot_keys[s] for s in victims]  # type: ignore[misc]
            pop = index.pop
            for k in evicted:
                pop(k)
            self._evictable -= need
            self._evictions += need
            if self._events is not None:
                self._events.append(BlockRemoved(tuple(evicted), self._tier))
        else:
            policy.missed(new)
        # Free slots first, then never-used ones, then the victims' slots.
        take = min(n, len(free))
        slots = free[len(free) - take :]
        del free[len(free) - take :]
        if take < n:
            fresh = self._fresh
            more = min(n - take, unused)
            slots.extend(range(fresh, fresh + more))
            self._fresh = fresh + more
        slots.extend(victims)
        index.update(zip(new, slots, strict=True))
        slot_keys, states = self._keys, self._states
        for k, s in zip(new, slots, strict=True):
            slot_keys[s] = k
            states[s] = _WRITING
        if len(index) > 4096:
            self._check_index()
        return StorePlan(tuple(new), tuple(slots), tuple(evicted), tuple(victims))

    def _check_index(self) -> None:
        size = sys.getsizeof(self._index)
        if size > self._index_limit:
            if size > _INDEX_BYTES_PER_ENTRY * len(self._index):
                # Copying sizes the table for its entries (see _INDEX_BYTES_PER_ENTRY).
                self._index = dict(self._index)
                size = sys.getsizeof(self._index)
            self._index_limit = size

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """Finish stores: the blocks become ready, or (on failure) are forgotten.

        Parameters
        ----------
        keys
            Keys from one or more :class:`StorePlan` s, each completed once.
        success
            Whether the data reached the slots. On failure the blocks are freed
            as if never stored.

        Raises
        ------
        ProtocolError
            When a key is not being written (never prepared, or completed
            already); nothing changes.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Ready blocks enter the policy as most recently used, the first key most
        recent of all. A block removed (:meth:`remove`) while being written is
        freed here whatever ``success`` says and never becomes ready.
        """
        _check(keys, "complete_store")
        index, states = self._index, self._states
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError as exc:
            raise ProtocolError(f"complete_store: block {exc.args[0]!r} was not prepared") from None
        seen = bytes(map(states.__getitem__, slots))
        if seen.count(_WRITING) != len(slots):
            gone = [
                (k, s) for k, s in zip(keys, slots, strict=True) if states[s] == _REMOVED_WRITING
            ]
            if len(gone) + seen.count(_WRITING) != len(slots):
                bad = next(
                    k for k, s in zip(keys, slots, strict=True) if states[s] > _REMOVED_WRITING
                )
                raise ProtocolError(f"complete_store: block {bad!r} is not being written")
            self._release([s for _, s in gone])
            kept = [(k, s) for k, s in zip(keys, slots, strict=True) if states[s] == _WRITING]
            keys = [k for k, _ in kept]
            slots = [s for _, s in kept]
        if not success:
            self._policy.discarded(keys, slots)
            self._release(slots)
            return
        for s in slots:
            states[s] = _EVICTABLE
        self._evictable += len(slots)
        self._policy.inserted(keys, slots)
        if self._events is not None and keys:
            self._events.append(BlockStored(tuple(keys), self._tier))

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Pin ready blocks for reading and return their slots.

        Parameters
        ----------
        keys
            Keys of resident, ready blocks.

        Returns
        -------
        LoadPlan
            The keys and their slots, in the order of ``keys``.

        Raises
        ------
        BlockNotFoundError
            When a key is not resident, or not ready; nothing is pinned.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Each call adds one pin per block; a pinned block is not evicted and its
        slot not reused until as many :meth:`complete_load` calls released it.
        Pinning is also how a tier holds a block still while it copies it
        elsewhere (a CPU row being written to the file tier). Recency is not
        changed: call :meth:`touch`.
        """
        _check(keys, "prepare_load")
        index, states = self._index, self._states
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError as exc:
            raise BlockNotFoundError(f"block {exc.args[0]!r} is not resident") from None
        if slots and min(map(states.__getitem__, slots)) < _PINNED:
            bad = next(k for k, s in zip(keys, slots, strict=True) if states[s] < _PINNED)
            raise BlockNotFoundError(f"block {bad!r} is not ready (being written or removed)")
        pins = self._pins
        first = 0
        for s in slots:
            c = pins.get(s, 0)
            pins[s] = c + 1
            if not c:
                states[s] = _PINNED
                first += 1
        self._evictable -= first
        return LoadPlan(tuple(keys), tuple(slots))

    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release one pin of each block (its load finished, or failed).

        Raises
        ------
        ProtocolError
            When a key is not pinned (more completions than prepares); nothing
            changes.
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A block whose last pin goes becomes evictable again; a block removed
        while pinned is freed now.
        """
        _check(keys, "complete_load")
        index, pins = self._index, self._pins
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError as exc:
            raise ProtocolError(f"complete_load: block {exc.args[0]!r} is not pinned") from None
        if not all(map(pins.__contains__, slots)):
            bad = next(k for k, s in zip(keys, slots, strict=True) if s not in pins)
            raise ProtocolError(f"complete_load: block {bad!r} is not pinned")
        states = self._states
        done: list[int] = []
        for s in slots:
            c = pins[s] - 1
            if c:
                pins[s] = c
            else:
                del pins[s]
                if states[s] == _PINNED:
                    states[s] = _EVICTABLE
                    self._evictable += 1
                else:
                    done.append(s)
        if done:
            self._release(done)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks used: the first key ends up the most recently used.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        Keys that are not resident are ignored, and so are blocks being
        written (they enter the order when they become ready). Prefixes should
        outlive their tails, hence the order: ``touch(keys)`` leaves
        ``keys[0]`` the last to go. Under ARC a touch is a second use: a block
        in T1 moves to T2. A block that was just stored has had its first use;
        touch the blocks a request *hit*.
        """
        _check(keys, "touch")
        index = self._index
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError:
            slots = [s for s in map(index.get, keys) if s is not None]
        if slots:
            self._policy.touched(slots)

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget blocks known to be bad (failed verification); absent keys are ignored.

        Returns
        -------
        list[bytes]
            The keys this call removed, in the order of ``keys``.

        Raises
        ------
        InvalidArgumentError
            For keys that are not bytes, or a key given twice.

        Notes
        -----
        A removed block is at once no hit and not loadable, and a
        :class:`BlockRemoved` event records it if it was ready. Its slot stays
        taken while the hardware may still touch it: a block pinned by loads is
        freed by its last :meth:`complete_load`, a block being written by its
        :meth:`complete_store` (which then never makes it ready). So a load that
        fails verification may call ``complete_load`` and ``remove`` in either
        order. Until the slot is freed the key stays resident (``key in
        manager``) and :meth:`prepare_store` skips it.
        """
        _check(keys, "remove")
        # Pins of blocks removed while pinned stay until their loads complete.
        index, states = self._index, self._states
        gone: list[bytes] = []
        now: list[int] = []
        later: list[int] = []
        announced: list[bytes] = []
        for k in keys:
            s = index.get(k)
            if s is None:
                continue
            st = states[s]
            if st == _EVICTABLE:
                now.append(s)
                self._evictable -= 1
                announced.append(k)
            elif st == _PINNED:
                states[s] = _REMOVED_PINNED
                announced.append(k)
                later.append(s)
            elif st == _WRITING:
                states[s] = _REMOVED_WRITING
                later.append(s)
            else:
                continue  # removed already
            gone.append(k)
        if gone:
            self._policy.discarded(gone, now + later)
            self._release(now)
            if announced and self._events is not None:
                self._events.append(BlockRemoved(tuple(announced), self._tier))
        return gone

    def _release(self, slots: list[int]) -> None:
        """Free slots (the policy has already let go of them)."""
        index, states, slot_keys = self._index, self._states, self._keys
        for s in slots:
            k = slot_keys[s]
            slot_keys[s] = None
            states[s] = _FREE
            del index[k]  # type: ignore[arg-type]
        self._free.extend(slots)

    def reset(self) -> None:
        """Forget every block and zero the counters.

        Raises
        ------
        BusyError
            While a block is pinned or being written: its slot is in the
            hardware's hands, and forgetting it would let a new block reuse it.

        Notes
        -----
        A :class:`BlockRemoved` event records the ready blocks.
        """
        states = self._states
        if self._pins or states.count(_WRITING) or states.count(_REMOVED_WRITING):
            raise BusyError("reset: blocks are pinned or being written; complete them first")
        ready = [k for k, s in self._index.items() if states[s] == _EVICTABLE]
        self._states[:] = bytes(self._capacity)
        self._keys[:] = [None] * self._capacity
        self._policy.clear()
        self._clear()
        if ready and self._events is not None:
            self._events.append(BlockRemoved(tuple(ready), self._tier))

    def take_events(self) -> list[ManagerEvent]:
        """Events recorded since the last call, oldest first; empty when disabled."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def statistics(self) -> ManagerStatistics:
        """A snapshot of occupancy and counters (O(capacity) in C; not for hot paths)."""
        states = self._states
        pinned = states.count(_PINNED)
        evictable = states.count(_EVICTABLE)
        return ManagerStatistics(
            capacity=self._capacity,
            used=len(self._index),
            ready=pinned + evictable,
            being_written=states.count(_WRITING) + states.count(_REMOVED_WRITING),
            pinned=len(self._pins),
            evictable=evictable,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )

    def __repr__(self) -> str:
        return (
            f"<ResidencyManager tier={self._tier!r} policy={type(self._policy).__name__} "
            f"{len(self._index)}/{self._capacity} slots>"
        )
