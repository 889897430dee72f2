"""A tier held in a dict: the :class:`~kvtier.tiers.base.Tier` contract with no I/O.

For tests of what drives tiers (the chain's runtime, a front) without files
or servers, the way httpx tests clients through a mock transport. It keeps the
contract (it passes :class:`~kvtier.testing.tier.TierSuite`): keys checked,
buffers checked, every value verified by its checksum on read, completions that
resolve later on the loop (never inside the call), an optional capacity with
the oldest blocks evicted, ``aclose`` that waits. A test can hold its calls in
flight (:meth:`MemoryTier.hold`, :meth:`MemoryTier.release`) and damage or
drop a value behind its back::

    tier = MemoryTier(block_bytes=4096)
    tier.hold()                       # calls wait until released
    done = tier.store(keys, rows)     # not done
    tier.release()                    # now carried out, in call order
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.errors import (
    BlockNotFoundError,
    ClosedError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
)
from kvtier.keys import check_keys
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.transfer.completion import Completion

__all__ = ["MemoryTier", "MemoryTierStatistics"]

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class MemoryTierStatistics:
    """A :class:`MemoryTier`'s counters (the :class:`~kvtier.tiers.base.TierStatistics` figures)."""

    blocks: int
    """Blocks held now."""
    block_bytes: int
    """Payload bytes of every block."""
    hits: int
    """Blocks loaded."""
    misses: int
    """Blocks asked for and not loaded (absent or damaged)."""
    stores: int
    """Blocks written."""
    store_failures: int
    """Blocks not written (none: a dict does not fail)."""
    bytes_read: int
    """Payload bytes loaded."""
    bytes_written: int
    """Payload bytes written."""
    verification_failures: int
    """Values refused on read: their checksum did not match (see :meth:`MemoryTier.damage`)."""
    evictions: int
    """Blocks evicted for room (with a ``capacity``)."""


class MemoryTier(Tier):
    """A tier in memory (see the module docstring).

    Parameters
    ----------
    block_bytes
        Payload bytes of every block.
    capacity
        Blocks held at most (the oldest stored is evicted first); None: no bound.
    latency_s
        How long after a call its completion resolves (on the loop).
    """

    def __init__(
        self, block_bytes: int, *, capacity: int | None = None, latency_s: float = 0.001
    ) -> None:
        self._block_bytes = block_bytes
        self._capacity = capacity
        self._latency = latency_s
        self._values: dict[bytes, tuple[bytes, bytes]] = {}
        """Key -> (payload, checksum), oldest stored first."""
        self._held: list[Callable[[], None]] | None = None
        self._pending: set[Completion[Any]] = set()
        self._closed = False
        self._counts = dict.fromkeys(
            ("hits", "misses", "stores", "bytes_read", "bytes_written", "refused", "evicted"), 0
        )

    # -- what a test does behind its back ----------------------------------------------

    def hold(self) -> None:
        """From now on calls wait in flight until :meth:`release`."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Carry out the calls held, in call order (each completion resolves soon after)."""
        held, self._held = self._held or [], None
        for run in held:
            run()

    def damage(self, key: bytes) -> None:
        """Spoil ``key``'s stored value (its checksum no longer matches)."""
        payload, checksum = self._values[key]
        self._values[key] = (bytes([payload[0] ^ 0xFF]) + payload[1:], checksum)

    def drop(self, key: bytes) -> None:
        """Forget ``key`` without a trace (as a peer's eviction would)."""
        self._values.pop(key, None)

    # -- the contract ----------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def recovering(self) -> bool:
        return False

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if k not in self._values:
                break
            n += 1
        return n

    def is_ready(self, key: bytes) -> bool:
        return key in self._values

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def touch(self, keys: Sequence[bytes]) -> None:
        pass  # the oldest stored is evicted first, used or not

    def statistics(self) -> MemoryTierStatistics:
        c = self._counts
        return MemoryTierStatistics(
            blocks=len(self._values),
            block_bytes=self._block_bytes,
            hits=c["hits"],
            misses=c["misses"],
            stores=c["stores"],
            store_failures=0,
            bytes_read=c["bytes_read"],
            bytes_written=c["bytes_written"],
            verification_failures=c["refused"],
            evictions=c["evicted"],
        )

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        self._check(keys, buffers, writable=False)

        def run() -> StoreResult:
            stored, skipped, evicted = [], [], []
            for k, buf in zip(keys, buffers, strict=True):
                if k in self._values:
                    skipped.append(k)
                    continue
                while self._capacity is not None and len(self._values) >= self._capacity:
                    victim = next(iter(self._values))
                    del self._values[victim]
                    evicted.append(victim)
                    self._counts["evicted"] += 1
                payload = bytes(buf)
                self._values[k] = (payload, hashlib.blake2b(payload, digest_size=16).digest())
                stored.append(k)
                self._counts["stores"] += 1
                self._counts["bytes_written"] += len(payload)
            return StoreResult(tuple(stored), tuple(skipped), {}, tuple(evicted))

        return self._later(run)

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        self._check(keys, buffers, writable=True)

        def run() -> LoadResult:
            loaded: list[bytes] = []
            missing: dict[bytes, KVTierError] = {}
            for k, buf in zip(keys, buffers, strict=True):
                value = self._values.get(k)
                if value is None:
                    missing[k] = BlockNotFoundError(f"block {k.hex()} is not in the memory tier")
                elif hashlib.blake2b(value[0], digest_size=16).digest() != value[1]:
                    del self._values[k]  # refused and forgotten: never served
                    self._counts["refused"] += 1
                    missing[k] = IntegrityError(f"block {k.hex()} failed its checksum")
                else:
                    buf[:] = value[0]
                    loaded.append(k)
                    self._counts["bytes_read"] += len(value[0])
            self._counts["hits"] += len(loaded)
            self._counts["misses"] += len(missing)
            return LoadResult(tuple(loaded), missing)

        return self._later(run)

    def remove(self, keys: Sequence[bytes]) -> None:
        if self._closed:
            raise ClosedError("the memory tier is closed")
        check_keys(keys)
        for k in keys:
            self._values.pop(k, None)

    async def aclose(self) -> None:
        self._closed = True
        self.release()
        while self._pending:
            await asyncio.wait([asyncio.ensure_future(_settle(c)) for c in self._pending])

    # -- inside ----------------------------------------------------------------------------

    def _check(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], *, writable: bool
    ) -> None:
        if self._closed:
            raise ClosedError("the memory tier is closed")
        check_keys(keys)
        if len(buffers) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys but {len(buffers)} buffers")
        for buf in buffers:
            if memoryview(buf).nbytes != self._block_bytes:
                raise InvalidArgumentError(
                    f"a buffer of {memoryview(buf).nbytes} bytes, not {self._block_bytes}"
                )
            if writable and memoryview(buf).readonly:
                raise InvalidArgumentError("a load buffer is read-only")

    def _later(self, run: Callable[[], R]) -> Completion[R]:
        done: Completion[R] = Completion()
        self._pending.add(done)
        loop = asyncio.get_running_loop()

        def finish() -> None:
            self._pending.discard(done)
            done.set_result(run())

        def start() -> None:
            loop.call_later(self._latency, finish)

        if self._held is not None:
            self._held.append(start)
        else:
            start()
        return done


async def _settle(c: Completion[Any]) -> None:
    with contextlib.suppress(Exception):  # only waiting for it to end
        await c
