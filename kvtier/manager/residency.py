"""The residency manager: which blocks one tier holds, in which state, in which slot.

A tier (the CPU region, the file tier) has ``capacity`` slots. The manager hands
slots out to blocks and takes them back; it does no I/O. The data plane asks it
where to write (:meth:`ResidencyManager.prepare_store`) and read
(:meth:`ResidencyManager.prepare_load`), and reports when the hardware is done
(:meth:`~ResidencyManager.complete_store`, :meth:`~ResidencyManager.complete_load`).

Block states::

              prepare_store             complete_store(ok)
    (absent) ───────────────> WRITING ────────────────────> READY ──prepare_load──> PINNED
        ^                        │  complete_store(failed)   │  ^                      │
        └────────────────────────┘                           │  └──complete_load───────┘
        ^                       evict / remove               │        (last pin)
        └────────────────────────────────────────────────────┘

    remove() of a WRITING or PINNED block: it stops being a hit at once, and
    its slot is freed by its complete_store / last complete_load.

This module is the pure-Python manager. For the built-in policies,
``ResidencyManager(...)`` builds its compiled twin instead
(:class:`kvtier.manager.native.NativeResidencyManager`, which subclasses this
one and registers itself with :func:`register_variant`); this one serves custom
policies, ``native=False``, and installs without the extension.

What each call promises is documented once, in
:class:`kvtier.manager._contract.ResidencyContract`, which both managers
implement and whose docstrings they inherit. The argument checks live in
:mod:`kvtier.manager._arguments`, the slow paths of removed-but-busy blocks in
:mod:`kvtier.manager._removed`; this module keeps the state and the fast paths.

How it stays fast and small
---------------------------
Each state is one ``dict`` from key to slot: ready blocks (pinned or not), blocks
being written, and the two kinds of removed-but-busy blocks, so a lookup or a
load tests one dict per key and never a state field. Per slot there is a key
(``list``); pin counts live in a ``dict`` of the pinned slots only; the policy
adds its own per-slot list and log. The
calls loop over their keys once or twice, mostly inside C (``map``,
``dict.update``, ``array.extend``); ``docs/manager.md`` has the figures.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from itertools import filterfalse, repeat

from kvtier.errors import BlockNotFoundError, BusyError, ProtocolError
from kvtier.manager._arguments import check_construction, check_keys, make_policy
from kvtier.manager._contract import ResidencyContract
from kvtier.manager._removed import complete_removed_loads, complete_removed_stores, park
from kvtier.manager.events import BlockRemoved, BlockStored, ManagerEvent
from kvtier.manager.plans import LoadPlan, ManagerStatistics, StorePlan
from kvtier.manager.policies import CachePolicy

__all__ = ["ResidencyManager", "register_variant"]

_EMPTY_PLAN = StorePlan((), (), (), ())
_ONE = frozenset({1})

# A dict that has seen many deletions grows its table to 3x its entries at the
# next resize (CPython's GROWTH_RATE): 60 to 120 bytes an entry. Past this many
# bytes an entry, the index is copied into a table sized for its entries.
_INDEX_BYTES_PER_ENTRY = 96


_VARIANTS: list[Callable[[object, bool | None], type[ResidencyManager] | None]] = []
"""What :class:`ResidencyManager` may build instead of itself, asked in order."""


def register_variant(
    choose: Callable[[object, bool | None], type[ResidencyManager] | None],
) -> None:
    """Let ``ResidencyManager(...)`` build a subclass: ``choose(policy, native)`` names it, or None.

    :mod:`kvtier.manager.native` registers its compiled manager here when it
    is imported (``kvtier.manager`` imports it), rather than this module
    importing it: the native manager subclasses this one, so the choice is
    made above both and no module imports one that imports it back.
    ``choose`` may raise :class:`~kvtier.errors.InvalidArgumentError` for a
    ``native`` it cannot honour.
    """
    if choose not in _VARIANTS:
        _VARIANTS.append(choose)


class ResidencyManager(ResidencyContract):
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
    native
        ``None`` (the default): for ``"lru"`` and ``"arc"``, build the manager
        whose state and policy run in C
        (:class:`~kvtier.manager.native.NativeResidencyManager`) when the
        compiled core is installed and ``KVTIER_MANAGER`` is not ``python``.
        ``True`` requires it; ``False`` gives this pure-Python manager. Both
        behave alike call for call.

    Raises
    ------
    InvalidArgumentError
        For a capacity that is not a positive int, an unknown policy name, a
        policy instance that already serves another manager, or ``native=True``
        with a policy instance or without the compiled core.

    Notes
    -----
    Every method is synchronous, does no I/O, and costs O(1) per key amortized.
    Keys are ``bytes``; a call with a key of another type, or with the same key
    twice, raises :class:`~kvtier.errors.InvalidArgumentError`. A method that
    raises changes nothing.

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
        "_evictions",
        "_free",
        "_fresh",
        "_hits",
        "_index",
        "_index_limit",
        "_keys",
        "_misses",
        "_pinned",
        "_pins",
        "_policy",
        "_removed_pinned",
        "_removed_writing",
        "_tier",
        "_writing",
    )

    def __new__(
        cls,
        capacity_slots: int,
        policy: str | CachePolicy = "lru",
        *,
        enable_events: bool = False,
        tier: str = "cpu",
        native: bool | None = None,
    ) -> ResidencyManager:
        if cls is ResidencyManager:
            for choose in _VARIANTS:
                variant = choose(policy, native)
                if variant is not None:
                    return object.__new__(variant)
        return object.__new__(cls)

    def __init__(
        self,
        capacity_slots: int,
        policy: str | CachePolicy = "lru",
        *,
        enable_events: bool = False,
        tier: str = "cpu",
        native: bool | None = None,
    ) -> None:
        check_construction(capacity_slots, tier)
        self._capacity = capacity_slots
        self._tier = tier
        self._events: list[ManagerEvent] | None = [] if enable_events else None
        self._policy = make_policy(policy)
        self._pins: dict[int, int] = {}
        """Pin count per pinned slot; unpinned slots are absent (no memory per block)."""
        self._keys: list[bytes | None] = [None] * capacity_slots
        self._policy.bind(capacity_slots, self._pins, self._keys)
        self._clear()

    def _clear(self) -> None:
        self._index: dict[bytes, int] = {}
        """Ready blocks, pinned or not."""
        self._writing: dict[bytes, int] = {}
        self._removed_writing: dict[bytes, int] = {}
        self._removed_pinned: dict[bytes, int] = {}
        self._index_limit = 0
        # Slots never handed out are counted, not listed: no int per free slot.
        self._free: list[int] = []
        self._fresh = 0
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
        return (
            len(self._index)
            + len(self._writing)
            + len(self._removed_writing)
            + len(self._removed_pinned)
        )

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` occupies a slot, in any state (being written included)."""
        return (
            key in self._index
            or key in self._writing
            or key in self._removed_writing
            or key in self._removed_pinned
        )

    def is_ready(self, key: bytes) -> bool:
        """Whether ``key`` is resident and ready (loadable); pinned blocks are ready."""
        return key in self._index

    def slot_of(self, key: bytes) -> int | None:
        """The slot ``key`` occupies in any state, or None when it is not resident."""
        for where in (self._index, self._writing, self._removed_writing, self._removed_pinned):
            s = where.get(key)
            if s is not None:
                return s
        return None

    def pins(self, key: bytes) -> int:
        """How many loads in flight pin ``key`` (0 when absent or unpinned)."""
        s = self._index.get(key)
        if s is None:
            s = self._removed_pinned.get(key)
        return 0 if s is None else self._pins.get(s, 0)

    # -- the protocol (docstrings: ResidencyContract) -------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys, "lookup")
        index = self._index
        n = 0
        for k in keys:
            if k not in index:
                break
            n += 1
        self._hits += n
        self._misses += len(keys) - n
        return n

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        check_keys(keys, "prepare_store")
        index, writing = self._index, self._writing
        new = list(filterfalse(index.__contains__, keys))
        if writing or self._removed_writing or self._removed_pinned:
            new = [k for k in new if k not in self]
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
            pins = self._pins
            # Ready blocks of this call must survive it: pin them while evicting.
            shielded = (
                [s for s in map(index.get, keys) if s is not None and s not in pins]
                if n < len(keys)
                else []
            )
            for s in shielded:
                pins[s] = 1
            try:
                if need > len(index) - len(pins) + len(self._removed_pinned):
                    return None
                policy.missed(new)
                victims = policy.evict(need)
            finally:
                for s in shielded:
                    del pins[s]
            if len(victims) != need:
                raise ProtocolError(
                    f"policy {type(policy).__name__} returned {len(victims)} victims, not {need}"
                )
            evicted = list(map(self._keys.__getitem__, victims))  # type: ignore[arg-type]
            deque(map(index.__delitem__, evicted), maxlen=0)
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
        writing.update(zip(new, slots, strict=True))
        return StorePlan(tuple(new), tuple(slots), tuple(evicted), tuple(victims))

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        # Duplicates are found below: the second pop of a key misses.
        check_keys(keys, "complete_store", distinct=False)
        writing = self._writing
        slots: list[int] = list(map(writing.pop, keys, repeat(-1)))
        if -1 in slots:
            # Put back what was taken, then sort out duplicates, removed or unknown keys.
            writing.update((k, s) for k, s in zip(keys, slots, strict=True) if s >= 0)
            check_keys(keys, "complete_store")
            keys = complete_removed_stores(keys, writing, self._removed_writing, self._free)
            slots = list(map(writing.pop, keys))
        if not success:
            self._policy.discarded(keys, slots)
            self._free.extend(slots)
            return
        self._index.update(zip(keys, slots, strict=True))
        deque(map(self._keys.__setitem__, slots, keys), maxlen=0)
        self._policy.inserted(keys, slots)
        if self._events is not None and keys:
            self._events.append(BlockStored(tuple(keys), self._tier))
        if len(self._index) > 4096:
            self._check_index()

    def _check_index(self) -> None:
        size = sys.getsizeof(self._index)
        if size > self._index_limit:
            if size > _INDEX_BYTES_PER_ENTRY * len(self._index):
                # Copying sizes the table for its entries (see _INDEX_BYTES_PER_ENTRY).
                self._index = dict(self._index)
                size = sys.getsizeof(self._index)
            self._index_limit = size

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        check_keys(keys, "prepare_load")
        index = self._index
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError as exc:
            (k,) = exc.args
            why = "is not ready (being written or removed)" if k in self else "is not resident"
            raise BlockNotFoundError(f"block {k!r} {why}") from None
        pins = self._pins
        if pins.keys().isdisjoint(slots):
            pins.update(zip(slots, repeat(1)))  # the usual case, in C: first pins
        else:
            get = pins.get
            for s in slots:
                pins[s] = get(s, 0) + 1
        return LoadPlan(tuple(keys), tuple(slots))

    def complete_load(self, keys: Sequence[bytes]) -> None:
        check_keys(keys, "complete_load")
        pins = self._pins
        try:
            slots = list(map(self._index.__getitem__, keys))
        except KeyError:
            complete_removed_loads(
                keys, self._index, self._removed_pinned, pins, self._keys, self._free
            )
            return
        try:
            counts = set(map(pins.__getitem__, slots))
        except KeyError:
            bad = next(k for k, s in zip(keys, slots, strict=True) if s not in pins)
            raise ProtocolError(f"complete_load: block {bad!r} is not pinned") from None
        if counts == _ONE:
            deque(map(pins.__delitem__, slots), maxlen=0)  # the usual case, in C: last pins
            return
        for s in slots:
            c = pins[s] - 1
            if c:
                pins[s] = c
            else:
                del pins[s]

    def touch(self, keys: Sequence[bytes]) -> None:
        check_keys(keys, "touch")
        index = self._index
        try:
            slots = list(map(index.__getitem__, keys))
        except KeyError:
            slots = [index[k] for k in keys if k in index]
        if slots:
            self._policy.touched(slots)

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        check_keys(keys, "remove")
        gone, slots, now, announced = park(
            keys,
            self._index,
            self._writing,
            self._pins,
            self._removed_writing,
            self._removed_pinned,
        )
        if gone:
            self._policy.discarded(gone, slots)
            slot_keys = self._keys
            for s in now:
                slot_keys[s] = None
            self._free.extend(now)
            if announced and self._events is not None:
                self._events.append(BlockRemoved(tuple(announced), self._tier))
        return gone

    def reset(self) -> None:
        if self._pins or self._writing or self._removed_writing:
            raise BusyError("reset: blocks are pinned or being written; complete them first")
        ready = tuple(sorted(self._index, key=self._index.__getitem__))  # slot order, as native
        # In place: the policy holds these containers.
        self._keys[:] = [None] * self._capacity
        self._policy.clear()
        events = self._events
        self._clear()
        if ready and events is not None:
            events.append(BlockRemoved(ready, self._tier))

    def take_events(self) -> list[ManagerEvent]:
        """Events recorded since the last call, oldest first; empty when disabled."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def statistics(self) -> ManagerStatistics:
        """A snapshot of occupancy and counters."""
        ready = len(self._index)
        return ManagerStatistics(
            capacity=self._capacity,
            used=len(self),
            ready=ready,
            being_written=len(self._writing) + len(self._removed_writing),
            pinned=len(self._pins),
            evictable=ready - len(self._pins) + len(self._removed_pinned),
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
        )

    def __repr__(self) -> str:
        return (
            f"<ResidencyManager tier={self._tier!r} policy={type(self._policy).__name__} "
            f"{len(self)}/{self._capacity} slots>"
        )
