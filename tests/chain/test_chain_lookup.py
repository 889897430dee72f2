"""Lookups as vLLM's scheduler makes them, through the chain alone (fake clock, no I/O).

vLLM looks a waiting request's prefix up key by key once per step, keeps
going past a RETRY (so that every read starts) and stops at the first MISS;
any RETRY or PENDING defers the request to the next step. Under a CPU tier
smaller than the prefix, the chain must still give the request an answer,
and no request may be deferred past ``lookup_deadline_s``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from support.clock import Clock

from kvtier.chain import Answer, Chain, LowerTier, Read, ReadDone, TierChanged, Write, Written

DEADLINE_S = 2.0
STEP_S = 0.05


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def new_chain(rows: int, clock: Clock) -> Chain:
    return Chain(
        rows,
        [LowerTier("file")],
        lookup_deadline_s=DEADLINE_S,
        clock=clock,
    )


def vllm_pass(chain: Chain, request: str, keys: Sequence[bytes]) -> int | None:
    """One step's lookup of a request, as vLLM's ``_maximal_prefix_lookup`` makes it."""
    hits, deferred = 0, False
    for k in keys:
        answer = chain.lookup(k, request)
        if answer is Answer.HIT:
            hits += 1
        elif answer is Answer.PENDING:
            hits += 1
            deferred = True
        elif answer is Answer.RETRY:
            deferred = True
        else:
            break
    return None if deferred else hits


def carry_out(chain: Chain, *, reads_end: bool = True) -> list[Read]:
    """The driver's part of a step: writes succeed; reads deliver unless told not to."""
    held = []
    for intent in chain.take_intents():
        if isinstance(intent, Write):
            chain.settle(Written(intent, frozenset(intent.keys)))
        elif isinstance(intent, Read):
            if reads_end:
                chain.settle(ReadDone(intent, frozenset(intent.keys)))
            else:
                held.append(intent)
    return held


def serve(chain: Chain, request: str, keys: Sequence[bytes], hits: int) -> None:
    """What vLLM does with an answer: pin the hits for the copy to the device."""
    assert all(chain.is_ready(k) for k in keys[:hits])
    chain.pin_for_device_load(keys[:hits])
    chain.unpin_device_load(keys[:hits])
    chain.forget_request(request)


def test_a_prefix_longer_than_the_cpu_tier_loads_its_leading_blocks() -> None:
    clock = Clock(100.0)
    chain = new_chain(4, clock)
    prefix = [key(n) for n in range(23)]
    chain.settle(TierChanged(0, added=tuple(prefix)))  # written through by an earlier request
    steps = 0
    while (hits := vllm_pass(chain, "r1", prefix)) is None:
        carry_out(chain)
        clock.now += STEP_S
        steps += 1
        if steps > 20:
            pytest.fail("the request never got an answer")
    assert hits == 4  # the leading blocks that fit; the rest is recomputed
    assert steps * STEP_S < DEADLINE_S  # answered by the rows, not by the deadline
    serve(chain, "r1", prefix, hits)
    stats = chain.statistics()
    assert stats.lookup_row_limit_misses >= 1
    assert stats.lookup_deadline_misses == 0


