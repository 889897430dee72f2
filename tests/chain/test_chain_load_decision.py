"""Loads that never lose to recompute: the chain's decision alone (fake clock, no I/O).

A lower tier's block is worth reading only if it arrives before recomputing
it would end. The chain knows both sides from what it sees: each tier's
delivered seconds per block (its reads' busy time), the blocks queued on it,
and the cost of a block's compute (set, or measured from the time between a
store's placement and its end under vLLM). No timing is asserted: the clock
is the test's.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from support.clock import Clock

from kvtier.chain import (
    REMEASURE_S,
    Answer,
    Chain,
    LowerTier,
    Read,
    ReadDone,
    TierChanged,
    Write,
    Written,
)


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def new_chain(
    clock: Clock, *, recompute: float | None, decide: bool = True, measure: bool = False
) -> Chain:
    return Chain(
        64,
        [LowerTier("file")],
        lookup_deadline_s=60.0,
        decline_slow_loads=decide,
        recompute_s_per_block=recompute,
        measure_recompute=measure,
        clock=clock,
    )


def read_taking(chain: Chain, clock: Clock, names: Sequence[int], seconds: float) -> None:
    """Look ``names`` up (one request), and have their read take ``seconds``."""
    for n in names:
        assert chain.lookup(key(n), "warm-up") is Answer.RETRY
    reads = [i for i in chain.take_intents() if isinstance(i, Read)]
    assert reads
    clock.now += seconds
    for r in reads:
        chain.settle(ReadDone(r, frozenset(r.keys)))
    chain.forget_request("warm-up")


def on_file(chain: Chain, names: Sequence[int]) -> None:
    chain.settle(TierChanged(0, added=tuple(key(n) for n in names)))


def test_a_tier_slower_than_recompute_is_declined() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(10))
    read_taking(chain, clock, [0, 1], seconds=0.5)  # 250 ms a block: slower than 10 ms
    assert chain.statistics().tiers["file"].read_seconds_per_block == pytest.approx(0.25)
    assert chain.lookup(key(5), "r") is Answer.MISS
    st = chain.statistics()
    assert st.loads_declined == 1
    assert st.tiers["file"].loads_declined == 1
    assert chain.take_intents() == []  # nothing read for it


def test_a_tier_faster_than_recompute_is_read() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(10))
    read_taking(chain, clock, [0, 1], seconds=0.002)  # 1 ms a block
    assert chain.lookup(key(5), "r") is Answer.RETRY
    assert chain.statistics().loads_declined == 0


def test_the_queue_ahead_counts() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(100))
    read_taking(chain, clock, [0], seconds=0.004)  # 4 ms a block: worth it alone
    # Forty blocks queued on the tier by another request: a new block would
    # wait for them, (40 + 1) * 4 ms, far past recomputing it.
    for n in range(10, 50):
        assert chain.lookup(key(n), "busy") is Answer.RETRY
    chain.take_intents()  # their reads are in flight now
    assert chain.lookup(key(60), "r") is Answer.MISS
    assert chain.statistics().loads_declined == 1


def test_a_requests_own_blocks_count_as_they_add_up() -> None:
    # 8 ms a block against 10 ms: each of a request's blocks is worth reading
    # (m * 8 <= m * 10), however many.
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(20))
    read_taking(chain, clock, [0], seconds=0.008)
    answers = [chain.lookup(key(n), "r") for n in range(1, 11)]
    assert answers == [Answer.RETRY] * 10


def test_without_a_measure_nothing_is_declined() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=None)  # the Engine, without a set cost
    on_file(chain, range(10))
    read_taking(chain, clock, [0], seconds=10.0)
    assert chain.lookup(key(5), "r") is Answer.RETRY
    # ... and before a tier's first read, a set cost declines nothing either.
    fresh = new_chain(clock, recompute=1e-9)
    on_file(fresh, range(10))
    assert fresh.lookup(key(5), "r") is Answer.RETRY


def test_off_means_off() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.001, decide=False)
    on_file(chain, range(10))
    read_taking(chain, clock, [0], seconds=1.0)
    assert chain.lookup(key(5), "r") is Answer.RETRY
    assert chain.statistics().loads_declined == 0


def test_the_recompute_cost_is_measured_from_stores() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=None, measure=True)
    plan = chain.place([key(n) for n in range(100, 110)])
    assert plan is not None
    clock.now += 0.2  # the step that computed those 10 blocks
    chain.stored(plan.keys, True)
    for w in chain.take_intents():  # their write-through
        assert isinstance(w, Write)
        chain.settle(Written(w, frozenset(w.keys)))
    assert chain.statistics().recompute_seconds_per_block == pytest.approx(0.02)
    on_file(chain, range(10))
    read_taking(chain, clock, [0], seconds=0.5)  # 500 ms a block
    assert chain.lookup(key(5), "r") is Answer.MISS


def test_the_engines_prefix_stops_where_loading_would_lose() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(10))
    read_taking(chain, clock, [0], seconds=0.5)
    ready = chain.place([key(n) for n in (20, 21)])
    assert ready is not None
    chain.stored(ready.keys, True)
    for w in chain.take_intents():
        chain.settle(Written(w, frozenset(w.keys)))  # type: ignore[arg-type]
    # Two blocks in CPU rows, then file blocks too slow to read: the prefix
    # ends at the CPU tier.
    assert chain.prefix([key(20), key(21), key(3), key(4)]) == 2
    assert chain.statistics().loads_declined == 1


def test_a_declined_tier_is_measured_again_and_read_once_fast() -> None:
    clock = Clock()
    chain = new_chain(clock, recompute=0.010)
    on_file(chain, range(40))
    read_taking(chain, clock, [0, 1], seconds=0.5)  # a slow period: 250 ms a block
    assert chain.lookup(key(5), "r") is Answer.MISS
    chain.forget_request("r")
    # Unread for REMEASURE_S: a request's first block is read (a probe), its
    # others still declined while the measure says slow.
    clock.now += REMEASURE_S + 0.5
    assert chain.lookup(key(10), "p") is Answer.RETRY
    assert chain.lookup(key(11), "p") is Answer.MISS
    (probe,) = [i for i in chain.take_intents() if isinstance(i, Read)]
    clock.now += 0.001  # the tier is fast again
    chain.settle(ReadDone(probe, frozenset(probe.keys)))
    chain.forget_request("p")
    # Probes bring the decayed measure down, until the tier is read again.
    for n in range(12, 30):
        s = chain.statistics().tiers["file"].read_seconds_per_block
        assert s is not None
        if s <= 0.010:
            break
        clock.now += REMEASURE_S + 0.5
        read_taking(chain, clock, [n], seconds=0.001)
    else:
        pytest.fail("the tier was never measured fast again")
    assert chain.lookup(key(35), "later") is Answer.RETRY
    assert chain.lookup(key(36), "later") is Answer.RETRY
