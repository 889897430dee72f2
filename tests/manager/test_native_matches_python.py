"""The compiled core behaves as the pure-Python manager, call for call.

Long seeded random protocols (stores that fail, loads that overlap, removals of
busy blocks, bad calls, resets) play on a native and a Python manager side by
side. After every call both must have returned the same thing (plans, slots,
victims, or the same error with the same message), recorded the same events,
and agree on every key's slot, state and pins, on the counters and, under ARC,
on the target and the sizes of T1, T2, B1 and B2. The differences that would
show: another victim, another slot, a ghost missed or invented, a pin lost.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.manager import ARCPolicy, ResidencyManager
from kvtier.manager.native import NativePolicy, NativeResidencyManager
from kvtier.testing.manager import key


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", call())
    except Exception as exc:  # the comparison is the point
        return ("error", type(exc).__name__, str(exc))


def policy_state(m: ResidencyManager) -> tuple[Any, ...]:
    p = m.policy
    if isinstance(p, (ARCPolicy, NativePolicy)) and (isinstance(p, ARCPolicy) or p.name == "arc"):
        return (p.target, p.t1_size, p.t2_size, p.b1_size, p.b2_size)
    return ()


class Pair:
    """A native and a Python manager driven with the same calls."""

    def __init__(self, capacity: int, policy: str, universe: list[bytes]) -> None:
        self.native = ResidencyManager(capacity, policy, enable_events=True, native=True)
        self.python = ResidencyManager(capacity, policy, enable_events=True, native=False)
        assert type(self.native) is NativeResidencyManager
        assert type(self.python) is ResidencyManager
        self.universe = universe
        self.calls = 0

    def call(self, name: str, *args: Any) -> Any:
        self.calls += 1
        got = outcome(lambda: getattr(self.native, name)(*args))
        want = outcome(lambda: getattr(self.python, name)(*args))
        assert got == want, f"call {self.calls}: {name}{args!r}"
        self.compare()
        return want[1] if want[0] == "ok" else None

    def compare(self) -> None:
        n, p = self.native, self.python
        assert n.take_events() == p.take_events()
        assert n.statistics() == p.statistics()
        assert len(n) == len(p)
        assert policy_state(n) == policy_state(p)
        for k in self.universe:
            assert (k in n, n.is_ready(k), n.slot_of(k), n.pins(k)) == (
                k in p,
                p.is_ready(k),
                p.slot_of(k),
                p.pins(k),
            ), k


def play(capacity: int, policy: str, seed: int, steps: int) -> tuple[int, int]:
    """Play ``steps`` random calls on a pair; returns (calls made, plans that evicted)."""
    rng = random.Random(seed)
    universe = [key(i) for i in range(capacity * 3 + 4)]
    pair = Pair(capacity, policy, universe)
    writing: list[bytes] = []
    pinned: list[bytes] = []
    evicting = 0
    for _ in range(steps):
        op = rng.random()
        some = rng.sample(universe, rng.randint(0, min(len(universe), 2 * capacity + 2)))
        if op < 0.05 and some:
            some.append(some[0])  # a duplicate: refused
        if op < 0.22:
            plan = pair.call("prepare_store", some)
            if plan is not None:
                writing.extend(plan.keys)
                evicting += bool(plan.evicted)
        elif op < 0.40 and writing:
            rng.shuffle(writing)
            cut = rng.randint(1, len(writing))
            done, writing = writing[:cut], writing[cut:]
            pair.call("complete_store", done, rng.random() < 0.85)
        elif op < 0.47 and len(pinned) <= capacity // 2 + 1:
            ready = [k for k in some if pair.python.is_ready(k)]
            if rng.random() < 0.1:
                ready.append(rng.choice(universe))  # maybe not ready: refused
            if pair.call("prepare_load", list(dict.fromkeys(ready))) is not None:
                pinned.extend(dict.fromkeys(ready))
        elif (op < 0.62 or len(pinned) > capacity // 2 + 1) and pinned:
            # Released often enough that most blocks stay evictable.
            rng.shuffle(pinned)
            done = list(dict.fromkeys(pinned[: rng.randint(1, len(pinned))]))
            for k in done:
                pinned.remove(k)
            if rng.random() < 0.05:
                done.append(rng.choice(universe))  # maybe not pinned: refused
                if pair.call("complete_load", done) is None:
                    for k in done[:-1]:
                        pinned.append(k)
                continue
            pair.call("complete_load", done)
        elif op < 0.80:
            pair.call("lookup", some)
            pair.call("touch", some[: len(some) // 2 + 1])
        elif op < 0.90:
            pair.call("touch", tuple(some))
        elif op < 0.97:
            pair.call("remove", some[:3])
        else:
            pair.call("reset")
    return pair.calls, evicting


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize(("capacity", "seed"), [(1, 1), (3, 2), (8, 3), (32, 4), (200, 5)])
def test_random_protocols_agree(policy: str, capacity: int, seed: int) -> None:
    calls, evicting = play(capacity, policy, seed, steps=1500)
    assert calls > 1500
    assert evicting > 10  # the comparison covered eviction


def test_arc_ghost_fingerprints_are_zlib_crc32() -> None:
    import zlib

    from kvtier.manager import _native

    rng = random.Random(7)
    for n in (0, 1, 16, 33):
        k = rng.randbytes(n)
        assert _native.crc32(k) == zlib.crc32(k)


def test_large_churn_agrees() -> None:
    # Enough keys through a 4096-slot ARC that ghosts collide in the table.
    rng = random.Random(11)
    n = ResidencyManager(4096, "arc", native=True)
    p = ResidencyManager(4096, "arc", native=False)
    hot = [rng.randbytes(16) for _ in range(3000)]
    for i in range(3000):
        req = rng.sample(hot, 8) if i % 3 else [rng.randbytes(16) for _ in range(24)]
        for m in (n, p):
            h = m.lookup(req)
            if h:
                m.touch(req[:h])
            plan = m.prepare_store(req[h:])
            assert plan is not None
            m.complete_store(list(plan.keys))
        assert n.statistics() == p.statistics()
    assert policy_state(n) == policy_state(p)
    assert [n.slot_of(k) for k in hot] == [p.slot_of(k) for k in hot]
