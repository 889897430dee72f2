"""The runtime alone (kvtier.chain.Runtime): a chain over in-memory tiers, no front.

The runtime carries the chain's intents out on the tiers' loop and settles
their outcomes; it answers with values and never calls into a front. Inline
(the Engine's way) each intent has a settlement that hands its outcome on as
the chain settles it; queued (the vLLM front's way) :meth:`Runtime.drain`
returns what it settled, each read and write with its duration, in order with
the tiers' own events.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from kvtier.chain import (
    Answer,
    Chain,
    ChainStatistics,
    FrontCounts,
    LowerTier,
    ReadDone,
    Runtime,
    Settled,
    TierChanged,
    TierEvents,
    Write,
    Written,
)
from kvtier.layout import KVLayout, TensorSpec
from kvtier.manager import BlockStored, ManagerEvent
from kvtier.region import CPURegion
from kvtier.testing.memory import MemoryTier

ROW = 4096
ROWS = 8


def layout() -> KVLayout:
    page = TensorSpec("page", (1, ROW), "int8", 1, False)
    return KVLayout(tensors=(page,), model_id="runtime-test", block_tokens=16)


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def content(n: int) -> bytes:
    return bytes([n & 0xFF]) * ROW


@contextmanager
def region() -> Iterator[CPURegion]:
    r = CPURegion.create(layout(), ROWS * ROW, alignment=4096)
    try:
        yield r
    finally:
        r.close()


def store(chain: Chain, r: CPURegion, names: Sequence[int]) -> None:
    """A store from the device, as a front makes it: rows placed, bytes copied, stored."""
    plan = chain.place([key(n) for n in names])
    assert plan is not None
    for k, slot in zip(plan.keys, plan.slots, strict=True):
        r.row(slot)[:] = content(int.from_bytes(k, "big"))
    chain.stored(plan.keys, True)


@asynccontextmanager
async def inline(
    *tiers: MemoryTier, specs: Sequence[LowerTier] = ()
) -> AsyncIterator[tuple[Chain, Runtime, CPURegion]]:
    specs = list(specs) or [LowerTier(f"mem{i}") for i in range(len(tiers))]
    with region() as r:
        chain = Chain(r.rows, specs, lookup_deadline_s=60.0)
        runtime = Runtime(
            chain, tiers, [s.name for s in specs], r, asyncio.get_running_loop(), queued=False
        )
        runtime.start()
        try:
            yield chain, runtime, r
        finally:
            for tier in tiers:
                await tier.aclose()


async def settle(runtime: Runtime, *waits: Any) -> None:
    """Wait for the writes in flight (and ``waits``), 5 s at most."""
    async with asyncio.timeout(5):
        for w in (*runtime.writes(), *waits):
            await w


def test_the_runtime_takes_no_callables_from_a_front() -> None:
    params = inspect.signature(Runtime).parameters
    assert not [p for p in params if p.startswith("on_")]
    assert set(params) == {
        "chain",
        "tiers",
        "names",
        "region",
        "loop",
        "queued",
        "events_from",
    }


# -- inline ----------------------------------------------------------------------------


async def test_inline_writes_through_and_unpins_when_each_write_settles() -> None:
    tier = MemoryTier(ROW)
    async with inline(tier) as (chain, runtime, r):
        store(chain, r, [1, 2])
        intents = runtime.dispatch()
        assert [type(i) for i in intents] == [Write]
        assert chain.pins(key(1)) == 1  # held for the write
        (write,) = runtime.writes()
        assert runtime.completion(intents[0]) is write
        await settle(runtime)
        assert runtime.writes() == ()
        assert runtime.completion(intents[0]) is None  # settled
        assert chain.pins(key(1)) == 0
        assert tier.is_ready(key(1))
        assert tier.is_ready(key(2))
        st = runtime.statistics(_counts(), _no_front)
        assert st.tiers["mem0"].written_blocks == 2
        assert st.tiers["mem0"].written_bytes == 2 * r.slice_bytes
        assert st.tiers["mem0"].write_busy_seconds > 0
        assert st.tiers["mem0"].statistics.stores == 2  # the tier's own record, taken now


async def test_inline_a_settlement_hands_the_outcome_on_as_the_chain_settles_it() -> None:
    tier = MemoryTier(ROW)
    async with inline(tier) as (chain, runtime, r):
        store(chain, r, [1])
        runtime.dispatch()
        await settle(runtime)
        chain.reset()  # the CPU tier forgets it: only the memory tier has it
        assert not chain.is_ready(key(1))
        (read,) = chain.promote([key(1)])
        seen: list[tuple[bool, bool]] = []
        settlement = runtime.expect(read)

        def take(done: ReadDone) -> None:
            # Ready already (the chain settled first), before anything else ran:
            # the settlement itself is not done yet.
            seen.append((chain.is_ready(key(1)), settlement.done()))
            assert done.intent is read
            assert done.loaded == {key(1)}

        settlement.then(take)
        runtime.dispatch()
        assert not seen  # the read is in flight
        await settle(runtime, settlement)
        assert seen == [(True, False)]
        (slot,) = chain.pin_for_device_load([key(1)])
        assert bytes(r.row(slot)) == content(1)
        chain.unpin_device_load([key(1)])


async def test_inline_a_block_one_tier_lost_is_read_from_the_next() -> None:
    upper, lower = MemoryTier(ROW), MemoryTier(ROW)
    async with inline(upper, lower) as (chain, runtime, r):
        store(chain, r, [7])
        runtime.dispatch()
        await settle(runtime)
        chain.reset()
        upper.drop(key(7))  # behind the chain's back
        (read,) = chain.promote([key(7)])
        assert read.tier == 0
        got: list[ReadDone] = []
        both = asyncio.Event()

        def take(done: ReadDone) -> None:
            got.append(done)
            for again in chain.follow_ups(done.intent):  # asked as the outcome settles
                runtime.expect(again).then(take)
            if len(got) == 2:
                both.set()

        runtime.expect(read).then(take)
        runtime.dispatch()
        async with asyncio.timeout(5):
            await both.wait()
        assert got[0].loaded == frozenset()
        assert got[1].intent.follows == read.seq
        assert got[1].intent.tier == 1
        assert got[1].loaded == {key(7)}
        assert chain.is_ready(key(7))
        assert runtime.statistics(_counts(), _no_front).tiers["mem0"].read_failures == 1


async def test_inline_writes_after_stop_writes_are_dropped_and_counted() -> None:
    tier = MemoryTier(ROW)
    async with inline(tier) as (chain, runtime, r):
        runtime.stop_writes()
        store(chain, r, [1, 2, 3])
        runtime.dispatch()
        assert runtime.writes() == ()  # settled at once, as failed
        assert runtime.abandoned == 3
        assert chain.pins(key(1)) == 0
        assert not tier.is_ready(key(1))
        assert runtime.statistics(_counts(), _no_front).tiers["mem0"].write_failures == 3


async def test_inline_a_probe_asked_before_it_goes_out_is_awaited() -> None:
    tier = MemoryTier(ROW)
    async with inline(tier, specs=[LowerTier("mem", shared=True)]) as (chain, runtime, r):
        store(chain, r, [4])
        runtime.dispatch()
        await settle(runtime)
        probe = chain.probe(0, [key(4), key(5)])
        settlement = runtime.expect(probe)
        assert runtime.expect(probe) is settlement  # one per intent
        found: list[frozenset[bytes]] = []
        settlement.then(lambda done: found.append(done.present))
        runtime.dispatch()  # a tier that cannot be asked answers at once, from what it holds
        await settle(runtime, settlement)
        assert found == [frozenset({key(4)})]
        assert runtime.drain() == []  # inline: nothing queued


# -- queued ----------------------------------------------------------------------------


class _Announcing(MemoryTier):
    """A memory tier that announces what it stores (as the file tier does)."""

    def __init__(self, block_bytes: int) -> None:
        super().__init__(block_bytes)
        self._events: list[ManagerEvent] = []

    def store(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Any:
        done = super().store(keys, buffers)
        done.add_done_callback(
            lambda c: self._events.append(BlockStored(tuple(c.result().stored), tier="mem"))
        )
        return done

    def take_events(self) -> list[ManagerEvent]:
        out, self._events = self._events, []
        return out


@contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="tiers", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def drain_until(runtime: Runtime, count: int) -> list[Settled | TierEvents]:
    """Drain (as a front's scheduler calls do) until ``count`` values came back."""
    out: list[Settled | TierEvents] = []
    for _ in range(2000):
        out += runtime.drain()
        if len(out) >= count:
            break
        threading.Event().wait(0.0025)
    return out


def test_queued_drain_returns_what_it_settled_in_order_with_the_tiers_events() -> None:
    tier = _Announcing(ROW)
    with region() as r, loop_thread() as loop:
        chain = Chain(r.rows, [LowerTier("mem")], lookup_deadline_s=60.0)
        runtime = Runtime(chain, [tier], ["mem"], r, loop, queued=True, events_from=0)
        runtime.start()
        assert runtime.tier_statistics()[0].stores == 0  # taken on the loop at start
        store(chain, r, [1, 2])
        (write,) = runtime.dispatch()
        assert chain.busy
        assert runtime.completion(write) is None  # queued: no settlements
        with pytest.raises(Exception, match="drain"):
            runtime.expect(write)
        got = drain_until(runtime, 2)
        assert len(got) == 2
        done, events = got
        assert isinstance(done, Settled)
        assert isinstance(done.outcome, Written)
        assert done.outcome.intent is write
        assert done.seconds is not None
        assert done.seconds > 0
        assert isinstance(events, TierEvents)
        assert events.tier == 0
        assert [set(e.keys) for e in events.events] == [{key(1), key(2)}]
        assert not chain.busy  # settled on this thread, by drain
        assert chain.pins(key(1)) == 0
        assert runtime.tier_statistics()[0].stores == 2  # taken after the call, on the loop
        assert runtime.drain() == []
        asyncio.run_coroutine_threadsafe(tier.aclose(), loop).result(5)


def test_queued_a_lookup_waits_on_a_read_carried_out_on_the_loop() -> None:
    tier = MemoryTier(ROW)
    with region() as r, loop_thread() as loop:
        chain = Chain(r.rows, [LowerTier("mem")], lookup_deadline_s=60.0)
        runtime = Runtime(chain, [tier], ["mem"], r, loop, queued=True)
        runtime.start()
        store(chain, r, [3])
        runtime.dispatch()
        drain_until(runtime, 1)
        chain.reset()
        assert chain.lookup(key(3), "req") is Answer.RETRY
        runtime.dispatch()
        (done,) = drain_until(runtime, 1)
        assert isinstance(done, Settled)
        assert isinstance(done.outcome, ReadDone)
        assert done.outcome.loaded == {key(3)}
        assert chain.lookup(key(3), "req") is Answer.HIT
        assert runtime.statistics(_counts(), _no_front).tiers["mem"].lookup_hits == 1
        asyncio.run_coroutine_threadsafe(tier.aclose(), loop).result(5)


def test_queued_peers_changes_come_back_folded_as_tier_changes() -> None:
    tier = _Watched(ROW)
    with region() as r, loop_thread() as loop:
        chain = Chain(r.rows, [LowerTier("mem", shared=True)], lookup_deadline_s=60.0)
        runtime = Runtime(chain, [tier], ["mem"], r, loop, queued=True)
        runtime.start()
        assert tier.listener is not None
        listener = tier.listener
        for n in range(3):  # on the loop, as a tier's watcher calls it
            loop.call_soon_threadsafe(listener, [key(n)], [])
        loop.call_soon_threadsafe(listener, [], [key(0)])
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # after those
        got = runtime.drain()
        assert len(got) == 1
        assert isinstance(got[0], Settled)
        change = got[0].outcome
        assert isinstance(change, TierChanged)
        assert set(change.added) == {key(1), key(2)}
        assert change.removed == (key(0),)
        assert chain.lower_of(key(1)) == 0
        assert chain.lower_of(key(0)) is None


class _Watched(MemoryTier):
    """A memory tier whose peers' writes a listener follows (as the cluster tier's)."""

    listener: Any = None

    def watch(self, listener: Any) -> None:
        self.listener = listener


def _counts() -> FrontCounts:
    return FrontCounts()


def _no_front(_chain: ChainStatistics) -> None:
    """A front without a record of its own."""
