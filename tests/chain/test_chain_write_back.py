"""Write-back through the chain alone (no I/O: outcomes are settled by hand).

The promise under test: a block whose only copy is its CPU row goes to each
write-back tier that lacks it before its row is reused, and a clean close
hands over every such block, however the tier came to lack it.
"""

from __future__ import annotations

from kvtier.chain import Chain, LowerTier, Read, ReadDone, TierChanged, Write, Written


def key(n: int) -> bytes:
    return n.to_bytes(8, "big")


def new_chain(rows: int) -> Chain:
    return Chain(rows, [LowerTier("file", write_back=True)])


def store(chain: Chain, *names: int) -> tuple[Write, ...]:
    """Store blocks from the device; the write-backs their placement evicted, settled."""
    plan = chain.place([key(n) for n in names])
    assert plan is not None
    assert len(plan.keys) == len(names)
    writes = chain.evicting_writes(plan)
    for intent in chain.take_intents():  # the driver's part: each write succeeds
        assert isinstance(intent, Write)
        chain.settle(Written(intent, frozenset(intent.keys)))
    chain.stored(plan.keys, True)
    return writes


def written_back(chain: Chain) -> set[bytes]:
    """Keys of the write-back writes queued now (settled as written)."""
    out: set[bytes] = set()
    for intent in chain.take_intents():
        if isinstance(intent, Write):
            out.update(intent.keys)
            chain.settle(Written(intent, frozenset(intent.keys)))
    return out


def promote(chain: Chain, name: int) -> None:
    assert len(chain.promote([key(name)])) == 1
    # Its row's evicted block is written back first; then the read goes out.
    while intents := chain.take_intents():
        for intent in intents:
            if isinstance(intent, Write):
                chain.settle(Written(intent, frozenset(intent.keys)))
            else:
                assert isinstance(intent, Read)
                chain.settle(ReadDone(intent, frozenset(intent.keys)))
    assert chain.is_ready(key(name))


def test_a_victim_goes_to_the_tier_before_its_row_is_reused() -> None:
    chain = new_chain(2)
    store(chain, 1, 2)
    writes = store(chain, 3)
    (victim,) = [k for k in (key(1), key(2)) if not chain.is_ready(k)]
    assert [w.keys for w in writes] == [(victim,)]
    assert writes[0].evicting


def test_a_promoted_block_the_tier_evicted_is_written_back_again() -> None:
    chain = new_chain(2)
    store(chain, 1, 2)
    store(chain, 3, 4)  # 1 and 2 written back, now only on file
    assert written_back(chain) == set()
    promote(chain, 1)  # back in a CPU row, clean: the file holds it
    # The file tier evicts its copy (another block's write needed the room):
    chain.settle(TierChanged(0, removed=(key(1),)))
    # The CPU row is its only copy now: evicting it must write it first.
    chain.touch([key(1)])
    writes = store(chain, 5, 6)
    assert key(1) in {k for w in writes for k in w.keys}


def test_a_block_the_tier_evicted_by_its_own_write_is_owed_again() -> None:
    chain = new_chain(3)
    store(chain, 1, 2, 3)
    (first,) = store(chain, 4)  # one of them written back
    (v,) = first.keys
    chain.touch([key(n) for n in (1, 2, 3, 4) if key(n) != v])
    promote(chain, int.from_bytes(v, "big"))
    chain.touch([v])
    # The write-back of the next victim evicts v from the file tier to make room.
    plan = chain.place([key(5)])
    assert plan is not None
    (w,) = chain.evicting_writes(plan)
    assert v not in w.keys
    chain.settle(Written(w, frozenset(w.keys), evicted=(v,)))
    chain.stored(plan.keys, True)
    assert chain.is_ready(v)
    # A clean close hands over everything the tier lacks, v among them.
    assert chain.write_back() >= 1
    assert v in written_back(chain)


def test_a_clean_close_hands_over_a_block_a_peer_dropped() -> None:
    chain = new_chain(4)
    chain.settle(TierChanged(0, added=(key(7),)))  # a peer's partition holds 7
    promote(chain, 7)
    assert chain.write_back() == 0  # the tier holds it
    chain.settle(TierChanged(0, removed=(key(7),)))  # its owner evicted it
    assert chain.write_back() == 1
    assert written_back(chain) == {key(7)}


def test_while_the_tier_recovers_its_blocks_stay_in_their_rows() -> None:
    chain = new_chain(2)
    chain.recovering(0)
    store(chain, 1, 2)
    # Both rows hold blocks the tier is owed and cannot take yet: a store is
    # refused rather than a block lost to a write the tier would refuse.
    assert chain.place([key(3)]) is None
    assert chain.is_ready(key(1))
    assert chain.is_ready(key(2))
    chain.settle(TierChanged(0, added=(), recovered=True))
    writes = store(chain, 3)
    (victim,) = [k for k in (key(1), key(2)) if not chain.is_ready(k)]
    assert [w.keys for w in writes] == [(victim,)]


def test_recovery_ending_releases_every_pin() -> None:
    chain = new_chain(2)
    chain.recovering(0)
    store(chain, 1)
    assert chain.pins(key(1)) == 1
    chain.settle(TierChanged(0, recovered=True))
    assert chain.pins(key(1)) == 0
    # A close while the tier still recovers releases them too.
    chain.recovering(0)
    store(chain, 2)
    chain.abandon()
    assert chain.pins(key(2)) == 0
