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
