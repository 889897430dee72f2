"""Conformance suite for :class:`~kvtier.manager.ResidencyManager` and its policies.

Subclass :class:`ResidencyManagerSuite` once per policy and set
:attr:`ResidencyManagerSuite.policy`; pytest collects every test for it::

    class TestLRU(ResidencyManagerSuite):
        policy = "lru"

A custom :class:`~kvtier.manager.CachePolicy` runs the same checks by
overriding :meth:`ResidencyManagerSuite.make_policy`. The checks hold for any
policy: they fix the protocol (states, pins, plans, errors, events, counters),
not which block a policy evicts, except that a block touched after others
outlives them when nothing else is used.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from kvtier.errors import BlockNotFoundError, BusyError, InvalidArgumentError, ProtocolError
from kvtier.manager import (
    ARCPolicy,
    BlockRemoved,
    BlockStored,
    CachePolicy,
    LRUPolicy,
    ResidencyManager,
    StorePlan,
)

__all__ = ["ResidencyManagerSuite", "key", "keys", "serve"]


def key(i: int) -> bytes:
    """A 16-byte test key, distinct for each ``i``."""
    return i.to_bytes(16, "big")


def keys(*ids: int) -> list[bytes]:
    """Test keys for ``ids``, in order."""
    return [key(i) for i in ids]


_CALLS = (
    "complete_load",
    "complete_store",
    "lookup",
    "prepare_load",
    "prepare_store",
    "remove",
    "touch",
)
"""Protocol calls that take a list of keys (called by name: a manager may be a subclass)."""


class ResidencyManagerSuite:
    """Checks every policy must pass; subclass and set :attr:`policy`."""

    policy: ClassVar[str]
    """Policy name, as :class:`ResidencyManager` takes it."""
    native: ClassVar[bool | None] = None
    """``native`` for every manager the suite builds: None lets
    :class:`ResidencyManager` choose (the compiled core for "lru" and "arc"),
    False forces the pure-Python manager."""

    def make_policy(self) -> str | CachePolicy:
        """The policy argument for a new manager; override for custom policies."""
        return self.policy

    def make(self, capacity: int = 4, *, events: bool = True) -> ResidencyManager:
        return ResidencyManager(
            capacity, self.make_policy(), enable_events=events, tier="t", native=self.native
        )

    def fill(self, m: ResidencyManager, ids: list[int]) -> StorePlan:
        """Store and complete ``ids``; the plan must place them all."""
        plan = m.prepare_store(keys(*ids))
        assert plan is not None
        m.complete_store(list(plan.keys))
        return plan

    # -- construction ------------------------------------------------------------------

    @pytest.mark.parametrize("capacity", [0, -1, True, 2.0], ids=["zero", "neg", "bool", "float"])
    def test_capacity_must_be_positive_int(self, capacity: Any) -> None:
        with pytest.raises(InvalidArgumentError):
            ResidencyManager(capacity, self.make_policy(), native=self.native)

    def test_unknown_policy_name(self) -> None:
        with pytest.raises(InvalidArgumentError):
            ResidencyManager(4, "fifo")

    def test_fresh_manager_is_empty(self) -> None:
        m = self.make(4)
        assert m.capacity == 4
        assert len(m) == 0
        assert m.lookup(keys(1)) == 0
        assert m.statistics().used == 0
        assert m.take_events() == []

    # -- argument checks ---------------------------------------------------------------

    @pytest.mark.parametrize("call", _CALLS)
    @pytest.mark.parametrize(
        "bad",
        [[key(1), "str"], [key(1), key(1)], b"0123456789abcdef", [bytearray(16)]],
        ids=["not-bytes", "duplicate", "bytes-as-keys", "bytearray"],
    )
    def test_bad_keys_raise_and_change_nothing(self, call: str, bad: Any) -> None:
        m = self.make(4)
        self.fill(m, [1])
        before = m.statistics()
        with pytest.raises(InvalidArgumentError):
            getattr(m, call)(bad)
        assert m.statistics() == before
        assert m.is_ready(key(1))

    # -- lookup ------------------------------------------------------------------------

    def test_lookup_is_the_ready_prefix(self) -> None:
        m = self.make(8)
        self.fill(m, [1, 2, 4])
        assert m.lookup(keys(1, 2, 3, 4)) == 2
        assert m.lookup(keys(3, 1)) == 0
        assert m.lookup([]) == 0
        s = m.statistics()
        assert (s.hits, s.misses) == (2, 4)

    def test_block_being_written_is_not_a_hit(self) -> None:
        m = self.make(4)
        plan = m.prepare_store(keys(1, 2))
        assert plan is not None
        assert key(1) in m
        assert not m.is_ready(key(1))
        assert m.lookup(keys(1, 2)) == 0
        m.complete_store([key(1)])
        assert m.lookup(keys(1, 2)) == 1
        assert m.is_ready(key(1))

    # -- prepare_store -----------------------------------------------------------------

    def test_store_plan_places_new_keys_in_order(self) -> None:
        m = self.make(4)
        plan = m.prepare_store(keys(3, 1, 2))
        assert plan is not None
        assert plan.keys == tuple(keys(3, 1, 2))
        assert len(set(plan.slots)) == 3
        assert all(0 <= s < 4 for s in plan.slots)
        assert plan.evicted == ()
        assert plan.evicted_slots == ()
        for k, s in zip(plan.keys, plan.slots, strict=True):
            assert m.slot_of(k) == s

    def test_store_skips_present_keys_in_any_state(self) -> None:
        m = self.make(4)
        self.fill(m, [1])
        assert m.prepare_store(keys(2)) is not None  # 2 is being written
        plan = m.prepare_store(keys(1, 2, 3))
        assert plan is not None
        assert plan.keys == (key(3),)
        empty = m.prepare_store(keys(1, 2))
        assert empty is not None
        assert empty.keys == ()
        assert empty.slots == ()

    def test_store_evicts_just_enough(self) -> None:
        m = self.make(4)
        self.fill(m, [1, 2, 3])
        plan = m.prepare_store(keys(4, 5, 6))
        assert plan is not None
        assert len(plan.evicted) == 2
        assert set(plan.evicted) <= set(keys(1, 2, 3))
        assert set(plan.evicted_slots) <= set(plan.slots)
        for k in plan.evicted:
            assert k not in m
        assert len(m) == 4
        assert m.statistics().evictions == 2

    def test_evicted_slots_match_the_evicted_keys(self) -> None:
        m = self.make(3)
        placed = self.fill(m, [1, 2, 3])
        where = dict(zip(placed.keys, placed.slots, strict=True))
        plan = m.prepare_store(keys(4, 5))
        assert plan is not None
        assert plan.evicted_slots == tuple(where[k] for k in plan.evicted)

    def test_store_never_evicts_its_own_keys(self) -> None:
        m = self.make(3)
        for i in (1, 2, 3):
            self.fill(m, [i])  # 1 is now the least recently used
        plan = m.prepare_store(keys(1, 4))
        assert plan is not None
        assert plan.keys == (key(4),)
        assert plan.evicted == (key(2),)
        assert m.is_ready(key(1))

    @pytest.mark.parametrize("busy", ["pinned", "being-written"])
    def test_store_never_evicts_pinned_or_being_written(self, busy: str) -> None:
        m = self.make(3)
        for i in (1, 2, 3):
            self.fill(m, [i])  # 1 is now the least recently used
        if busy == "pinned":
            m.prepare_load(keys(1))
        else:
            m.remove(keys(1))
            assert m.prepare_store(keys(1)) is not None  # 1 again, being written
        plan = m.prepare_store(keys(4))
        assert plan is not None
        assert plan.evicted == (key(2),)
        plan = m.prepare_store(keys(5))
        assert plan is not None
        assert plan.evicted == (key(3),)
        assert m.prepare_store(keys(6)) is None  # 1 is the only other block
        assert key(1) in m

    def test_store_that_cannot_fit_returns_none_and_changes_nothing(self) -> None:
        m = self.make(3, events=True)
        self.fill(m, [1, 2])
        m.prepare_load(keys(1))
        m.take_events()
        before = m.statistics()
        assert m.prepare_store(keys(5, 6, 7)) is None  # 1 free + 1 evictable < 3
        assert m.prepare_store(keys(2, 5, 6)) is None  # 2 is shielded by the call itself
        assert m.statistics() == before
        assert m.take_events() == []
        assert m.is_ready(key(2))
        assert m.prepare_store(keys(5, 6)) is not None

    def test_more_keys_than_capacity(self) -> None:
        m = self.make(2)
        assert m.prepare_store(keys(1, 2, 3)) is None
        assert len(m) == 0

    # -- complete_store ----------------------------------------------------------------

    def test_complete_unprepared_store_is_protocol_error(self) -> None:
        m = self.make(4)
        self.fill(m, [1])
        with pytest.raises(ProtocolError):
            m.complete_store(keys(2))
        with pytest.raises(ProtocolError):
            m.complete_store(keys(1))  # ready already
        assert m.prepare_store(keys(3)) is not None
        with pytest.raises(ProtocolError):
            m.complete_store(keys(3, 1))  # one bad key: nothing completes
        assert not m.is_ready(key(3))

    def test_failed_store_frees_as_if_never_stored(self) -> None:
        m = self.make(2, events=True)
        plan = m.prepare_store(keys(1, 2))
        assert plan is not None
        m.complete_store(keys(1, 2), success=False)
        assert len(m) == 0
        assert key(1) not in m
        assert m.take_events() == []
        again = m.prepare_store(keys(3, 4))
        assert again is not None
        assert sorted(again.slots) == sorted(plan.slots)
        assert again.evicted == ()

    def test_store_completes_in_parts(self) -> None:
        m = self.make(4)
        assert m.prepare_store(keys(1, 2, 3)) is not None
        m.complete_store(keys(2))
        m.complete_store(keys(3, 1), success=True)
        assert m.lookup(keys(1, 2, 3)) == 3
        s = m.statistics()
        assert (s.ready, s.being_written) == (3, 0)

    # -- loads and pins ----------------------------------------------------------------

    def test_prepare_load_pins_and_returns_slots_in_order(self) -> None:
        m = self.make(4)
        placed = self.fill(m, [1, 2, 3])
        where = dict(zip(placed.keys, placed.slots, strict=True))
        plan = m.prepare_load(keys(3, 1))
        assert plan.keys == tuple(keys(3, 1))
        assert plan.slots == (where[key(3)], where[key(1)])
        s = m.statistics()
        assert (s.pinned, s.evictable, s.ready) == (2, 1, 3)
        assert m.pins(key(3)) == 1

    @pytest.mark.parametrize("state", ["absent", "being-written"])
    def test_prepare_load_of_unready_block_changes_nothing(self, state: str) -> None:
        m = self.make(4)
        self.fill(m, [1])
        if state == "being-written":
            assert m.prepare_store(keys(2)) is not None
        before = m.statistics()
        with pytest.raises(BlockNotFoundError):
            m.prepare_load(keys(1, 2))
        assert m.statistics() == before
        assert m.pins(key(1)) == 0

    def test_pins_count_and_overlap(self) -> None:
        m = self.make(2)
        self.fill(m, [1, 2])
        m.prepare_load(keys(1))
        m.prepare_load(keys(1))
        assert m.pins(key(1)) == 2
        m.complete_load(keys(1))
        assert m.prepare_store(keys(3, 4)) is None  # 1 still pinned once
        m.complete_load(keys(1))
        assert m.pins(key(1)) == 0
        assert m.prepare_store(keys(3, 4)) is not None

    def test_completing_more_loads_than_prepared_is_protocol_error(self) -> None:
        m = self.make(4)
        self.fill(m, [1, 2])
        m.prepare_load(keys(1))
        with pytest.raises(ProtocolError):
            m.complete_load(keys(1, 2))  # 2 never pinned: nothing released
        assert m.pins(key(1)) == 1
        m.complete_load(keys(1))
        with pytest.raises(ProtocolError):
            m.complete_load(keys(1))
        with pytest.raises(ProtocolError):
            m.complete_load(keys(9))

    # -- touch -------------------------------------------------------------------------

    def test_touched_block_outlives_the_others(self) -> None:
        m = self.make(3)
        self.fill(m, [1, 2, 3])
        m.touch(keys(3, 99))  # unknown keys are ignored
        plan = m.prepare_store(keys(4, 5))
        assert plan is not None
        assert key(3) not in plan.evicted
        assert m.is_ready(key(3))

    def test_touch_first_key_is_most_recent(self) -> None:
        m = self.make(3)
        self.fill(m, [1, 2, 3])
        m.touch(keys(1, 2, 3))
        m.touch(keys(2, 3))
        plan = m.prepare_store(keys(4))
        assert plan is not None
        assert plan.evicted == (key(1),)
        plan = m.prepare_store(keys(5))
        assert plan is not None
        assert plan.evicted == (key(3),)

    def test_touch_of_block_being_written_is_ignored(self) -> None:
        m = self.make(2)
        assert m.prepare_store(keys(1)) is not None
        m.touch(keys(1))
        assert not m.is_ready(key(1))
        m.complete_store(keys(1))
        assert m.lookup(keys(1)) == 1

    # -- remove ------------------------------------------------------------------------

    def test_remove_ready_block(self) -> None:
        m = self.make(2, events=True)
        self.fill(m, [1, 2])
        m.take_events()
        assert m.remove(keys(9, 1)) == [key(1)]
        assert key(1) not in m
        assert m.take_events() == [BlockRemoved((key(1),), "t")]
        plan = m.prepare_store(keys(3))
        assert plan is not None
        assert plan.evicted == ()

    def test_remove_pinned_block_frees_it_at_last_unpin(self) -> None:
        m = self.make(2, events=True)
        self.fill(m, [1, 2])
        m.take_events()
        m.prepare_load(keys(1))
        m.prepare_load(keys(1))
        assert m.remove(keys(1)) == [key(1)]
        assert m.take_events() == [BlockRemoved((key(1),), "t")]
        assert not m.is_ready(key(1))
        assert m.lookup(keys(1)) == 0
        with pytest.raises(BlockNotFoundError):
            m.prepare_load(keys(1))
        assert m.remove(keys(1)) == []
        assert key(1) in m  # the slot is still read
        assert m.prepare_store(keys(3, 4)) is None
        m.complete_load(keys(1))
        assert key(1) in m
        m.complete_load(keys(1))
        assert key(1) not in m
        assert m.take_events() == []
        assert m.prepare_store(keys(3)) is not None

    def test_remove_then_complete_load_in_either_order(self) -> None:
        m = self.make(2)
        self.fill(m, [1])
        m.prepare_load(keys(1))
        m.complete_load(keys(1))
        m.remove(keys(1))
        assert key(1) not in m
        self.fill(m, [1])
        m.prepare_load(keys(1))
        m.remove(keys(1))
        m.complete_load(keys(1))
        assert key(1) not in m
        assert m.statistics().used == 0

    def test_remove_block_being_written(self) -> None:
        m = self.make(2, events=True)
        assert m.prepare_store(keys(1, 2)) is not None
        assert m.remove(keys(1)) == [key(1)]
        assert key(1) in m
        m.complete_store(keys(1, 2), success=True)
        assert key(1) not in m
        assert m.is_ready(key(2))
        assert m.take_events() == [BlockStored((key(2),), "t")]
        with pytest.raises(ProtocolError):
            m.complete_store(keys(1))

    # -- reset -------------------------------------------------------------------------

    def test_reset_forgets_everything(self) -> None:
        m = self.make(3, events=True)
        self.fill(m, [1, 2])
        m.lookup(keys(1))
        m.take_events()
        m.reset()
        assert len(m) == 0
        s = m.statistics()
        assert (s.used, s.hits, s.misses, s.evictions) == (0, 0, 0, 0)
        [event] = m.take_events()
        assert isinstance(event, BlockRemoved)
        assert set(event.keys) == set(keys(1, 2))
        self.fill(m, [3, 4, 5])
        assert m.lookup(keys(3, 4, 5)) == 3

    @pytest.mark.parametrize("busy", ["pinned", "being-written"])
    def test_reset_refuses_while_busy(self, busy: str) -> None:
        m = self.make(3)
        self.fill(m, [1])
        if busy == "pinned":
            m.prepare_load(keys(1))
        else:
            assert m.prepare_store(keys(2)) is not None
        with pytest.raises(BusyError):
            m.reset()
        assert m.is_ready(key(1))

    # -- events ------------------------------------------------------------------------

    def test_events_in_order(self) -> None:
        m = self.make(2, events=True)
        self.fill(m, [1, 2])
        m.touch(keys(1))
        plan = m.prepare_store(keys(3))
        assert plan is not None
        m.complete_store(keys(3))
        assert m.take_events() == [
            BlockStored(tuple(keys(1, 2)), "t"),
            BlockRemoved(plan.evicted, "t"),
            BlockStored((key(3),), "t"),
        ]
        assert m.take_events() == []

    def test_events_disabled(self) -> None:
        m = self.make(1, events=False)
        self.fill(m, [1])
        self.fill(m, [2])
        m.remove(keys(2))
        assert m.take_events() == []

    def test_events_are_frozen(self) -> None:
        event = BlockStored((key(1),), "t")
        with pytest.raises(AttributeError):
            event.tier = "x"  # type: ignore[misc]

    # -- statistics --------------------------------------------------------------------

    def test_statistics_follow_the_states(self) -> None:
        m = self.make(6)
        self.fill(m, [1, 2, 3])
        assert m.prepare_store(keys(4, 5)) is not None
        m.prepare_load(keys(1, 2))
        m.prepare_load(keys(1))
        s = m.statistics()
        assert s.capacity == 6
        assert s.used == 5 == len(m)
        assert s.ready == 3
        assert s.being_written == 2
        assert s.pinned == 2
        assert s.evictable == 1

    # -- policies ----------------------------------------------------------------------

    def test_policy_instance_serves_one_manager(self) -> None:
        policy = self.make_policy()
        if isinstance(policy, str):
            policy = {"lru": LRUPolicy, "arc": ARCPolicy}[policy]()
        ResidencyManager(2, policy)
        with pytest.raises(InvalidArgumentError):
            ResidencyManager(2, policy)

    def test_slots_are_reused_after_churn(self) -> None:
        m = self.make(4)
        for i in range(0, 40, 2):
            plan = m.prepare_store(keys(i, i + 1))
            assert plan is not None
            assert all(0 <= s < 4 for s in plan.slots)
            m.complete_store(list(plan.keys))
            m.touch(keys(i))
        assert len(m) == 4
        assert m.lookup(keys(38, 39)) == 2  # the last stores cannot have been evicted yet
        slots = [m.slot_of(k) for k in keys(*range(40))]
        assert sorted(s for s in slots if s is not None) == [0, 1, 2, 3]


def serve(m: ResidencyManager, request: list[bytes]) -> int:
    """Play one request the way an engine does; return how many leading blocks hit.

    Loads the ready prefix (pin, unpin), stores the rest, and touches the hit
    prefix after the stores so that it outlives the new tail.
    """
    hits = m.lookup(request)
    if hits:
        m.prepare_load(request[:hits])
        m.complete_load(request[:hits])
    plan = m.prepare_store(request[hits:])
    if plan is not None and plan.keys:
        m.complete_store(list(plan.keys))
    if hits:
        m.touch(request[:hits])
    return hits
