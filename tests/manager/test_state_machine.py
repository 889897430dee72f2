"""Random protocol sequences against a plain model of the states, for both policies.

The model cannot know which block a policy picks, so it checks each eviction
the manager reports: exactly as many as needed, each one ready, unpinned and not
named by the call. Everything else (hits, states, pins, errors, counters) the
model predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtier.errors import BlockNotFoundError, BusyError, ProtocolError
from kvtier.manager import ResidencyManager
from kvtier.testing.manager import key

UNIVERSE = [key(i) for i in range(6)]
some_keys = st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=4)


@dataclass
class Block:
    """The model's view of one block."""

    state: str
    """"writing", "ready", "removed-writing" or "removed-pinned"."""
    pins: int = 0


class ManagerMachine(RuleBasedStateMachine):
    policy = "lru"
    native: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        self.m = ResidencyManager(1, self.policy, native=self.native)
        self.capacity = 1
        self.model: dict[bytes, Block] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @initialize(capacity=st.integers(1, 4))
    def start(self, capacity: int) -> None:
        self.m = ResidencyManager(capacity, self.policy, enable_events=True, native=self.native)
        self.capacity = capacity

    def ready(self, k: bytes) -> bool:
        b = self.model.get(k)
        return b is not None and b.state == "ready"

    # -- rules ---------------------------------------------------------------------------

    @rule(ks=some_keys)
    def lookup(self, ks: list[bytes]) -> None:
        expect = 0
        for k in ks:
            if not self.ready(k):
                break
            expect += 1
        assert self.m.lookup(ks) == expect
        self.hits += expect
        self.misses += len(ks) - expect

    @rule(ks=some_keys)
    def prepare_store(self, ks: list[bytes]) -> None:
        new = [k for k in ks if k not in self.model]
        free = self.capacity - len(self.model)
        evictable = {
            k for k, b in self.model.items() if b.state == "ready" and not b.pins and k not in ks
        }
        need = max(0, len(new) - free)
        plan = self.m.prepare_store(ks)
        if need > len(evictable):
            assert plan is None
            return
        assert plan is not None
        assert list(plan.keys) == new
        assert len(plan.evicted) == need
        assert set(plan.evicted) <= evictable  # never pinned, written, or in the call
        for k in plan.evicted:
            del self.model[k]
        self.evictions += need
        for k in new:
            self.model[k] = Block("writing")

    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        writing = [k for k, b in self.model.items() if b.state.endswith("writing")]
        if not writing:
            return
        ks = data.draw(st.lists(st.sampled_from(writing), unique=True, min_size=1))
        self.m.complete_store(ks, success=success)
        for k in ks:
            if success and self.model[k].state == "writing":
                self.model[k].state = "ready"
            else:
                del self.model[k]

    @rule(k=st.sampled_from(UNIVERSE))
    def complete_store_misuse(self, k: bytes) -> None:
        if k in self.model and self.model[k].state.endswith("writing"):
            return
        with pytest.raises(ProtocolError):
            self.m.complete_store([k])

    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ready = [k for k in self.model if self.ready(k)]
        if not ready:
            return
        ks = data.draw(st.lists(st.sampled_from(ready), unique=True, min_size=1))
        plan = self.m.prepare_load(ks)
        assert plan.keys == tuple(ks)
        for k in ks:
            self.model[k].pins += 1

    @rule(ks=some_keys)
    def prepare_load_any(self, ks: list[bytes]) -> None:
        if all(self.ready(k) for k in ks):
            self.m.prepare_load(ks)
            for k in ks:
                self.model[k].pins += 1
        else:
            with pytest.raises(BlockNotFoundError):
                self.m.prepare_load(ks)

    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = [k for k, b in self.model.items() if b.pins]
        if not pinned:
            return
        ks = data.draw(st.lists(st.sampled_from(pinned), unique=True, min_size=1))
        self.m.complete_load(ks)
        for k in ks:
            b = self.model[k]
            b.pins -= 1
            if not b.pins and b.state == "removed-pinned":
                del self.model[k]

    @rule(k=st.sampled_from(UNIVERSE))
    def complete_load_misuse(self, k: bytes) -> None:
        if k in self.model and self.model[k].pins:
            return
        with pytest.raises(ProtocolError):
            self.m.complete_load([k])

    @rule(ks=some_keys)
    def touch(self, ks: list[bytes]) -> None:
        self.m.touch(ks)

    @rule(ks=some_keys)
    def remove(self, ks: list[bytes]) -> None:
        expect = []
        for k in ks:
            b = self.model.get(k)
            if b is None or b.state.startswith("removed"):
                continue
            expect.append(k)
            if b.state == "writing":
                b.state = "removed-writing"
            elif b.pins:
                b.state = "removed-pinned"
            else:
                del self.model[k]
        assert self.m.remove(ks) == expect

    @rule()
    def reset(self) -> None:
        if any(b.pins or b.state.endswith("writing") for b in self.model.values()):
            with pytest.raises(BusyError):
                self.m.reset()
            return
        self.m.reset()
        self.model.clear()
        self.hits = self.misses = self.evictions = 0

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def slots_unique_and_in_range(self) -> None:
        slots = [self.m.slot_of(k) for k in self.model]
        assert None not in slots
        assert len(set(slots)) == len(slots)
        assert all(s is not None and 0 <= s < self.capacity for s in slots)
        for k in UNIVERSE:
            assert (k in self.m) == (k in self.model)
            assert self.m.is_ready(k) == self.ready(k)

    @invariant()
    def statistics_agree(self) -> None:
        s = self.m.statistics()
        blocks = self.model.values()
        assert s.used == len(self.model) == len(self.m) <= self.capacity
        assert s.ready == sum(b.state == "ready" for b in blocks)
        assert s.being_written == sum(b.state.endswith("writing") for b in blocks)
        assert s.pinned == sum(b.pins > 0 for b in blocks)
        assert s.evictable == sum(b.state == "ready" and not b.pins for b in blocks)
        assert (s.hits, s.misses, s.evictions) == (self.hits, self.misses, self.evictions)


class ARCMachine(ManagerMachine):
    policy = "arc"


class PythonLRUMachine(ManagerMachine):
    native = False


class PythonARCMachine(ManagerMachine):
    policy = "arc"
    native = False


_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLRUStateMachine = ManagerMachine.TestCase
TestLRUStateMachine.settings = _SETTINGS
TestARCStateMachine = ARCMachine.TestCase
TestARCStateMachine.settings = _SETTINGS
TestPythonLRUStateMachine = PythonLRUMachine.TestCase
TestPythonLRUStateMachine.settings = _SETTINGS
TestPythonARCStateMachine = PythonARCMachine.TestCase
TestPythonARCStateMachine.settings = _SETTINGS
