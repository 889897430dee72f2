"""The load-or-recompute decision alone (kvtier.chain._decision): a fake clock, no chain.

The chain tells it when reads start and end and when blocks are placed and
stored; it answers whether the m-th block of a request is worth reading. No
timing is asserted: the clock is the test's.
"""

from __future__ import annotations

import logging

import pytest
from support.clock import Clock

from kvtier.chain._decision import REMEASURE_S, LoadDecision


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def decision(
    clock: Clock,
    *,
    recompute: float | None = 0.010,
    measure: bool = False,
    tiers: int = 1,
) -> LoadDecision:
    return LoadDecision(
        [f"tier{i}" for i in range(tiers)],
        enabled=True,
        recompute_s_per_block=recompute,
        measure_recompute=measure,
        clock=clock,
    )


def read(d: LoadDecision, clock: Clock, index: int, blocks: int, seconds: float) -> None:
    """One read of ``blocks`` blocks from tier ``index``, all delivered after ``seconds``."""
    d.read_started(index, blocks)
    clock.now += seconds
    d.read_ended(index, blocks, blocks)


def test_without_a_measure_every_load_is_worth_it() -> None:
    clock = Clock(1000.0)
    assert decision(clock).worth_loading(0, 1)  # the tier never read
    unknown = decision(clock, recompute=None)
    read(unknown, clock, 0, 1, seconds=5.0)
    assert unknown.worth_loading(0, 100)  # the recompute cost unknown
    assert unknown.recompute_s_per_block is None


def test_a_tier_slower_than_recompute_is_declined_and_a_fast_one_is_not() -> None:
    clock = Clock(1000.0)
    d = decision(clock, tiers=2)
    read(d, clock, 0, 4, seconds=0.4)  # 100 ms a block
    read(d, clock, 1, 4, seconds=0.004)  # 1 ms a block
    assert d.s_per_block(0) == pytest.approx(0.1)
    assert not d.worth_loading(0, 1)
    assert d.worth_loading(1, 1)


def test_blocks_queued_ahead_count_against_a_new_read() -> None:
    clock = Clock(1000.0)
    d = decision(clock, recompute=0.010)
    read(d, clock, 0, 1, seconds=0.008)  # 8 ms a block: faster than 10
    assert d.worth_loading(0, 1)
    d.read_started(0, 8)  # 8 blocks ahead of it now
    assert not d.worth_loading(0, 1)  # (8 + 1) x 8 ms > 10 ms
    assert d.worth_loading(0, 40)  # (8 + 40) x 8 ms <= 40 x 10 ms


def test_overlapping_reads_count_their_busy_time_once() -> None:
    clock = Clock(1000.0)
    d = decision(clock)
    d.read_started(0, 2)
    d.read_started(0, 2)  # in flight together
    clock.now += 0.2
    d.read_ended(0, 2, 2)
    d.read_ended(0, 2, 2)
    assert d.s_per_block(0) == pytest.approx(0.05)  # 0.2 s for 4 blocks, not 0.4 s


def test_undelivered_blocks_make_a_tier_dearer() -> None:
    clock = Clock(1000.0)
    d = decision(clock)
    d.read_started(0, 4)
    clock.now += 0.4
    d.read_ended(0, 4, 1)  # one of four delivered
    assert d.s_per_block(0) == pytest.approx(0.4)


def test_recent_periods_weigh_most() -> None:
    clock = Clock(1000.0)
    d = decision(clock)
    read(d, clock, 0, 1, seconds=1.0)
    for _ in range(30):
        clock.now += 1.0  # idle between reads: not counted
        read(d, clock, 0, 1, seconds=0.001)
    s = d.s_per_block(0)
    assert s is not None
    assert s < 0.002


def test_a_tier_unread_for_long_gets_a_first_block_read_to_measure_it_again() -> None:
    clock = Clock(1000.0)
    d = decision(clock)
    read(d, clock, 0, 1, seconds=1.0)  # very slow once
    assert not d.worth_loading(0, 1)
    clock.now += REMEASURE_S
    assert d.worth_loading(0, 1)  # the first block of a request: read to measure
    assert not d.worth_loading(0, 2)  # not the second
    d.read_started(0, 1)
    assert not d.worth_loading(0, 1)  # a read is in flight: it measures the tier


def test_declines_are_counted_per_tier_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock(1000.0)
    d = decision(clock, tiers=2)
    with caplog.at_level(logging.WARNING, logger="kvtier.chain"):
        d.decline(1)
        d.decline(1)
        d.decline(0)
    assert (d.declined, d.declined_from(0), d.declined_from(1)) == (3, 1, 2)
    assert len([r for r in caplog.records if "loads_declined" in r.message]) == 1


def test_the_recompute_cost_is_measured_from_placement_to_store() -> None:
    clock = Clock(1000.0)
    d = decision(clock, recompute=None, measure=True)
    assert d.measuring
    d.placed([key(1), key(2)])
    clock.now += 0.040
    d.computed([key(1), key(2)], ok=True)
    assert d.recompute_s_per_block == pytest.approx(0.020)
    d.placed([key(3)])
    clock.now += 0.120
    d.computed([key(3)], ok=True)  # one sample weighs a fifth
    assert d.recompute_s_per_block == pytest.approx(0.8 * 0.020 + 0.2 * 0.120)
    d.placed([key(4)])
    clock.now += 5.0
    d.computed([key(4)], ok=False)  # a failed store measures nothing
    assert d.recompute_s_per_block == pytest.approx(0.8 * 0.020 + 0.2 * 0.120)


def test_a_set_recompute_cost_is_not_measured() -> None:
    clock = Clock(1000.0)
    d = decision(clock, recompute=0.005, measure=True)
    assert not d.measuring
    d.placed([key(1)])
    clock.now += 1.0
    d.computed([key(1)], ok=True)
    assert d.recompute_s_per_block == 0.005
