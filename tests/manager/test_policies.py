"""Scenarios that pin down what each policy evicts: LRU order, ARC's lists, scan resistance."""

from __future__ import annotations

import random

import pytest

from kvtier.manager import ARCPolicy, ResidencyManager
from kvtier.manager.native import NativePolicy
from kvtier.manager.policies import _Recency
from kvtier.testing.manager import key, keys, serve


def store(m: ResidencyManager, *ids: int) -> None:
    plan = m.prepare_store(keys(*ids))
    assert plan is not None
    m.complete_store(list(plan.keys))


def evicted_by(m: ResidencyManager, *ids: int) -> list[bytes]:
    plan = m.prepare_store(keys(*ids))
    assert plan is not None
    m.complete_store(list(plan.keys))
    return list(plan.evicted)


@pytest.fixture(autouse=True, params=["native", "python"])
def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every scenario runs on the compiled core and on the pure-Python manager."""
    if request.param == "python":
        monkeypatch.setenv("KVTIER_MANAGER", "python")
    else:
        monkeypatch.delenv("KVTIER_MANAGER", raising=False)
    return str(request.param)


def arc(m: ResidencyManager) -> ARCPolicy | NativePolicy:
    policy = m.policy
    assert isinstance(policy, ARCPolicy) or (
        isinstance(policy, NativePolicy) and policy.name == "arc"
    )
    return policy


# -- LRU ---------------------------------------------------------------------------------


def test_lru_evicts_in_order_of_last_use() -> None:
    m = ResidencyManager(4, "lru")
    for i in range(4):
        store(m, i)
    m.touch(keys(1))
    m.touch(keys(0))
    assert evicted_by(m, 10, 11) == keys(2, 3)
    assert evicted_by(m, 12) == keys(1)
    assert evicted_by(m, 13, 14, 15) == keys(0, 11, 10)  # 10 was stored first


def test_lru_store_keeps_the_first_key_longest() -> None:
    m = ResidencyManager(4, "lru")
    store(m, 0, 1, 2, 3)  # 0 is the most recent: prefixes outlive their tails
    assert evicted_by(m, 10) == keys(3)
    assert evicted_by(m, 11, 12) == keys(2, 1)


def test_lru_passes_over_pinned_blocks_without_reordering_them() -> None:
    m = ResidencyManager(3, "lru")
    for i in range(3):
        store(m, i)
    m.prepare_load(keys(0))
    assert evicted_by(m, 10) == keys(1)
    m.complete_load(keys(0))
    assert evicted_by(m, 11) == keys(0)  # still the oldest use


def test_lru_order_survives_log_compaction() -> None:
    # Touching far more often than capacity forces the recency log to compact.
    m = ResidencyManager(8, "lru")
    for i in range(8):
        store(m, i)
    for _ in range(3000):
        m.touch(keys(5, 6))
    m.touch(keys(7))
    assert evicted_by(m, 20, 21, 22, 23, 24, 25) == keys(0, 1, 2, 3, 4, 6)


# -- ARC ---------------------------------------------------------------------------------


def test_arc_second_use_promotes_t1_to_t2() -> None:
    m = ResidencyManager(4, "arc")
    store(m, 1, 2, 3)
    policy = arc(m)
    assert (policy.t1_size, policy.t2_size) == (3, 0)
    m.touch(keys(2))
    assert (policy.t1_size, policy.t2_size) == (2, 1)
    slot = m.slot_of(key(2))
    assert slot is not None
    assert policy.in_t2(slot)
    m.touch(keys(2, 3))
    assert (policy.t1_size, policy.t2_size) == (1, 2)


def test_arc_evicts_t1_before_t2_while_the_target_is_zero() -> None:
    m = ResidencyManager(4, "arc")
    store(m, 1, 2, 3, 4)
    m.touch(keys(4))  # the least recent overall, but now in T2
    assert evicted_by(m, 5, 6) == keys(3, 2)
    assert arc(m).b1_size == 2


def test_arc_b1_ghost_hit_raises_the_target_and_enters_t2() -> None:
    m = ResidencyManager(4, "arc")
    store(m, 1, 2, 3, 4)
    m.touch(keys(3, 4))
    assert evicted_by(m, 5) == keys(2)
    policy = arc(m)
    assert policy.target == 0
    assert policy.b1_size == 1
    # 2 is a B1 ghost: T1 was too small for it. T1 (1, 5) is still above the
    # new target of 1, so T1's least recent block makes room.
    assert evicted_by(m, 2) == keys(1)
    assert policy.target == 1
    assert policy.b1_size == 1  # 2's ghost went, 1's came
    slot = m.slot_of(key(2))
    assert slot is not None
    assert policy.in_t2(slot)


def test_arc_b2_ghost_hit_lowers_the_target() -> None:
    m = ResidencyManager(2, "arc")
    store(m, 1, 2)
    m.touch(keys(1, 2))  # both in T2, T1 empty
    policy = arc(m)
    assert evicted_by(m, 3) == keys(2)  # from T2 (T1 empty) -> B2 ghost
    assert policy.b2_size == 1
    assert evicted_by(m, 4) == keys(3)  # T1 holds 3 and the target is 0 -> B1 ghost
    # B1 hit: target 0 -> 1. T1 (4) is not above it: T2 gives 1, and 3 enters T2.
    assert evicted_by(m, 3) == keys(1)
    assert policy.target == 1
    assert (policy.t1_size, policy.t2_size, policy.b2_size) == (1, 1, 2)
    # B2 hit: target back to 0, so T1 gives 4.
    assert evicted_by(m, 2) == keys(4)
    assert policy.target == 0
    assert (policy.t1_size, policy.t2_size, policy.b1_size) == (0, 2, 1)


def test_arc_forgets_ghosts_of_removed_and_failed_blocks() -> None:
    m = ResidencyManager(2, "arc")
    store(m, 1, 2)
    m.remove(keys(1))
    plan = m.prepare_store(keys(3))
    assert plan is not None
    m.complete_store(list(plan.keys), success=False)
    policy = arc(m)
    assert (policy.b1_size, policy.b2_size, policy.t1_size) == (0, 0, 1)


# -- scan resistance ---------------------------------------------------------------------


def hot_hit_rate(policy: str) -> float:
    """Hit rate of a hot working set while a one-pass scan streams through.

    Capacity 100, hot set 60 blocks in steady use, and a scan of 3000 blocks
    each seen once, ten scan blocks between two hot requests: between two uses
    of the same hot block, 600 scan blocks go by, more than the capacity.
    """
    m = ResidencyManager(100, policy)
    hot = keys(*range(60))
    for _ in range(2):
        for k in hot:
            serve(m, [k])
    hits = total = 0
    scan = iter(keys(*range(1000, 4000)))
    for _ in range(5):
        for k in hot:
            for _ in range(10):
                serve(m, [next(scan)])
            hits += serve(m, [k])
            total += 1
    return hits / total


def test_arc_resists_a_scan_that_flushes_lru() -> None:
    lru = hot_hit_rate("lru")
    arc_rate = hot_hit_rate("arc")
    assert lru < 0.05
    assert arc_rate > 0.95
    assert arc_rate - lru > 0.9


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_hot_set_that_fits_always_hits(policy: str) -> None:
    m = ResidencyManager(100, policy)
    hot = keys(*range(50))
    for k in hot:
        serve(m, [k])
    assert all(serve(m, [k]) == 1 for k in hot * 3)


def _reference_compaction(log: list[int], state: list[int]) -> tuple[list[int], list[int]]:
    """The recency log's compaction written plainly: each member once, by its latest use."""
    latest = dict.fromkeys(reversed(log))
    keep = [s for s in latest if state[s] & 1]
    keep.reverse()
    return keep, [(v & 1) * 3 for v in state]


