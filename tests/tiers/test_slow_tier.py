"""``kvtier.testing.faults.SlowTier``: the file tier's loads made slower, nothing else.

A tier that still keeps the tier contract (the conformance suite, through
the wrapper), whose loads complete no earlier than their delay after they
were submitted (asyncio runs a ``call_at`` no earlier than its time, less
the clock's resolution: a busy machine only makes it later, so these checks
cannot fail on one), and that has exactly the optional abilities of the tier
it wraps. Delays that must not elapse in a test are an hour long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvtier.config import FileTierConfig
from kvtier.errors import InvalidArgumentError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.faults import SlowTier
from kvtier.testing.tier import OpenTier, Rows, TierSuite, block_keys, pattern
from kvtier.tiers.base import (
    Announces,
    HasMetrics,
    LoadResult,
    Recovers,
    Refreshable,
    StoreResult,
    Tier,
    TierStatistics,
    Watched,
)
from kvtier.tiers.file import FileTier
from kvtier.transfer.completion import Completion

BLOCK = 8192
HOUR = 3600.0
EARLY = time.get_clock_info("monotonic").resolution
"""How early asyncio may run a timer (its ``_clock_resolution``)."""


def _layout() -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id="m", block_tokens=16)


async def _file_tier(root: Path) -> FileTier:
    config = FileTierConfig(
        root=root,
        bytes_to_use=FileTier.budget_for(32, BLOCK),
        io_engine="threads",
        queue_depth=4,
    )
    return await FileTier.open(config, _layout(), block_bytes=BLOCK)


class TestSlowFileTier(TierSuite):
    """The whole tier contract holds through the wrapper (a 1 ms delay on every load).

    ``damage`` is left to the file tier's own suite: the wrapper hands the
    inner load's outcome on unchanged (a miss included, checked below).
    """

    block_bytes = BLOCK

    @pytest_asyncio.fixture
    async def open_tier(self, tmp_path: Path) -> AsyncIterator[OpenTier]:
        opened: list[SlowTier] = []

        async def _open() -> Tier:
            inner = await _file_tier(tmp_path / f"tier{len(opened)}")
            opened.append(SlowTier(inner, read_delay_s=0.001))
            return opened[-1]

        yield _open
        for tier in opened:
            await tier.aclose()

    def verification_failures(self, stats: Any) -> int:
        return int(stats.quarantined)


@pytest_asyncio.fixture
async def file_tier(tmp_path: Path) -> AsyncIterator[FileTier]:
    tier = await _file_tier(tmp_path / "tier")
    try:
        yield tier
    finally:
        await tier.aclose()


async def _stored(tier: Tier, keys: list[bytes]) -> None:
    rows = Rows(len(keys), BLOCK).fill(keys)
    result = await tier.store(keys, rows.rows())
    assert list(result.stored) == keys


async def _timed(loop: asyncio.AbstractEventLoop, done: Completion[LoadResult]) -> float:
    """The loop time at which ``done``'s callbacks ran."""
    at: asyncio.Future[float] = loop.create_future()
    done.add_done_callback(lambda _c: at.set_result(loop.time()))
    return await at


async def test_a_load_completes_no_earlier_than_its_delay_with_the_real_bytes(
    file_tier: FileTier,
) -> None:
    slow = SlowTier(file_tier, read_delay_s=0.05)
    keys = block_keys(3)
    await _stored(slow, keys)
    rows = Rows(4, BLOCK)
    loop = asyncio.get_running_loop()
    submitted = loop.time()
    done = slow.load([*keys, block_keys(1, salt=9)[0]], rows.rows())
    ended = await _timed(loop, done)
    assert ended >= submitted + 0.05 - EARLY
    result = done.result()
    assert list(result.loaded) == keys
    assert list(result.missing) == block_keys(1, salt=9)  # a miss is the real one
    for i, k in enumerate(keys):
        assert bytes(rows.row(i)) == pattern(k, BLOCK)
    assert slow.statistics().hits == 3  # the inner tier's counts


async def test_the_real_load_ends_long_before_the_slow_one(file_tier: FileTier) -> None:
    slow = SlowTier(file_tier, read_delay_s=HOUR)
    keys = block_keys(2)
    await _stored(slow, keys)
    rows = Rows(2, BLOCK)
    held = slow.load(keys, rows.rows())
    # The same blocks straight from the inner tier, loaded after the slow load
    # was submitted: done, while the slow one is still held back.
    assert list((await file_tier.load(keys, Rows(2, BLOCK).rows())).loaded) == keys
    await asyncio.sleep(0.01)
    assert not held.done()
    assert slow.held == 1


async def test_loads_share_the_link_in_the_order_submitted(file_tier: FileTier) -> None:
    # 4 blocks at 20 blocks/s: 0.2 s, then 2 more: 0.1 s after the first lets go.
    slow = SlowTier(file_tier, bandwidth=20 * BLOCK)
    keys = block_keys(6)
    await _stored(slow, keys)
    loop = asyncio.get_running_loop()
    submitted = loop.time()
    first = slow.load(keys[:4], Rows(4, BLOCK).rows())
    second = slow.load(keys[4:], Rows(2, BLOCK).rows())
    ends = await asyncio.gather(_timed(loop, first), _timed(loop, second))
    assert ends[0] >= submitted + 0.2 - EARLY
    assert ends[1] >= submitted + 0.3 - EARLY
    assert ends[0] <= ends[1]
    assert list(first.result().loaded) == keys[:4]
    assert list(second.result().loaded) == keys[4:]


