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

from kvtier.errors import BlockNotFoundError, BusyError, InvalidArgumentError, ProtocolError
from kvtier.manager.events import BlockRemoved, BlockStored, ManagerEvent
from kvtier.manager.plans import LoadPlan, ManagerStatistics, StorePlan
from kvtier.manager.policies import ARCPolicy, CachePolicy, LRUPolicy

__all__ = ["ResidencyManager", "register_variant"]

_BYTES_ONLY = frozenset({bytes})
_EMPTY_PLAN = StorePlan((), (), (), ())
_ONE = frozenset({1})

# A dict that has seen many deletions grows its table to 3x its entries at the
# next resize (CPython's GROWTH_RATE): 60 to 120 bytes an entry. Past this many
# bytes an entry, the index is copied into a table sized for its entries.
_INDEX_BYTES_PER_ENTRY = 96


def _check(keys: Sequence[bytes], what: str, *, distinct: bool = True) -> None:
    """Raise unless ``keys`` is a sequence of bytes keys, distinct unless told otherwise.

    Two passes in C: the type of every key (exactly ``bytes``: a ``memoryview``
    hashes and compares equal to the bytes it shows, so only the type keeps one
    out of the index and out of plans), then ``set``, which counts duplicates.
    A caller that detects duplicates on its own passes ``distinct=False`` and
    skips the ``set``.
    """
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
    if distinct and len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"{what}: duplicate keys in one call")


def check_construction(capacity_slots: object, tier: object) -> None:
    """Raise InvalidArgumentError unless the capacity is a positive int and the tier a str."""
    if (
        isinstance(capacity_slots, bool)
        or not isinstance(capacity_slots, int)
        or capacity_slots < 1
    ):
        raise InvalidArgumentError(f"capacity_slots must be a positive int, got {capacity_slots!r}")
    if not isinstance(tier, str):
        raise InvalidArgumentError(f"tier must be a str, got {tier!r}")


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
        self._policy = _make_policy(policy)
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
        # Duplicates are found below: the second pop of a key misses.
        _check(keys, "complete_store", distinct=False)
        writing = self._writing
        slots: list[int] = list(map(writing.pop, keys, repeat(-1)))
        if -1 in slots:
            # Put back what was taken, then sort out duplicates, removed or unknown keys.
            writing.update((k, s) for k, s in zip(keys, slots, strict=True) if s >= 0)
            _check(keys, "complete_store")
            keys = self._complete_removed_stores(keys)
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

    def _complete_removed_stores(self, keys: Sequence[bytes]) -> list[bytes]:
        """Free the removed blocks among ``keys``; return the others (all being written)."""
        writing, removed = self._writing, self._removed_writing
        for k in keys:
            if k not in writing and k not in removed:
                raise ProtocolError(f"complete_store: block {k!r} is not being written")
        gone = [k for k in keys if k in removed]
        self._free.extend(removed.pop(k) for k in gone)
        return [k for k in keys if k in writing]

    def _check_index(self) -> None:
        size = sys.getsizeof(self._index)
        if size > self._index_limit:
            if size > _INDEX_BYTES_PER_ENTRY * len(self._index):
                # Copying sizes the table for its entries (see _INDEX_BYTES_PER_ENTRY).
                self._index = dict(self._index)
                size = sys.getsizeof(self._index)
            self._index_limit = size

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
        pins = self._pins
        try:
            slots = list(map(self._index.__getitem__, keys))
        except KeyError:
            self._complete_removed_loads(keys)
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

    def _complete_removed_loads(self, keys: Sequence[bytes]) -> None:
        """complete_load where some keys were removed while pinned (the slow path)."""
        index, removed, pins = self._index, self._removed_pinned, self._pins
        slots: list[int] = []
        for k in keys:
            s = index.get(k)
            if s is None:
                s = removed.get(k)
            if s is None or s not in pins:
                raise ProtocolError(f"complete_load: block {k!r} is not pinned")
            slots.append(s)
        for k, s in zip(keys, slots, strict=True):
            c = pins[s] - 1
            if c:
                pins[s] = c
                continue
            del pins[s]
            if k in removed:
                del removed[k]
                self._keys[s] = None
                self._free.append(s)

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
            slots = [index[k] for k in keys if k in index]
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
        taken while the hardware may still use it: a block pinned by loads is
        freed by its last :meth:`complete_load`, a block being written by its
        :meth:`complete_store` (which then never makes it ready). So a load that
        fails verification may call ``complete_load`` and ``remove`` in either
        order. Until the slot is freed the key stays resident (``key in
        manager``) and :meth:`prepare_store` skips it.
        """
        _check(keys, "remove")
        index, writing, pins = self._index, self._writing, self._pins
        gone: list[bytes] = []
        slots: list[int] = []
        now: list[int] = []
        announced: list[bytes] = []
        for k in keys:
            s = index.pop(k, None)
            if s is not None:
                announced.append(k)
                if s in pins:
                    self._removed_pinned[k] = s
                else:
                    now.append(s)
            else:
                s = writing.pop(k, None)
                if s is None:
                    continue  # absent, or removed already
                self._removed_writing[k] = s
            gone.append(k)
            slots.append(s)
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
        """Forget every block and zero the counters.

        Raises
        ------
        BusyError
            While a block is pinned or being written: its slot is in the
            hardware's hands, and forgetting it would let a new block reuse it.

        Notes
        -----
        A :class:`BlockRemoved` event records the ready blocks, in slot order.
        """
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
