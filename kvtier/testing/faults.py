"""Seeded, reproducible fault injection for the data plane.

Wrappers around the real components, not patches of their internals: a test
builds the real I/O engine (or device copier), wraps it, and hands the wrapper
to the component under test through its public constructor::

    plan = FaultPlan(seed=7, rates={"eio": 0.02, "torn_write": 0.01})
    engine = FaultyIOEngine(await open_io_engine("io_uring", queue_depth=8), plan)
    tier = await FileTier.open(config, layout, block_bytes=..., io_engine=engine)

Every decision comes from one ``random.Random(seed)`` drawn in submission
order, so a failing run replays exactly with the same seed and the same
sequence of calls. :attr:`FaultPlan.injected` counts what was injected, by
kind, for the reliability report.

Kinds of fault
--------------
I/O engine (:class:`FaultyIOEngine`):

``eio``, ``enospc``, ``eacces``
    The request fails with :class:`~kvtier.errors.TierIOError` carrying that
    errno; nothing is submitted.
``short_read`` / ``short_write``
    The real request is submitted minus its last ``chunk`` bytes; the result
    is the true (short) count, as ``preadv(2)`` would report it.
``torn_write``
    Only the first half of the bytes (rounded down to ``chunk``) really reach
    the file, the rest of the range gets zeros, and the write reports the full
    length: a lying device. Only a checksum can catch this one.
``latency``
    The request completes ``latency_s`` later than it really did.

Device copier (:class:`FaultyDeviceTransfer`):

``copy_fail``
    The copy fails with :class:`~kvtier.errors.TransferError` before any byte
    moves.
``partial_copy``
    The copy really runs, then fails with :class:`~kvtier.errors.TransferError`
    as if it had stopped part way: whatever the request wrote is garbage to
    the caller.

A slow tier
-----------
:class:`SlowTier` wraps a real :class:`~kvtier.tiers.base.Tier` (the file
tier, the cluster tier) and makes its loads slower, not wrong: a tier slower
than recomputing the blocks it holds, for the load-or-recompute decision
(``decline_slow_loads``) to be tested and benchmarked against::

    tier = SlowTier(await FileTier.open(config, layout, block_bytes=...), read_delay_s=0.5)

Every load's bytes and outcome are the real ones; only the completion comes
later. No seed: nothing is drawn.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import math
import mmap
import os
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, TypeVar, cast

import numpy as np

from kvtier.errors import InvalidArgumentError, TierIOError, TransferError
from kvtier.manager.events import ManagerEvent
from kvtier.testing.io_engine import _trim
from kvtier.tiers.base import (
    Announces,
    LoadResult,
    Recovers,
    Refreshable,
    StoreResult,
    Tier,
    TierStatistics,
    Watched,
)
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import BlockIds, DeviceTransfer, TransferStatistics
from kvtier.transfer.io_engine import IOEngine

__all__ = [
    "DEVICE_FAULTS",
    "IO_FAULTS",
    "FaultPlan",
    "FaultyDeviceTransfer",
    "FaultyIOEngine",
    "SlowTier",
]

IO_FAULTS: Final = frozenset(
    {"eio", "enospc", "eacces", "short_read", "short_write", "torn_write", "latency"}
)
"""Fault kinds :class:`FaultyIOEngine` understands."""
DEVICE_FAULTS: Final = frozenset({"copy_fail", "partial_copy"})
"""Fault kinds :class:`FaultyDeviceTransfer` understands."""

T = TypeVar("T")
U = TypeVar("U")

_ERRNO: Final = {"eio": errno.EIO, "enospc": errno.ENOSPC, "eacces": errno.EACCES}
_READ_KINDS: Final = ("eio", "eacces", "short_read", "latency")
_WRITE_KINDS: Final = ("eio", "enospc", "eacces", "short_write", "torn_write", "latency")


@dataclass(slots=True)
class FaultPlan:
    """Which faults to inject, how often, from which seed; and what was injected.

    Parameters
    ----------
    seed
        Seed of the one random stream every decision is drawn from.
    rates
        Probability per request for each kind (see the module docstring). The
        kinds that apply to a request are tried in a fixed order and the first
        that fires wins, so rates add up roughly for small values.
    latency_s
        Extra completion delay of a ``latency`` fault.
    chunk
        Granularity of short and torn transfers (keep it the O_DIRECT alignment).
    """

    seed: int
    rates: Mapping[str, float]
    latency_s: float = 0.02
    chunk: int = 4096
    injected: Counter[str] = field(default_factory=Counter)
    """Faults injected so far, by kind."""
    enabled: bool = True
    """Set to False to let every request through (e.g. for a final verification)."""
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = set(self.rates) - IO_FAULTS - DEVICE_FAULTS
        if unknown:
            raise InvalidArgumentError(f"unknown fault kinds {sorted(unknown)}")
        bad = {k: r for k, r in self.rates.items() if not 0.0 <= r <= 1.0}
        if bad:
            raise InvalidArgumentError(f"fault rates must be in [0, 1], got {bad}")
        if self.chunk < 1 or self.latency_s < 0:
            raise InvalidArgumentError("chunk must be >= 1 and latency_s >= 0")
        self._rng = random.Random(self.seed)

    def draw(self, kinds: Sequence[str]) -> str | None:
        """The fault to inject into one request among ``kinds``, or None."""
        if not self.enabled:
            return None
        for kind in kinds:
            rate = self.rates.get(kind, 0.0)
            # Draw for every kind with a rate, fired or not, so one kind's rate
            # does not shift the stream of decisions for the others.
            if rate and self._rng.random() < rate:
                self.injected[kind] += 1
                return kind
        return None

    def fraction(self) -> float:
        """A uniform draw in [0, 1) from the plan's stream (for partial faults)."""
        return self._rng.random()


