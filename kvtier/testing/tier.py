"""Conformance suite for :class:`~kvtier.tiers.base.Tier`, the contract below the CPU region.

Subclass :class:`TierSuite` once per implementation, give it an
``open_tier`` fixture (an async function returning a fresh, empty tier; the
fixture closes what it opened) and a :meth:`TierSuite.damage` that spoils a
stored value behind the tier's back; pytest collects every check for it::

    class TestMyTier(TierSuite):
        @pytest_asyncio.fixture
        async def open_tier(self) -> AsyncIterator[OpenTier]:
            opened = []
            async def _open() -> Tier:
                opened.append(await MyTier.open(...))
                return opened[-1]
            yield _open
            for t in opened:
                await t.aclose()

        async def damage(self, tier: Tier, key: bytes) -> None:
            ...  # flip a payload byte of key's stored value

The checks fix the contract, not a tier's policy: round trips byte for byte,
misses, skipped stores of present keys, verification (a damaged value is a
counted miss, never served), removal, statistics, cancellation of an awaiter,
``aclose`` (waits, idempotent, then :class:`~kvtier.errors.ClosedError`), and
bad input (a typed error before any I/O, nothing stored lost).
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from kvtier.errors import BlockNotFoundError, ClosedError, InvalidArgumentError, KVTierError
from kvtier.testing.io_engine import cancel_one_awaiter
from kvtier.tiers.base import Tier, TierStatistics

__all__ = ["OpenTier", "Rows", "TierSuite", "block_keys", "pattern"]

OpenTier = Callable[[], Awaitable[Tier]]
"""What a suite's ``open_tier`` fixture yields: opens a fresh, empty tier."""


def block_keys(n: int, salt: int = 0) -> list[bytes]:
    """``n`` distinct 16-byte keys; another ``salt`` gives other keys."""
    return [bytes([salt, i & 0xFF, i >> 8]) * 5 + b"k" for i in range(n)]


