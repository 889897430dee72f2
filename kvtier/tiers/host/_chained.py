"""Private: :class:`ChainedHostTier`, the host tier as a tier of the chain (the Tier contract).

The chain sees the host tier as it sees a file-tier root shared by live
instances: a lower tier it stores every block into (write-through, into this
instance's rows), whose other instances' blocks it follows through
:meth:`ChainedHostTier.watch` (no probe on the lookup path: a lookup answers
from the key map), and reads verified into CPU rows.

**One thread of its own.** The core (:class:`HostTier`) is single-threaded;
every call that changes it (store, load, remove, touch, the peers' refresh)
runs in order on one worker thread of the tier's, so that copying and
checksumming a batch of blocks never holds the event loop, and a completion
resolves when its copy is done. Lookups read the core's key map from the
loop without waiting: a dictionary lookup, a hint like every shared tier's
(a load verifies).

**A load asked for is not evicted by a store queued before it.** The chain
promotes a block from this tier while this instance's own write-through
stores may still be queued on the worker, and a store reuses the least
recently used rows. A :meth:`ChainedHostTier.load` therefore registers its
keys at once, on the loop, and until it has run no store evicts them (they
are ``keep`` of :meth:`HostTier.store_many`): the order in which the chain
decided (this block is on the host, read it) is the order the worker keeps.
What is left is a store that had taken its rows before the load was asked
for, its outcome (which tells the chain of the eviction) still on its way to
the loop: that read misses, and the chain reads the block from the next tier
below that holds it (:meth:`kvtier.chain.Chain.follow_ups`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvtier.config import HostTierConfig
from kvtier.errors import (
    BlockNotFoundError,
    CapacityError,
    ClosedError,
    IntegrityError,
    InvalidArgumentError,
    KVTierError,
)
from kvtier.keys import check_keys
from kvtier.layout import KVLayout
from kvtier.tiers.base import LoadResult, StoreResult, Tier
from kvtier.tiers.host._statistics import HostTierStatistics
from kvtier.tiers.host._tier import HostTier
from kvtier.transfer.completion import Completion

__all__ = ["ChainedHostTier"]

log = logging.getLogger("kvtier.tiers.host")

_Listener = Callable[[Sequence[bytes], Sequence[bytes]], None]
T = TypeVar("T")


class ChainedHostTier(Tier):
    """This instance's hold on the host tier, behind :class:`~kvtier.tiers.base.Tier`.

    Open it with :meth:`open` (the tier factory does, for a
    :class:`~kvtier.config.HostTierConfig` in the chain). It follows
    :class:`~kvtier.tiers.base.Watched` (the other instances' blocks, picked
    up every ``peer_poll_s``), :class:`~kvtier.tiers.base.Refreshable` (picked up
    now); its statistics record has metric figures of
    its own (:class:`~kvtier.tiers.base.HasMetrics`).
    """

    __slots__ = (
        "_closed",
        "_config",
        "_core",
        "_handle",
        "_loop",
        "_pending",
        "_prefault",
        "_reading",
        "_reading_lock",
        "_removing",
        "_ticking",
        "_watchers",
        "_worker",
    )

    def __init__(self, core: HostTier, config: HostTierConfig) -> None:
        self._core = core
        self._config = config
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._watchers: list[_Listener] = []
        self._handle: asyncio.TimerHandle | None = None
        self._ticking = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvtier-host-tier")
        self._pending: set[asyncio.Future[object]] = set()
        self._removing: set[bytes] = set()
        """Keys :meth:`remove` dropped whose removal the worker has not done yet."""
        self._reading: dict[bytes, int] = {}
        """Keys of loads asked for and not run yet, with how many loads want each:
        no store evicts them meanwhile. Changed on the loop and on the worker."""
        self._reading_lock = threading.Lock()
        # The peers' rows entered in this process's page tables in the background,
        # so that a first read of one does not pay its page faults (HostTier.prefault).
        self._prefault = threading.Thread(
            target=core.prefault, args=(lambda: self._closed,), name="kvtier-host-prefault"
        )
        self._prefault.start()

    @classmethod
    async def open(
        cls, config: HostTierConfig, layout: KVLayout, *, block_bytes: int
    ) -> ChainedHostTier:
        """Create the host segment of ``layout``'s namespace, or join it.

        Joining may wait for the segment's mutex (another instance opening or
        closing): it runs off the event loop.

        Raises
        ------
        ConfigurationError
            A live segment of this namespace with another ``bytes_to_use`` or
            ``instances`` (both values named).
        NamespaceMismatchError
            A live segment of this namespace with another block size.
        CapacityError
            Every instance slot is held by a live instance, the budget gives
            an instance no row, or the machine lacks the memory.
        """
        core = await asyncio.to_thread(
            HostTier.open,
            layout.namespace,
            block_bytes,
            config.bytes_to_use,
            config.instances,
            directory=str(config.directory),
            lease_ttl_s=config.lease_ttl_s,
            orphan_grace_s=config.orphan_grace_s,
        )
        return cls(core, config)

    @property
    def host(self) -> HostTier:
        """The shared-memory core (its own statistics, adoption, the segment's path)."""
        return self._core

    # -- capabilities -------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self._core.geometry.row_bytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def recovering(self) -> bool:
        return False

    # -- queries --------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._check_open()
        core = self._core
        n = 0
        hidden = self._removing
        for key in keys:
            if key not in core or key in hidden:
                break
            n += 1
        return n

    def is_ready(self, key: bytes) -> bool:
        return not self._closed and key in self._core and key not in self._removing

    def __contains__(self, key: object) -> bool:
        return not self._closed and key in self._core and key not in self._removing

    def touch(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        keys = list(keys)
        self._submit(lambda: self._core.touch(keys))

    def statistics(self) -> HostTierStatistics:
        return self._core.statistics()

    # -- moving bytes -----------------------------------------------------------------------

    def store(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview]
    ) -> Completion[StoreResult]:
        self._check_args(keys, buffers, writable=False)
        keys, buffers = list(keys), list(buffers)
        return self._submit(lambda: self._store(keys, buffers))

    def _store(self, keys: list[bytes], buffers: list[memoryview]) -> StoreResult:
        core = self._core
        with self._reading_lock:
            keep = frozenset(self._reading)  # loads asked for before this store runs
        stored_flags = core.store_many(keys, buffers, keep=keep)
        stored, skipped = [], []
        failed: dict[bytes, KVTierError] = {}
        for key, ok in zip(keys, stored_flags, strict=True):
            if ok:
                stored.append(key)
            elif key in core:
                skipped.append(key)
            else:
                failed[key] = CapacityError(
                    f"host tier: no row for block {key.hex()} (every row of this instance "
                    "is being read, by another instance or by a load queued here)"
                )
        return StoreResult(tuple(stored), tuple(skipped), failed, tuple(core.take_evicted()))

    def load(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Completion[LoadResult]:
        """Copy blocks into ``buffers``, verified (the Tier contract).

        Notes
        -----
        The keys are registered before this returns: a store queued on the
        tier's worker ahead of this load does not evict them (see the module).
        """
        self._check_args(keys, buffers, writable=True)
        keys, buffers = list(keys), list(buffers)
        self._want(keys, 1)
        try:
            return self._submit(lambda: self._load(keys, buffers))
        except BaseException:
            self._want(keys, -1)
            raise

    def _want(self, keys: list[bytes], n: int) -> None:
        """Count ``n`` more (or fewer) loads wanting each of ``keys`` (loop or worker)."""
        with self._reading_lock:
            reading = self._reading
            for key in keys:
                left = reading.get(key, 0) + n
                if left > 0:
                    reading[key] = left
                else:
                    reading.pop(key, None)

    def _load(self, keys: list[bytes], buffers: list[memoryview]) -> LoadResult:
        try:
            return self._load_now(keys, buffers)
        finally:
            self._want(keys, -1)  # read (or failed): its rows may go to the next store

    def _load_now(self, keys: list[bytes], buffers: list[memoryview]) -> LoadResult:
        core = self._core
        # A block of this instance's own rows fails only by damage (nobody
        # else writes them); a peer's can also be reused under the read.
        own = [core.owns(k) for k in keys]
        flags = core.load_many(keys, buffers)
        loaded = []
        missing: dict[bytes, KVTierError] = {}
        for key, ok, mine in zip(keys, flags, own, strict=True):
            if ok:
                loaded.append(key)
            elif mine:
                missing[key] = IntegrityError(
                    f"host tier: block {key.hex()} failed verification in this instance's row "
                    "(dropped)"
                )
            else:
                missing[key] = BlockNotFoundError(
                    f"host tier: block {key.hex()} is not held on the host "
                    "(or its row was reused while it was read)"
                )
        return LoadResult(tuple(loaded), missing)

    def remove(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        self._check_open()
        gone = set(keys) - self._removing
        if not gone:
            return
        self._removing |= gone  # hidden from lookups at once, dropped on the worker

        def drop() -> None:
            for key in gone:
                self._core.remove(key)

        def done(_c: Completion[None]) -> None:
            self._removing -= gone

        self._submit(drop).add_done_callback(done)

    # -- peers ----------------------------------------------------------------------------

    def watch(self, listener: _Listener) -> None:
        """Call ``listener(added, removed)`` on the tier's loop as blocks of the host come
        and go: first with every block the host holds, then every ``peer_poll_s``
        with the changes (this instance's own stores and evictions among them: the
        chain learns those twice, harmlessly)."""
        self._check_open()
        first = not self._watchers
        self._watchers.append(listener)
        held = self._submit(self._everything)

        def deliver(c: Completion[list[bytes]]) -> None:
            if c.exception() is None:
                self._call(listener, c.result(), ())

        held.add_done_callback(deliver)
        if first:
            self._handle = self._loop.call_later(self._config.peer_poll_s, self._tick)

    async def refresh(self, keys: Sequence[bytes]) -> int:
        """Pick up what the other instances stored and evicted now (not at the next
        poll); return :meth:`lookup` of ``keys`` (:class:`~kvtier.tiers.base.Refreshable`)."""
        check_keys(keys)
        self._check_open()
        self._changed(await self._submit(self._changes))
        return self.lookup(keys)

    def _everything(self) -> list[bytes]:
        core = self._core
        core.refresh()
        core.take_changes()
        return core.held_keys()

    def _changes(self) -> tuple[list[bytes], list[bytes]]:
        self._core.refresh()
        return self._core.take_changes()

    def _tick(self) -> None:
        self._handle = None
        if self._closed:
            return
        if not self._ticking:  # the last refresh is still queued behind copies
            self._ticking = True
            self._submit(self._changes).add_done_callback(self._ticked)
        self._handle = self._loop.call_later(self._config.peer_poll_s, self._tick)

    def _ticked(self, c: Completion[tuple[list[bytes], list[bytes]]]) -> None:
        self._ticking = False
        if c.exception() is not None:
            log.warning("host tier: refreshing the peers' blocks failed: %s", c.exception())
            return
        self._changed(c.result())

    def _changed(self, changes: tuple[list[bytes], list[bytes]]) -> None:
        added, removed = changes
        if added or removed:
            for listener in list(self._watchers):
                self._call(listener, added, removed)

    @staticmethod
    def _call(listener: _Listener, added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        try:
            listener(added, removed)
        except Exception:  # a listener's bug must not stop the polling
            log.exception("host tier: a watch listener failed")

    def _submit(self, fn: Callable[[], T]) -> Completion[T]:
        """Run ``fn`` on the tier's worker, after what is queued there; its result."""
        out: Completion[T] = Completion(self._loop)
        fut = self._loop.run_in_executor(self._worker, fn)
        self._pending.add(fut)  # type: ignore[arg-type]

        def done(f: asyncio.Future[T]) -> None:
            self._pending.discard(f)
            if f.cancelled():  # pragma: no cover - never cancelled
                out.set_exception(asyncio.CancelledError())
            elif (exc := f.exception()) is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())

        fut.add_done_callback(done)
        return out

    # -- closing ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._watchers.clear()
        # Every copy handed out finishes first (the contract: completions are
        # done when aclose returns), then the core leaves the segment.
        while self._pending:
            await asyncio.wait(list(self._pending))
        await asyncio.to_thread(self._prefault.join)  # stops at its next chunk
        self._worker.shutdown(wait=True)
        self._core.close()

    # -- checks ---------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the host tier is closed")

    def _check_args(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], *, writable: bool
    ) -> None:
        check_keys(keys)
        self._check_open()
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{len(keys)} keys for {len(buffers)} buffers")
        n = self.block_bytes
        for buf in buffers:
            mv = memoryview(buf)
            if mv.nbytes != n:
                raise InvalidArgumentError(f"a buffer of {mv.nbytes} bytes; blocks are {n}")
            if writable and mv.readonly:
                raise InvalidArgumentError("a load needs writable buffers, got a read-only one")