def test_a_request_waits_no_longer_than_the_deadline() -> None:
    clock = Clock(100.0)
    chain = new_chain(8, clock)
    prefix = [key(n) for n in range(4)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    steps = 0
    while (hits := vllm_pass(chain, "r1", prefix)) is None:
        carry_out(chain, reads_end=False)  # a stalled tier: reads never end
        clock.now += STEP_S
        steps += 1
        assert steps * STEP_S <= DEADLINE_S + 2 * STEP_S, "waited past the deadline"
    assert hits == 0
    assert chain.statistics().lookup_deadline_misses >= 1


def test_requests_evicting_each_others_promotions_are_all_answered_in_time() -> None:
    # Four requests whose prefixes (6 blocks each) together need three times
    # the CPU tier: promotions of one evict the blocks of another, and each
    # key's wait would start afresh with every eviction. Per request, each is
    # answered within the deadline.
    rng = random.Random(7)
    clock = Clock(100.0)
    chain = new_chain(8, clock)
    prefixes = {f"r{i}": [key(100 * i + n) for n in range(6)] for i in range(4)}
    for p in prefixes.values():
        chain.settle(TierChanged(0, added=tuple(p)))
    waiting = dict.fromkeys(prefixes, 0)
    answered: dict[str, int] = {}
    step = 0
    while waiting:
        step += 1
        assert step < 1000
        order = list(waiting)
        rng.shuffle(order)
        for request in order:
            hits = vllm_pass(chain, request, prefixes[request])
            if hits is None:
                waiting[request] += 1
                assert waiting[request] * STEP_S <= DEADLINE_S + 2 * STEP_S, request
                continue
            serve(chain, request, prefixes[request], hits)
            answered[request] = hits
            del waiting[request]
        carry_out(chain)
        clock.now += STEP_S
    assert set(answered) == set(prefixes)
    assert sum(answered.values()) > 0  # most are served from the tiers, not recomputed


def test_a_request_answered_waits_afresh_when_it_comes_back() -> None:
    clock = Clock(100.0)
    chain = new_chain(4, clock)
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    carry_out(chain)
    assert vllm_pass(chain, "r1", prefix) == 2
    # Long after (preempted, then resumed), its blocks evicted meanwhile by
    # other requests' stores, which fill every row:
    clock.now += 10 * DEADLINE_S
    plan = chain.place([key(n) for n in range(100, 104)])
    assert plan is not None
    assert set(plan.evicted) == set(prefix)
    chain.stored(plan.keys, True)
    carry_out(chain)
    assert vllm_pass(chain, "r1", prefix) is None  # a new wait, not past the old deadline
    carry_out(chain)
    assert vllm_pass(chain, "r1", prefix) == 2


# -- a CPU tier smaller than the working set (issue 51) ----------------------------------

ROW_WAIT_S = 0.1
HOLD_S = 0.5


def small_chain(rows: int, clock: Clock) -> Chain:
    return Chain(
        rows,
        [LowerTier("file")],
        lookup_deadline_s=DEADLINE_S,
        row_wait_s=ROW_WAIT_S,
        hold_s=HOLD_S,
        clock=clock,
    )


def test_a_lookup_never_waits_for_a_row_it_cannot_get_soon() -> None:
    clock = Clock(100.0)
    chain = small_chain(4, clock)
    busy = [key(n) for n in range(100, 104)]
    plan = chain.place(busy)
    assert plan is not None
    chain.stored(plan.keys, True)
    carry_out(chain)
    chain.pin_for_device_load(busy)  # every row held by device copies that go on
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    steps = 0
    while (hits := vllm_pass(chain, "r1", prefix)) is None:
        carry_out(chain)
        clock.now += STEP_S
        steps += 1
        assert steps * STEP_S <= ROW_WAIT_S + 2 * STEP_S, "waited for a row past row_wait_s"
    assert hits == 0  # recomputed at once, not after lookup_deadline_s
    stats = chain.statistics()
    assert stats.lookup_deadline_misses == 0
    assert stats.lookup_row_limit_misses >= 1
    # Once the rows are free again, the next request's lookups read the blocks.
    chain.unpin_device_load(busy)
    while (hits := vllm_pass(chain, "r2", prefix)) is None:
        carry_out(chain)
        clock.now += STEP_S
    assert hits == 2


def test_a_request_revisited_late_after_its_read_found_no_row_is_a_row_miss() -> None:
    # vLLM comes back to the request 5 s later (past lookup_deadline_s): its
    # wait was for rows, so the key is a row miss, not a late tier, and the
    # request does not wait again for a read queued that moment.
    clock = Clock(100.0)
    chain = small_chain(4, clock)
    busy = [key(n) for n in range(100, 104)]
    plan = chain.place(busy)
    assert plan is not None
    chain.stored(plan.keys, True)
    carry_out(chain)
    chain.pin_for_device_load(busy)  # every row held by device copies that go on
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    for _ in range(4):  # the reads find no row within row_wait_s
        carry_out(chain)
        clock.now += STEP_S
    clock.now += 5.0
    assert vllm_pass(chain, "r1", prefix) == 0  # recomputed now
    stats = chain.statistics()
    assert stats.lookup_deadline_misses == 0
    assert stats.lookup_row_limit_misses == 1


def test_a_promotion_is_held_for_its_request_until_it_loads_it() -> None:
    clock = Clock(100.0)
    chain = small_chain(4, clock)
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    carry_out(chain)  # the reads deliver: the blocks wait for r1
    assert all(chain.pins(k) == 1 for k in prefix)
    # Another request's store needs every row before r1 is scheduled: the held
    # blocks are not evicted for it (it gets the two free rows).
    plan = chain.place([key(n) for n in range(100, 104)])
    assert plan is not None
    assert len(plan.keys) == 2
    assert not set(plan.evicted) & set(prefix)
    chain.stored(plan.keys, True)
    carry_out(chain)
    assert vllm_pass(chain, "r1", prefix) == 2
    serve(chain, "r1", prefix, 2)  # loaded: the holds end with the device copy's pin
    assert all(chain.pins(k) == 0 for k in prefix)
    plan = chain.place([key(n) for n in range(200, 204)])
    assert plan is not None
    assert set(prefix) <= set(plan.evicted)  # evictable like any block now


def test_a_hold_ends_when_its_request_does_not_come_back() -> None:
    clock = Clock(100.0)
    chain = small_chain(2, clock)
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    carry_out(chain)
    assert chain.place([key(100)]) is None  # both rows held for r1
    clock.now += HOLD_S
    plan = chain.place([key(100)])  # r1 was never scheduled: its rows free
    assert plan is not None
    assert plan.evicted


def test_a_request_the_engine_revisits_seconds_later_still_finds_its_blocks() -> None:
    # vLLM revisits a deferred request 3-7 s apart on a loaded host. Past its
    # firm hold, the delivered block is kept for it while placements find rows
    # elsewhere: blocks used more recently, but needed by no waiting request,
    # are evicted first.
    clock = Clock(100.0)
    chain = small_chain(4, clock)
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    carry_out(chain)  # delivered and held for r1
    clock.now += 1.0
    other = [key(n) for n in range(50, 52)]
    plan = chain.place(other)
    assert plan is not None
    chain.stored(plan.keys, True)
    carry_out(chain)
    assert vllm_pass(chain, "r2", other) == 2  # used after r1's blocks arrived
    serve(chain, "r2", other, 2)
    clock.now += 4.0  # r1 not back yet: past hold_s and lookup_deadline_s
    plan = chain.place([key(n) for n in range(60, 62)])
    assert plan is not None
    assert set(plan.evicted) == set(other)
    chain.stored(plan.keys, True)
    carry_out(chain)
    assert vllm_pass(chain, "r1", prefix) == 2
    serve(chain, "r1", prefix, 2)
    assert chain.statistics().lookup_deadline_misses == 0


def test_a_request_whose_delivered_blocks_went_to_stores_reads_them_again_in_time() -> None:
    # The CPU tier is so small that a store needs the rows kept for r1: they
    # yield (past hold_s). When r1 comes back, its gap between passes was
    # vLLM's, not kvtier's: it waits afresh for the blocks read again, once.
    clock = Clock(100.0)
    chain = small_chain(2, clock)
    prefix = [key(n) for n in range(2)]
    chain.settle(TierChanged(0, added=tuple(prefix)))
    assert vllm_pass(chain, "r1", prefix) is None
    carry_out(chain)
    clock.now += 1.0
    plan = chain.place([key(100), key(101)])  # no other row: the kept blocks yield
    assert plan is not None
    assert set(plan.evicted) == set(prefix)
    chain.stored(plan.keys, True)
    carry_out(chain)
    clock.now += 2.0  # r1 is back 3 s after its first pass
    assert vllm_pass(chain, "r1", prefix) is None  # read again, not a deadline miss
    carry_out(chain)
    clock.now += STEP_S
    assert vllm_pass(chain, "r1", prefix) == 2
    assert chain.statistics().lookup_deadline_misses == 0


def test_many_users_on_a_small_cpu_tier_are_answered_without_waiting_out_the_deadline() -> None:
    # Twelve users with prefixes in the file tier over a CPU tier of eight rows:
    # every request stores two new blocks (rows held while written through);
    # device copies and writes take a step. No request waits for rows past
    # row_wait_s plus its reads' steps, no lookup waits out the deadline, and
    # the tiers still serve blocks.
    rng = random.Random(3)
    clock = Clock(100.0)
    chain = small_chain(8, clock)
    prefixes = {f"u{i}": [key(1000 * i + n) for n in range(4)] for i in range(12)}
    for p in prefixes.values():
        chain.settle(TierChanged(0, added=tuple(p)))
    since: dict[str, int] = {}
    loads: list[tuple[int, list[bytes]]] = []
    served = 0
    for step in range(200):
        for user in rng.sample(list(prefixes), len(prefixes)):
            request = f"{user}-{since.setdefault(user, step)}"
            hits = vllm_pass(chain, request, prefixes[user])
            if hits is None:
                assert (step - since[user]) * STEP_S <= ROW_WAIT_S + 4 * STEP_S, user
                continue
            del since[user]
            if hits:
                chain.pin_for_device_load(prefixes[user][:hits])
                loads.append((step + 1, prefixes[user][:hits]))
                served += hits
            new = [key(10**6 + step * 100 + int(user[1:]) * 2 + j) for j in range(2)]
            plan = chain.place(new, keep=prefixes[user][:hits])
            if plan is not None:
                chain.stored(plan.keys, True)
            chain.forget_request(request)
        for _end, ks in [x for x in loads if x[0] <= step]:
            chain.unpin_device_load(ks)
        loads = [x for x in loads if x[0] > step]
        carry_out(chain)
        clock.now += STEP_S
    assert chain.statistics().lookup_deadline_misses == 0
    assert served > 0