class FaultyIOEngine(IOEngine):
    """An :class:`~kvtier.transfer.io_engine.IOEngine` that injects faults by plan.

    Parameters
    ----------
    inner
        The real engine; every request that is not failed outright goes to it.
    plan
        What to inject. Share one plan between wrappers to share its stream.

    Notes
    -----
    The wrapper validates (alignment included) like any engine, then passes
    requests on with alignment checks off: the inner engine sees the same,
    already checked, buffers. Closing the wrapper closes the inner engine.
    """

    def __init__(self, inner: IOEngine, plan: FaultPlan) -> None:
        super().__init__(queue_depth=inner.queue_depth)
        self._inner = inner
        self._plan = plan

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def plan(self) -> FaultPlan:
        """The fault plan (its ``injected`` counter says what happened)."""
        return self._plan

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        total = sum(v.nbytes for v in views)
        kind = self._plan.draw(_READ_KINDS if read else _WRITE_KINDS)
        call = self._inner.readv if read else self._inner.writev
        if kind in _ERRNO:
            failed: Completion[int] = Completion()
            code = _ERRNO[kind]
            failed.set_exception(TierIOError(code, f"injected {os.strerror(code)}"))
            return failed
        if kind in ("short_read", "short_write"):
            cut = min(self._plan.chunk, total)
            return (
                call(fd, _trim(views, cut), offset, alignment=1) if cut < total else (_resolved(0))
            )
        if kind == "torn_write":
            # The first half of the bytes lands; the rest of the range is written
            # with zeros (stale sectors): the file has its full size, and only a
            # checksum can tell. The device reports the full length either way.
            keep = (total // 2) // self._plan.chunk * self._plan.chunk
            zeros = mmap.mmap(-1, total - keep, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            parts = [self._inner.writev(fd, [memoryview(zeros)], offset + keep, alignment=1)]
            if keep:
                parts.append(call(fd, _trim(views, total - keep), offset, alignment=1))
            # ``zeros`` is unmapped by the garbage collector once the engine
            # has let go of it (closing it here could race the engine's release).
            return _map(Completion.gather(parts), lambda _r: total)
        real = call(fd, views, offset, alignment=1)
        if kind == "latency":
            return _delayed(real, self._plan.latency_s)
        return real

    def _submit_fsync(self, fd: int) -> Completion[None]:
        return self._inner.fsync(fd)

    def _occupancy(self) -> tuple[int, int]:
        stats = self._inner.statistics()
        return stats.in_flight, stats.queued

    async def aclose(self) -> None:
        await self._inner.aclose()


class FaultyDeviceTransfer(DeviceTransfer):
    """A :class:`~kvtier.transfer.device.DeviceTransfer` that injects copy failures.

    Parameters
    ----------
    inner
        The real copier.
    plan
        What to inject (``copy_fail``, ``partial_copy``).

    Notes
    -----
    The real copy always runs, so the memory it writes really changes; a
    fault only changes what is reported. After a failed store the caller must
    treat every row of the request as garbage, after a failed load every
    device block. Validation errors of bad arguments come from the inner
    copier, unchanged.
    """

    def __init__(self, inner: DeviceTransfer, plan: FaultPlan) -> None:
        self._inner = inner
        self._plan = plan

    @property
    def backend(self) -> str:
        return self._inner.backend

    @property
    def plan(self) -> FaultPlan:
        """The fault plan (its ``injected`` counter says what happened)."""
        return self._plan

    def store(
        self, device_block_ids: BlockIds, rows: Sequence[int] | np.ndarray
    ) -> Completion[None]:
        real = self._inner.store(device_block_ids, rows)
        return self._fault(real, "store", len(rows))

    def load(
        self, rows: Sequence[int] | np.ndarray, device_block_ids: BlockIds, skip: int = 0
    ) -> Completion[None]:
        real = self._inner.load(rows, device_block_ids, skip)
        return self._fault(real, "load", len(rows))

    def _fault(self, real: Completion[None], what: str, rows: int) -> Completion[None]:
        # The real copy always runs (validation included) so that the rows it
        # touched are really touched; the fault only changes what is reported.
        kind = self._plan.draw(("copy_fail", "partial_copy") if rows else ())
        if kind is None:
            return real
        copied = int(self._plan.fraction() * rows) if kind == "partial_copy" else 0
        err = TransferError(f"injected {kind}: {what} failed after {copied} of {rows} rows")
        return _map(real, lambda _r: _raise(err))

    def statistics(self) -> TransferStatistics:
        return self._inner.statistics()

    async def aclose(self) -> None:
        await self._inner.aclose()


class SlowTier(Tier):
    """A :class:`~kvtier.tiers.base.Tier` whose loads complete later than the real ones.

    Parameters
    ----------
    inner
        The real tier, open; every call goes to it. Closing the wrapper closes it.
    read_delay_s
        Each load completes no earlier than this many seconds after it was
        submitted (a round trip, a seek): loads in flight together wait
        side by side.
    bandwidth
        Bytes per second of one link that every load goes through in the
        order submitted (``None``: no cap): a load of ``n`` blocks holds it
        for ``n * block_bytes / bandwidth`` seconds from when the loads
        before it let go, and completes no earlier than that plus
        ``read_delay_s``. Every key asked counts, found or not.

    Notes
    -----
    A load is submitted to ``inner`` at once (bad arguments raise as they
    would) and its completion resolves with the real outcome at the later of
    the real completion and the time above, by ``loop.call_at``: never
    earlier, and only as much later as the event loop is late. The buffers
    are written by the real load, so they are done when the returned
    completion is. Stores, lookups and everything else are the inner tier's,
    unchanged, and so are its optional abilities: the wrapper is
    :class:`~kvtier.tiers.base.Watched`, :class:`~kvtier.tiers.base.Recovers`,
    :class:`~kvtier.tiers.base.Refreshable` or
    :class:`~kvtier.tiers.base.Announces` exactly when ``inner`` is (its
    class is picked per inner tier), and its ``statistics()`` is the inner's
    record (:class:`~kvtier.tiers.base.HasMetrics` included). :meth:`aclose`
    closes ``inner`` (which waits for its loads), then resolves every load
    still held back at once: nothing handed out is left pending.
    """

    __slots__ = ("_bandwidth", "_closing", "_delay", "_free_at", "_held", "_inner")

    def __new__(
        cls, inner: Tier, *, read_delay_s: float = 0.0, bandwidth: float | None = None
    ) -> SlowTier:
        return super().__new__(_slow_class(cls, _abilities(inner)))

    def __init__(
        self, inner: Tier, *, read_delay_s: float = 0.0, bandwidth: float | None = None
    ) -> None:
        if not (read_delay_s >= 0 and math.isfinite(read_delay_s)):
            raise InvalidArgumentError(f"read_delay_s must be >= 0 and finite, got {read_delay_s}")
        if bandwidth is not None and not bandwidth > 0:
            raise InvalidArgumentError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        self._inner = inner
        self._delay = read_delay_s
        self._bandwidth = bandwidth
        self._free_at = 0.0
        """Loop time at which the link's last submitted load lets go of it."""
        self._held: dict[Completion[LoadResult], tuple[Completion[LoadResult], Any]] = {}
        """Loads held back: what was handed out -> the real load, its timer (or None)."""
        self._closing = False

    @property
    def inner(self) -> Tier:
        """The real tier."""
        return self._inner

    @property
    def held(self) -> int:
        """Loads whose completion is being held back now."""
        return len(self._held)

    # -- the inner tier's, unchanged ----------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._inner.block_bytes

    @property
    def closed(self) -> bool:
        return self._inner.closed

    @property
    def recovering(self) -> bool:
        return self._inner.recovering

    @property
    def shared(self) -> bool:
        return self._inner.shared

    def lookup(self, keys: Sequence[bytes]) -> int:
        return self._inner.lookup(keys)

    def is_ready(self, key: bytes) -> bool:
        return self._inner.is_ready(key)

    def __contains__(self, key: object) -> bool:
        return key in self._inner

    def touch(self, keys: Sequence[bytes]) -> None:
        self._inner.touch(keys)

    def statistics(self) -> TierStatistics:
        return self._inner.statistics()

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        return self._inner.store(keys, buffers)

    def remove(self, keys: Sequence[bytes]) -> None:
        self._inner.remove(keys)

    # -- slower loads -------------------------------------------------------------------

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        real = self._inner.load(keys, buffers)
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = now
        if self._bandwidth is not None:
            self._free_at = max(now, self._free_at) + len(keys) * self.block_bytes / self._bandwidth
            due = self._free_at
        due += self._delay
        if due <= now:
            return real
        out: Completion[LoadResult] = Completion(loop)
        self._held[out] = (real, None)

        def arrived(c: Completion[LoadResult]) -> None:
            if self._closing or loop.time() >= due:
                self._release(out)
            elif out in self._held:
                self._held[out] = (c, loop.call_at(due, self._release, out))

        real.add_done_callback(arrived)
        return out

    def _release(self, out: Completion[LoadResult]) -> None:
        real, timer = self._held.pop(out, (None, None))
        if timer is not None:
            timer.cancel()
        if real is None:
            return
        exc = real.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(real.result())

    async def aclose(self) -> None:
        """Close the inner tier (it waits for its loads), then release every held load."""
        self._closing = True
        try:
            await self._inner.aclose()
        finally:
            for out, (real, _timer) in list(self._held.items()):
                if real.done():
                    self._release(out)


# The optional abilities (runtime-checkable Protocols: an attribute makes a class
# have one), each passed on to the inner tier by a mixin; SlowTier's class for an
# inner tier has exactly the inner's.


class _SlowWatched(SlowTier):
    __slots__ = ()

    def watch(self, listener: Callable[[Sequence[bytes], Sequence[bytes]], None]) -> None:
        cast(Watched, self._inner).watch(listener)


class _SlowRecovers(SlowTier):
    __slots__ = ()

    async def wait_recovered(self) -> None:
        await cast(Recovers, self._inner).wait_recovered()

    def take_recovered_keys(self) -> list[bytes]:
        return cast(Recovers, self._inner).take_recovered_keys()


class _SlowRefreshable(SlowTier):
    __slots__ = ()

    async def refresh(self, keys: Sequence[bytes]) -> int:
        return await cast(Refreshable, self._inner).refresh(keys)


class _SlowAnnounces(SlowTier):
    __slots__ = ()

    def take_events(self) -> list[ManagerEvent]:
        return cast(Announces, self._inner).take_events()


_ABILITIES: Final = (
    (Watched, _SlowWatched),
    (Recovers, _SlowRecovers),
    (Refreshable, _SlowRefreshable),
    (Announces, _SlowAnnounces),
)


def _abilities(inner: Tier) -> tuple[type[SlowTier], ...]:
    return tuple(mixin for ability, mixin in _ABILITIES if isinstance(inner, ability))


@functools.cache
def _slow_class(base: type[SlowTier], mixins: tuple[type[SlowTier], ...]) -> type[SlowTier]:
    if not mixins:
        return base
    return cast(type[SlowTier], type(base.__name__, (*mixins, base), {"__slots__": ()}))


# -- helpers ----------------------------------------------------------------------------


def _resolved(value: int) -> Completion[int]:
    done: Completion[int] = Completion()
    done.set_result(value)
    return done


def _raise(exc: BaseException) -> NoReturn:
    raise exc


def _map(real: Completion[T], fn: Callable[[T], U]) -> Completion[U]:
    """A completion resolved by ``fn(result)`` once ``real`` is done (errors pass through)."""
    out: Completion[U] = Completion()

    def done(c: Completion[T]) -> None:
        exc = c.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(fn(c.result()))
        except BaseException as err:
            out.set_exception(err)

    real.add_done_callback(done)
    return out


def _delayed(real: Completion[int], delay: float) -> Completion[int]:
    """``real``, reported ``delay`` seconds after it really completed."""
    out: Completion[int] = Completion()
    loop = asyncio.get_running_loop()

    def later(c: Completion[int]) -> None:
        exc = c.exception()
        if exc is not None:
            loop.call_later(delay, out.set_exception, exc)
        else:
            loop.call_later(delay, out.set_result, c.result())

    real.add_done_callback(later)
    return out
