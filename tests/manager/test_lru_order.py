"""LRU's order is exact: a long random protocol against an ``OrderedDict`` model.

The policy keeps its order in a log that is trimmed and compacted as it grows
(see :mod:`kvtier.manager.policies`); this replays enough calls on small
managers that both happen many times, with pins, removals and failed stores in
between, and checks every eviction against the model's least recently used
unpinned blocks.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvtier.manager import ResidencyManager
from kvtier.testing.manager import key


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize(("capacity", "seed"), [(1, 0), (5, 1), (16, 2), (64, 3)])
def test_lru_evicts_exactly_the_least_recently_used(capacity: int, seed: int, native: bool) -> None:
    rng = random.Random(seed)
    m = ResidencyManager(capacity, "lru", native=native)
    universe = [key(i) for i in range(3 * capacity + 2)]
    order: OrderedDict[bytes, None] = OrderedDict()  # ready blocks, least recent first
    writing: list[bytes] = []
    pins: dict[bytes, int] = {}
    for step in range(20000):
        op = rng.random()
        ks = rng.sample(universe, rng.randint(1, min(6, len(universe))))
        if step // 2500 % 2 and order:
            # Phases of touches and loads only: the log outgrows its limit and compacts.
            op = 0.65 + 0.28 * op
            ks = rng.sample(list(order), rng.randint(1, min(6, len(order))))
        if op < 0.45:
            present = set(order) | set(writing)
            new = [k for k in ks if k not in present]
            free = capacity - len(order) - len(writing)
            need = max(0, len(new) - free)
            victims = [k for k in order if k not in pins and k not in ks][:need]
            plan = m.prepare_store(ks)
            if len(victims) < need:
                assert plan is None
                continue
            assert plan is not None
            assert list(plan.keys) == new
            assert list(plan.evicted) == victims
            for k in victims:
                del order[k]
            writing += new
        elif op < 0.65 and writing:
            done = rng.sample(writing, rng.randint(1, len(writing)))
            success = rng.random() < 0.9
            m.complete_store(done, success=success)
            writing = [k for k in writing if k not in done]
            if success:
                for k in reversed(done):  # the first key ends up most recent
                    order[k] = None
        elif op < 0.85:
            ready = [k for k in ks if k in order]
            m.touch(ks)
            for k in reversed(ready):
                order.move_to_end(k)
        elif op < 0.93:
            ready = [k for k in ks if k in order]
            if pins and rng.random() < 0.6:
                done = rng.sample(sorted(pins), rng.randint(1, len(pins)))
                m.complete_load(done)
                for k in done:
                    pins[k] -= 1
                    if not pins[k]:
                        del pins[k]
            elif ready:
                m.prepare_load(ready)
                for k in ready:
                    pins[k] = pins.get(k, 0) + 1
        else:
            gone = [k for k in ks if k in order and k not in pins]
            assert m.remove(gone) == gone
            for k in gone:
                del order[k]
    assert m.statistics().ready == len(order)
