"""Per-request deadlines and the row limit alone (kvtier.chain._deadlines): a fake clock.

vLLM looks a request's prefix up key by key once per step; the table says
whether a key is past the request's row limit, and whether an answer that
defers the request (RETRY, PENDING) is still within its deadline.
"""

from __future__ import annotations

import logging

import pytest
from support.clock import Clock

from kvtier.chain._deadlines import Deadlines

DEADLINE_S = 2.0


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_a_wait_is_bounded_per_request_from_its_first_deferral() -> None:
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=8, clock=clock)
    steps = 0
    while steps < 100:
        req = table.enter("r", key(0))  # the same key: a new pass each step
        assert req is not None
        if not table.wait(req, key(0)):
            break
        clock.now += 0.1
        steps += 1
    assert steps * 0.1 == pytest.approx(DEADLINE_S)
    assert table.late == 1


def test_a_pass_answered_starts_a_new_wait() -> None:
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=8, clock=clock)
    req = table.enter("r", key(0))
    assert req is not None
    assert table.wait(req, key(0))  # deferred at 50.0
    clock.now += DEADLINE_S - 0.1
    req = table.enter("r", key(0))  # next pass: deferred again, same wait
    assert req is not None
    assert req.since == 50.0
    clock.now += 0.05
    req = table.enter("r", key(0))  # a pass that did not defer (no wait())...
    assert req is not None
    clock.now += 10.0
    req = table.enter("r", key(0))  # ... so this one waits afresh
    assert req is not None
    assert req.since is None
    assert table.wait(req, key(0))
    assert table.late == 0


def test_a_gap_between_passes_after_delivery_is_the_engines_not_a_wait() -> None:
    # vLLM came back to the request 3 s after everything its pass waited on was
    # delivered: that gap does not count. The second time its blocks are gone
    # again, the CPU tier cannot keep them for it: a miss at once, not a wait.
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=8, clock=clock)
    req = table.enter("r", key(0))
    assert req is not None
    assert table.wait(req, key(0))
    clock.now += 0.2
    table.delivered([key(0), key(9)])  # key(9): nobody waits on it, not remembered
    clock.now += 3.0
    req = table.enter("r", key(0))  # evicted before it came back: it waits again
    assert req is not None
    assert req.since is None
    assert table.wait(req, key(0))
    clock.now += 0.2
    table.delivered([key(0)])
    clock.now += 3.0
    req = table.enter("r", key(0))  # the second such gap: rows are short, a miss now
    assert req is not None
    assert not table.wait(req, key(0))
    assert (table.late, table.row_limited) == (0, 1)


def test_a_pass_whose_wait_was_not_delivered_keeps_its_wait() -> None:
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=8, clock=clock)
    req = table.enter("r", key(0))
    assert req is not None
    assert table.wait(req, key(0))
    req = table.enter("r", key(1))
    assert req is not None
    assert table.wait(req, key(1))
    table.delivered([key(0)])  # key(1) never arrives (a stalled tier)
    clock.now += DEADLINE_S
    req = table.enter("r", key(0))
    assert req is not None
    assert not table.wait(req, key(0))
    assert table.late == 1


def test_keys_past_the_row_limit_are_misses_counted() -> None:
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=3, clock=clock)
    got = [table.enter("r", key(n)) for n in range(5)]
    assert [g is not None for g in got] == [True, True, True, False, False]
    assert table.row_limited == 2
    assert table.enter("r", key(0)) is not None  # a new pass: the limit counts afresh


def test_requests_never_seen_again_are_forgotten() -> None:
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=4, clock=clock)
    for i in range(100):
        table.enter(f"r{i}", key(i))
    assert len(table) == 100
    clock.now += 3600
    table.enter("late", key(1000))
    assert len(table) == 1
    table.forget("late")
    table.forget("never")  # unknown: nothing to do
    assert len(table) == 0


def test_late_misses_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    table = Deadlines(DEADLINE_S, rows=4, clock=Clock(50.0))
    with caplog.at_level(logging.WARNING, logger="kvtier.chain"):
        table.miss_late("a read from the file tier")
        table.miss_late("a shared tier")
    assert table.late == 2
    logged = [r for r in caplog.records if "deadline_misses" in r.message]
    assert len(logged) == 1
    assert "file tier" in logged[0].message


def test_waits_on_new_keys_after_deliveries_are_waits_not_row_misses() -> None:
    # A front that asks key after key, each until it is delivered (every ask of
    # the same key a new pass): no block is delivered twice, so no wait is cut.
    clock = Clock(50.0)
    table = Deadlines(DEADLINE_S, rows=8, clock=clock)
    for n in range(4):
        req = table.enter("r", key(n))
        assert req is not None
        assert table.wait(req, key(n))
        clock.now += 0.05
        table.delivered([key(n)])
        req = table.enter("r", key(n))  # found now: a HIT, no wait
        assert req is not None
    assert (table.late, table.row_limited) == (0, 0)