@pytest.mark.parametrize("seed", range(40))
def test_recency_compaction_matches_the_plain_algorithm(seed: int) -> None:
    # The compaction is vectorised (a 3M-entry log took 2 s in Python, stalling
    # the event loop); it must keep exactly the order the plain version keeps.
    rng = random.Random(seed)
    capacity = rng.choice([1, 7, 64, 500])
    rec = _Recency(capacity)
    members: set[int] = set()
    for _ in range(rng.randint(1, 400)):
        op = rng.random()
        if op < 0.35:
            fresh = [s for s in rng.sample(range(capacity), k=min(capacity, 3)) if s not in members]
            rec.add(fresh)
            members.update(fresh)
        elif op < 0.7 and members:
            used = rng.sample(sorted(members), k=min(len(members), 4))
            for s in used:
                rec.state[s] += 2
            rec.append(used)
        elif op < 0.85 and members:
            s = rng.choice(sorted(members))
            assert rec.drop(s)
            members.discard(s)
        elif members:
            pins = set(rng.sample(sorted(members), k=len(members) // 3))
            out: list[int] = []
            rec.take(rng.randint(1, 3), pins, out)
            members.difference_update(out)
        if rng.random() < 0.1:
            want_log, want_state = _reference_compaction(list(rec.log[rec.head :]), rec.state)
            rec.compact()
            assert list(rec.log) == want_log
            assert rec.head == 0
            assert rec.state == want_state
    assert rec.size == len(members)