async def test_stores_and_lookups_are_not_slowed(file_tier: FileTier) -> None:
    slow = SlowTier(file_tier, read_delay_s=HOUR, bandwidth=1.0)
    keys = block_keys(2)
    stored = slow.store(keys, Rows(2, BLOCK).fill(keys).rows())
    result: StoreResult = await asyncio.wait_for(stored, HOUR)  # no delay: real time
    assert list(result.stored) == keys
    assert slow.lookup(keys) == 2
    assert all(slow.is_ready(k) and k in slow for k in keys)
    slow.remove(keys[1:])
    assert slow.lookup(keys) == 1
    assert slow.held == 0


async def test_no_delay_hands_out_the_real_completion(file_tier: FileTier) -> None:
    slow = SlowTier(file_tier)
    keys = block_keys(1)
    await _stored(slow, keys)
    done = slow.load(keys, Rows(1, BLOCK).rows())
    assert slow.held == 0
    assert list((await done).loaded) == keys


async def test_closing_releases_every_held_load_with_its_real_outcome(tmp_path: Path) -> None:
    slow = SlowTier(await _file_tier(tmp_path / "tier"), read_delay_s=HOUR)
    keys = block_keys(2)
    await _stored(slow, keys)
    rows = Rows(2, BLOCK)
    held = slow.load(keys, rows.rows())
    await slow.aclose()
    assert held.done()
    assert list(held.result().loaded) == keys
    assert bytes(rows.row(1)) == pattern(keys[1], BLOCK)
    assert slow.closed
    await slow.aclose()  # idempotent


async def test_bad_arguments_raise_before_anything_is_held(file_tier: FileTier) -> None:
    slow = SlowTier(file_tier, read_delay_s=HOUR)
    with pytest.raises(InvalidArgumentError):
        slow.load(block_keys(2), Rows(1, BLOCK).rows())
    assert slow.held == 0


@pytest.mark.parametrize(
    ("delay", "bandwidth"), [(-1.0, None), (float("inf"), None), (0.0, 0.0)], ids=str
)
def test_nonsense_delays_are_refused(
    file_tier: FileTier, delay: float, bandwidth: float | None
) -> None:
    with pytest.raises(InvalidArgumentError):
        SlowTier(file_tier, read_delay_s=delay, bandwidth=bandwidth)


async def test_it_has_the_abilities_of_the_file_tier_and_passes_them_on(
    file_tier: FileTier,
) -> None:
    slow = SlowTier(file_tier, read_delay_s=HOUR)
    assert isinstance(slow, SlowTier)
    assert slow.inner is file_tier
    for ability in (Watched, Recovers, Announces):
        assert isinstance(file_tier, ability)
        assert isinstance(slow, ability), ability
    assert not isinstance(file_tier, Refreshable)
    assert not isinstance(slow, Refreshable)
    assert slow.shared is file_tier.shared
    assert slow.block_bytes == BLOCK
    assert not slow.recovering
    stats = slow.statistics()
    assert isinstance(stats, TierStatistics)
    assert isinstance(stats, HasMetrics)
    seen: list[tuple[list[bytes], list[bytes]]] = []
    assert isinstance(slow, Watched)
    slow.watch(lambda added, removed: seen.append((list(added), list(removed))))
    assert seen == [([], [])]  # no other instance on this root
    assert isinstance(slow, Recovers)
    await slow.wait_recovered()
    assert slow.take_recovered_keys() == []
    assert isinstance(slow, Announces)
    assert slow.take_events() == []  # opened without events


class _Plain(Tier):
    """A tier with no optional ability (only the contract's methods)."""

    __slots__ = ()

    block_bytes = BLOCK
    closed = False
    recovering = False

    def lookup(self, keys: Any) -> int:
        return 0

    def is_ready(self, key: bytes) -> bool:
        return False

    def __contains__(self, key: object) -> bool:
        return False

    def touch(self, keys: Any) -> None:
        pass

    def statistics(self) -> Any:
        return None

    def store(self, keys: Any, buffers: Any) -> Any:
        raise NotImplementedError

    def load(self, keys: Any, buffers: Any) -> Any:
        raise NotImplementedError

    def remove(self, keys: Any) -> None:
        pass

    async def aclose(self) -> None:
        pass


class _Refreshing(_Plain):
    __slots__ = ()

    async def refresh(self, keys: Any) -> int:
        return len(keys)


async def test_a_tier_without_abilities_gives_the_wrapper_none() -> None:
    slow = SlowTier(_Plain())
    for ability in (Watched, Recovers, Announces, Refreshable):
        assert not isinstance(slow, ability), ability
    refreshing = SlowTier(_Refreshing())
    assert isinstance(refreshing, Refreshable)
    assert not isinstance(refreshing, Watched)
    assert await refreshing.refresh([b"k" * 16]) == 1
    assert type(SlowTier(_Refreshing())) is type(refreshing)  # one class per set of abilities