def pattern(key: bytes, nbytes: int, salt: int = 0) -> bytes:
    """A payload that is a function of its key (and ``salt``), so any load can be checked."""
    unit = bytes(b ^ salt for b in key)
    return (unit * (nbytes // len(unit) + 1))[:nbytes]


class Rows:
    """Page-aligned rows in one anonymous mapping, like a CPU region's."""

    def __init__(self, n: int, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.map = mmap.mmap(-1, max(1, n) * block_bytes)
        self.n = n

    def row(self, i: int) -> memoryview:
        """Row ``i``, writable."""
        return memoryview(self.map)[i * self.block_bytes : (i + 1) * self.block_bytes]

    def rows(self) -> list[memoryview]:
        """Every row, in order."""
        return [self.row(i) for i in range(self.n)]

    def fill(self, keys: list[bytes], salt: int = 0) -> Rows:
        """Write each key's :func:`pattern` into its row."""
        for i, k in enumerate(keys):
            self.row(i)[:] = pattern(k, self.block_bytes, salt)
        return self


class TierSuite:
    """Checks every :class:`~kvtier.tiers.base.Tier` must pass; see the module docstring."""

    block_bytes: ClassVar[int] = 8192
    """Payload bytes of the blocks the suite's tiers are opened for."""

    @pytest_asyncio.fixture
    async def tier(self, open_tier: OpenTier) -> AsyncIterator[Tier]:
        """A fresh, empty tier from the subclass's ``open_tier``."""
        yield await open_tier()

    async def damage(self, tier: Tier, key: bytes) -> None:
        """Spoil ``key``'s stored value (one payload byte) behind the tier's back."""
        pytest.skip(f"{type(self).__name__} has no way to damage a stored value")

    def verification_failures(self, stats: Any) -> int:
        """The counter of values refused on read in ``stats`` (names differ per tier)."""
        return int(stats.verification_failures)

    # -- helpers ------------------------------------------------------------------------

    async def stored(self, tier: Tier, keys: list[bytes], salt: int = 0) -> Rows:
        """Store each key's pattern and check that every key was stored."""
        rows = Rows(len(keys), self.block_bytes).fill(keys, salt)
        result = await tier.store(keys, rows.rows())
        assert list(result.stored) == keys, result.failed
        return rows

    async def loaded(self, tier: Tier, keys: list[bytes]) -> tuple[Any, Rows]:
        """Load ``keys`` into fresh rows: the result and the rows."""
        rows = Rows(len(keys), self.block_bytes)
        result = await tier.load(keys, rows.rows())
        return result, rows

    def check_payloads(self, rows: Rows, keys: list[bytes], salt: int = 0) -> None:
        """Each row holds its key's pattern, byte for byte."""
        for i, k in enumerate(keys):
            assert bytes(rows.row(i)) == pattern(k, self.block_bytes, salt), f"block {i} differs"

    # -- round trips and misses ---------------------------------------------------------

    async def test_round_trip(self, tier: Tier) -> None:
        ks = block_keys(6)
        await self.stored(tier, ks)
        assert tier.lookup(ks) == len(ks)
        assert all(tier.is_ready(k) and k in tier for k in ks)
        result, rows = await self.loaded(tier, ks)
        assert list(result.loaded) == ks
        assert not result.missing
        self.check_payloads(rows, ks)

    async def test_lookup_is_the_ready_prefix(self, tier: Tier) -> None:
        ks = block_keys(5)
        await self.stored(tier, ks[:2] + ks[3:])
        assert tier.lookup(ks) == 2
        assert tier.lookup([ks[2], *ks[3:]]) == 0
        assert tier.lookup([]) == 0
        assert not tier.is_ready(ks[2])
        assert ks[2] not in tier

    async def test_absent_keys_are_misses(self, tier: Tier) -> None:
        present, absent = block_keys(2), block_keys(2, salt=9)
        await self.stored(tier, present)
        result, rows = await self.loaded(tier, [absent[0], present[0], absent[1], present[1]])
        assert set(result.loaded) == set(present)
        assert set(result.missing) == set(absent)
        assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
        assert bytes(rows.row(1)) == pattern(present[0], self.block_bytes)

    async def test_present_keys_are_skipped(self, tier: Tier) -> None:
        ks = block_keys(3)
        await self.stored(tier, ks[:2])
        rows = Rows(3, self.block_bytes).fill(ks, salt=0x5A)
        result = await tier.store(ks, rows.rows())
        assert set(result.skipped) == set(ks[:2])
        assert list(result.stored) == [ks[2]]
        loaded, out = await self.loaded(tier, ks)
        assert list(loaded.loaded) == ks
        # The first bytes stored under a key stay: a key names its content.
        self.check_payloads(out, ks[:2])
        assert bytes(out.row(2)) == pattern(ks[2], self.block_bytes, 0x5A)

    async def test_empty_calls(self, tier: Tier) -> None:
        stored = await tier.store([], [])
        assert stored.stored == stored.skipped == ()
        assert not stored.failed
        loaded = await tier.load([], [])
        assert loaded.loaded == ()
        assert not loaded.missing

    # -- verification -------------------------------------------------------------------

    async def test_damaged_value_is_a_counted_miss(self, tier: Tier) -> None:
        ks = block_keys(3)
        await self.stored(tier, ks)
        before = self.verification_failures(tier.statistics())
        await self.damage(tier, ks[1])
        result, rows = await self.loaded(tier, ks)
        assert set(result.loaded) == {ks[0], ks[2]}
        assert set(result.missing) == {ks[1]}
        err = result.missing[ks[1]]
        assert isinstance(err, KVTierError)
        assert not isinstance(err, BlockNotFoundError), "a damaged value is not an absent one"
        assert self.verification_failures(tier.statistics()) == before + 1
        self.check_payloads(rows, ks[:1])
        # Forgotten: never served again.
        assert not tier.is_ready(ks[1])
        again, _ = await self.loaded(tier, [ks[1]])
        assert not again.loaded

    # -- removal ------------------------------------------------------------------------

    async def test_remove(self, tier: Tier) -> None:
        ks = block_keys(4)
        await self.stored(tier, ks)
        tier.remove([ks[1], *block_keys(1, salt=7)])  # absent keys are ignored
        assert tier.lookup(ks) == 1
        assert not tier.is_ready(ks[1])
        await asyncio.sleep(0.05)  # a tier may drop the bytes in the background
        result, _ = await self.loaded(tier, ks)
        assert set(result.missing) == {ks[1]}
        # A removed key can be stored again.
        await self.stored(tier, [ks[1]])
        assert tier.lookup(ks) == 4

    # -- statistics ---------------------------------------------------------------------

    async def test_statistics_count_transfers(self, tier: Tier) -> None:
        s0 = tier.statistics()
        assert isinstance(s0, TierStatistics)
        assert s0.block_bytes == self.block_bytes
        ks = block_keys(4)
        await self.stored(tier, ks)
        await self.loaded(tier, [*ks[:3], *block_keys(2, salt=3)])
        s = tier.statistics()
        assert s.stores - s0.stores == 4
        assert s.bytes_written - s0.bytes_written == 4 * self.block_bytes
        assert s.hits - s0.hits == 3
        assert s.misses - s0.misses == 2
        assert s.bytes_read - s0.bytes_read == 3 * self.block_bytes
        assert s.blocks - s0.blocks == 4
        assert s.store_failures == s0.store_failures

    # -- cancellation and closing -------------------------------------------------------

    async def test_cancelled_awaiter_does_not_cancel_the_transfer(self, tier: Tier) -> None:
        ks = block_keys(4)
        rows = Rows(4, self.block_bytes).fill(ks)
        done = tier.store(ks, rows.rows())
        await cancel_one_awaiter(done)
        result = await done
        assert list(result.stored) == ks
        loaded, out = await self.loaded(tier, ks)
        assert list(loaded.loaded) == ks
        self.check_payloads(out, ks)

    async def test_aclose_waits_and_is_idempotent(self, tier: Tier) -> None:
        ks = block_keys(4)
        rows = Rows(4, self.block_bytes).fill(ks)
        done = tier.store(ks, rows.rows())
        await tier.aclose()
        assert done.done(), "aclose returned with a transfer in flight"
        assert tier.closed
        await tier.aclose()
        assert tier.closed

    async def test_calls_after_close_raise(self, tier: Tier) -> None:
        ks = block_keys(2)
        await self.stored(tier, ks)
        await tier.aclose()
        rows = Rows(2, self.block_bytes)
        with pytest.raises(ClosedError):
            tier.store(ks, rows.rows())
        with pytest.raises(ClosedError):
            tier.load(ks, rows.rows())
        with pytest.raises(ClosedError):
            tier.remove(ks)

    # -- bad input ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        "case",
        [
            "short-key",
            "str-key",
            "duplicate-keys",
            "fewer-buffers",
            "small-buffer",
            "large-buffer",
            "read-only-load-buffer",
        ],
    )
    async def test_bad_input_is_refused_and_loses_nothing(self, tier: Tier, case: str) -> None:
        ks = block_keys(3)
        await self.stored(tier, ks)
        new = block_keys(2, salt=4)
        rows = Rows(2, self.block_bytes).fill(new)
        bufs: list[Any] = rows.rows()
        keys: list[Any] = list(new)
        op: Callable[[Any, Any], object] = tier.store
        if case == "short-key":
            keys[1] = b"short"
        elif case == "str-key":
            keys[1] = "k" * 16
        elif case == "duplicate-keys":
            keys[1] = keys[0]
        elif case == "fewer-buffers":
            bufs = bufs[:1]
        elif case == "small-buffer":
            bufs[1] = bufs[1][: self.block_bytes // 2]
        elif case == "large-buffer":
            bufs[1] = memoryview(bytearray(self.block_bytes * 2))
        elif case == "read-only-load-buffer":
            op = tier.load
            keys = ks[:2]
            # Page-aligned, so that a tier checking alignment first sees only this.
            bufs[1] = memoryview(mmap.mmap(-1, self.block_bytes, prot=mmap.PROT_READ))
        with pytest.raises(InvalidArgumentError):
            op(keys, bufs)
        assert not any(tier.is_ready(k) for k in new), "a refused call stored something"
        result, out = await self.loaded(tier, ks)
        assert list(result.loaded) == ks
        self.check_payloads(out, ks)
