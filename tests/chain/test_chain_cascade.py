"""The chain's cascade decisions, alone: scripted outcomes, a fake clock, no I/O.

Each test plays the driver's part by hand: it takes the chain's intents and
settles each with the outcome the scenario needs (a tier that holds the
block, one that lost it, one that never answers). What the chain decides
can then be read off the intents: which tier is written, which is read,
which rows stay pinned, and what each lookup answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from support.clock import Clock

from kvtier.chain import (
    Answer,
    Chain,
    Intent,
    LowerTier,
    Probe,
    Probed,
    Read,
    ReadDone,
    TierChanged,
    Write,
    Written,
)

DEADLINE_S = 1.0


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def new_chain(rows: int, *lower: LowerTier, clock: Clock | None = None) -> Chain:
    return Chain(
        rows,
        list(lower),
        lookup_deadline_s=DEADLINE_S,
        probe_ttl_s=0.5,
        clock=clock or Clock(),
    )


def store(chain: Chain, names: Sequence[int]) -> None:
    """A store from the device: rows placed, the device copy done."""
    plan = chain.place([key(n) for n in names])
    assert plan is not None
    chain.stored(plan.keys, True)


def run(chain: Chain, settle: Callable[[Intent], object] | None = None) -> list[Intent]:
    """Carry out every intent until none is left: each succeeds unless ``settle``
    says otherwise (returns an outcome, or None to leave it in flight)."""
    seen: list[Intent] = []
    while intents := chain.take_intents():
        for intent in intents:
            seen.append(intent)
            outcome = settle(intent) if settle else _success(intent)
            if outcome is not None:
                chain.settle(outcome)  # type: ignore[arg-type]
    return seen


def _success(intent: Intent) -> object:
    if isinstance(intent, Write):
        return Written(intent, frozenset(intent.keys))
    if isinstance(intent, Read):
        return ReadDone(intent, frozenset(intent.keys))
    assert isinstance(intent, Probe)
    return Probed(intent, frozenset())


def settle_until(chain: Chain, k: bytes, steps: int = 10) -> Answer:
    """Look ``k`` up as a front does, once per step, until it is not RETRY."""
    for _ in range(steps):
        answer = chain.lookup(k)
        if answer is not Answer.RETRY:
            return answer
        run(chain)
    return chain.lookup(k)


def test_write_through_pins_the_rows_until_the_writes_end() -> None:
    chain = new_chain(4, LowerTier("file"), LowerTier("cluster"))
    store(chain, [1, 2])
    writes = chain.take_intents()
    assert sorted((w.tier, w.keys) for w in writes if isinstance(w, Write)) == [
        (0, (key(1), key(2))),
        (1, (key(1), key(2))),
    ]
    assert chain.statistics().rows_held_by_writes == 2
    assert chain.pins(key(1)) == 2  # one per write, not a load
    for w in writes:
        chain.settle(Written(w, frozenset(w.keys)))  # type: ignore[arg-type]
    assert chain.pins(key(1)) == 0
    assert not chain.busy
    counts = chain.statistics().tiers
    assert counts["file"].written_blocks == counts["cluster"].written_blocks == 2


def test_a_tier_that_takes_no_stores_is_not_written_through() -> None:
    chain = new_chain(4, LowerTier("file"), LowerTier("cluster", takes_stores=False))
    store(chain, [1])
    assert {i.tier for i in run(chain)} == {0}


def test_a_failed_write_is_counted_and_the_pin_released() -> None:
    chain = new_chain(4, LowerTier("file"))
    store(chain, [1])
    run(chain, lambda i: Written(i, frozenset()) if isinstance(i, Write) else None)
    assert chain.pins(key(1)) == 0
    assert chain.statistics().tiers["file"].write_failures == 1
    assert chain.lower_of(key(1)) is None  # not held below: never read from there


def test_a_block_only_below_is_promoted_then_a_hit() -> None:
    chain = new_chain(2, LowerTier("file"))
    chain.settle(TierChanged(0, added=(key(1),)))
    assert chain.lookup(key(1)) is Answer.RETRY
    (read,) = run(chain)
    assert isinstance(read, Read)
    assert read.keys == (key(1),)
    assert chain.lookup(key(1)) is Answer.HIT
    counts = chain.statistics().tiers
    assert counts["file"].lookup_hits == counts["file"].read_blocks == 1


def test_promote_up_writes_a_cluster_hit_to_the_file_tier() -> None:
    chain = new_chain(2, LowerTier("file"), LowerTier("cluster", shared=True, promote_up=True))
    chain.settle(TierChanged(1, added=(key(5),)))
    assert settle_until(chain, key(5)) is Answer.HIT
    assert chain.lower_of(key(5)) == 0  # written up to the file tier after the read


def test_without_promote_up_a_hit_stays_where_it_was() -> None:
    chain = new_chain(2, LowerTier("file"), LowerTier("cluster", shared=True))
    chain.settle(TierChanged(1, added=(key(5),)))
    assert settle_until(chain, key(5)) is Answer.HIT
    assert chain.lower_of(key(5)) == 1


def test_a_failed_read_is_a_miss_and_forgets_the_block() -> None:
    chain = new_chain(2, LowerTier("file"))
    chain.settle(TierChanged(0, added=(key(1),)))
    assert chain.lookup(key(1)) is Answer.RETRY
    run(chain, lambda i: ReadDone(i, frozenset()) if isinstance(i, Read) else None)
    assert chain.lookup(key(1)) is Answer.MISS
    assert chain.lower_of(key(1)) is None
    assert key(1) not in chain  # its reserved row went back
    assert chain.statistics().tiers["file"].read_failures == 1


def test_a_read_past_the_deadline_is_a_miss_and_still_serves_later() -> None:
    clock = Clock()
    chain = new_chain(2, LowerTier("file"), clock=clock)
    chain.settle(TierChanged(0, added=(key(1),)))
    assert chain.lookup(key(1)) is Answer.RETRY
    in_flight = run(chain, lambda i: None)  # the tier stalls
    clock.now += DEADLINE_S / 2
    assert chain.lookup(key(1)) is Answer.RETRY
    clock.now += DEADLINE_S
    assert chain.lookup(key(1)) is Answer.MISS
    assert chain.statistics().lookup_deadline_misses == 1
    (read,) = in_flight
    assert isinstance(read, Read)
    chain.settle(ReadDone(read, frozenset(read.keys)))  # it ends after all
    assert chain.lookup(key(1)) is Answer.HIT


def _fail(read: Read, *missing: int) -> ReadDone:
    """The outcome of ``read`` when the tier did not deliver blocks ``missing``."""
    lost = {key(n) for n in missing}
    return ReadDone(read, frozenset(k for k in read.keys if k not in lost))


def test_a_block_a_tier_fails_to_deliver_is_read_from_the_next_tier_that_holds_it() -> None:
    chain = new_chain(4, LowerTier("host"), LowerTier("file"), LowerTier("cluster"))
    for tier in (0, 1, 2):
        chain.settle(TierChanged(tier, added=(key(1), key(2))))
    (read,) = chain.promote([key(1), key(2)])
    assert read.tier == 0
    assert chain.take_intents() == [read]
    chain.settle(_fail(read, 1))  # its host row was reused, say
    (again,) = chain.follow_ups(read)
    assert (again.tier, again.keys, again.follows) == (1, (key(1),), read.seq)
    assert again.rows == read.rows[:1]  # into the row it had: still reserved, not ready
    assert key(1) in chain
    assert not chain.is_ready(key(1))
    assert chain.is_ready(key(2))
    assert chain.take_intents() == [again]
    chain.settle(ReadDone(again, frozenset(again.keys)))
    assert chain.is_ready(key(1))
    assert chain.follow_ups(read) == ()  # asked for right after its outcome, or never
    counts = chain.statistics().tiers
    assert (counts["host"].read_failures, counts["host"].read_blocks) == (1, 1)
    assert (counts["file"].read_failures, counts["file"].read_blocks) == (0, 1)
    assert chain.lower_of(key(1)) == 1  # the host tier forgot it
    assert not chain.busy


def test_a_block_falls_through_each_tier_at_most_once_then_is_a_miss() -> None:
    chain = new_chain(4, LowerTier("host"), LowerTier("file"), LowerTier("cluster"))
    chain.settle(TierChanged(0, added=(key(1),)))
    chain.settle(TierChanged(2, added=(key(1),)))
    (read,) = chain.promote([key(1)])
    chain.take_intents()
    chain.settle(_fail(read, 1))
    (again,) = chain.follow_ups(read)
    assert again.tier == 2  # the next tier below that holds it (the file tier does not)
    chain.take_intents()
    chain.settle(_fail(again, 1))
    assert chain.follow_ups(again) == ()  # none below the last: a miss
    assert key(1) not in chain  # its row went back
    assert chain.lower_of(key(1)) is None
    assert not chain.busy


def test_a_lookup_whose_read_failed_waits_on_the_next_tier_not_a_miss() -> None:
    chain = new_chain(2, LowerTier("host"), LowerTier("file"))
    chain.settle(TierChanged(0, added=(key(1),)))
    chain.settle(TierChanged(1, added=(key(1),)))
    assert chain.lookup(key(1)) is Answer.RETRY
    (read,) = chain.take_intents()
    assert isinstance(read, Read)
    chain.settle(_fail(read, 1))
    assert chain.lookup(key(1)) is Answer.RETRY  # read from the file tier now
    (again,) = chain.take_intents()
    assert isinstance(again, Read)
    assert (again.tier, again.follows) == (1, read.seq)
    chain.settle(ReadDone(again, frozenset(again.keys)))
    assert chain.lookup(key(1)) is Answer.HIT
    counts = chain.statistics().tiers
    assert counts["file"].lookup_hits == 1  # the tier that delivered it
    assert counts["host"].lookup_hits == 0


@pytest.mark.parametrize("looked_up", [True, False], ids=["lookup", "promote"])
def test_a_failed_read_past_the_deadline_does_not_fall_through(looked_up: bool) -> None:
    clock = Clock()
    chain = new_chain(2, LowerTier("host"), LowerTier("file"), clock=clock)
    chain.settle(TierChanged(0, added=(key(1),)))
    chain.settle(TierChanged(1, added=(key(1),)))
    if looked_up:
        assert chain.lookup(key(1)) is Answer.RETRY
        (read,) = chain.take_intents()
    else:
        (read,) = chain.promote([key(1)])
        chain.take_intents()
    assert isinstance(read, Read)
    clock.now += DEADLINE_S  # the host tier stalled that long, then failed
    chain.settle(_fail(read, 1))
    assert chain.follow_ups(read) == ()
    assert chain.take_intents() == []
    assert key(1) not in chain  # a miss: its row went back at once
    assert chain.lower_of(key(1)) == 1  # a later request reads it from the file tier
    assert not chain.busy


def test_a_store_in_flight_is_pending() -> None:
    chain = new_chain(2, LowerTier("file"))
    plan = chain.place([key(1)])
    assert plan is not None
    assert chain.lookup(key(1)) is Answer.PENDING
    chain.stored(plan.keys, True)
    assert chain.lookup(key(1)) is Answer.HIT


def test_a_shared_tier_is_probed_once_per_step_and_absence_stands_for_its_ttl() -> None:
    clock = Clock()
    chain = new_chain(4, LowerTier("cluster", shared=True), clock=clock)
    assert chain.lookup(key(1)) is Answer.RETRY
    assert chain.lookup(key(2)) is Answer.RETRY
    (probe,) = chain.take_intents()
    assert isinstance(probe, Probe)
    assert probe.keys == (key(1), key(2))  # one batch for the step
    chain.settle(Probed(probe, frozenset({key(2)})))
    assert chain.lookup(key(1)) is Answer.MISS  # absent: not asked again for a while
    assert chain.lookup(key(2)) is Answer.RETRY  # present: read now
    run(chain)
    assert chain.lookup(key(2)) is Answer.HIT
    assert chain.lookup(key(1)) is Answer.MISS
    clock.now += 1.0  # past probe_ttl_s: another instance may have stored it
    assert chain.lookup(key(1)) is Answer.RETRY


def test_a_tier_of_its_own_is_never_probed() -> None:
    chain = new_chain(4, LowerTier("file"))
    assert chain.lookup(key(1)) is Answer.MISS
    assert chain.take_intents() == []


def test_a_read_into_a_row_being_written_back_waits_for_that_write() -> None:
    chain = new_chain(1, LowerTier("file", write_back=True))
    store(chain, [1])
    chain.settle(TierChanged(0, added=(key(2),)))
    assert chain.promote([key(2)]) != []  # evicts 1: its only copy goes to the file first
    first = chain.take_intents()
    assert [type(i) for i in first] == [Write]
    (write,) = first
    assert isinstance(write, Write)
    assert write.evicting
    assert write.keys == (key(1),)
    assert chain.take_intents() == []  # the read is held
    chain.settle(Written(write, frozenset(write.keys)))
    (read,) = chain.take_intents()
    assert isinstance(read, Read)
    assert read.rows == write.rows


@pytest.mark.parametrize("ok", [True, False], ids=["copied", "copy-failed"])
def test_a_store_whose_device_copy_failed_is_not_written_down(ok: bool) -> None:
    chain = new_chain(2, LowerTier("file"))
    plan = chain.place([key(1)])
    assert plan is not None
    chain.stored(plan.keys, ok)
    assert bool(chain.take_intents()) is ok
    assert chain.is_ready(key(1)) is ok


def test_place_takes_the_leading_keys_that_fit_and_counts_the_rest() -> None:
    chain = new_chain(3, LowerTier("file"))
    store(chain, [1, 2])  # pinned by their writes: not evictable yet
    plan = chain.place([key(n) for n in (3, 4, 5)])
    assert plan is not None
    assert plan.keys == (key(3),)
    assert chain.statistics().store_refusals == 2


def test_keep_shields_a_prefix_from_its_own_tail() -> None:
    chain = new_chain(2)
    store(chain, [1, 2])
    assert chain.place([key(3)], keep=[key(1), key(2)]) is None
    assert chain.is_ready(key(1))
    assert chain.is_ready(key(2))
