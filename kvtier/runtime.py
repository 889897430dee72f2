"""The one front runtime: between a :class:`~kvtier.chain.Chain`'s decisions and its tiers.

Both fronts drive one chain the same way; this module is that way, written
once. A :class:`Runtime` takes the chain's intents, numbers nothing itself
(every intent carries the chain's sequence number, and its outcome names the
intent), carries them out on the tiers' event loop through a
:class:`~kvtier.tier_driver.TierDriver`, and hands the outcomes back to the
chain on the thread that owns it. It also seeds the chain with what a tier
recovered at open (:class:`~kvtier.tiers.base.Recovers`) and follows what
other instances write to a shared tier (:class:`~kvtier.tiers.base.Watched`)::

    owner thread (the chain's)                    the tiers' loop
    dispatch(): chain.take_intents() ----------->  driver.carry_out(intent)
                                                   ... tier I/O ...
    chain.settle(outcome), on_outcome(outcome) <-  outcome (same loop: at once;
                                                   else queued until drain())

Two ways to hand outcomes back, one code path:

* **inline** (the :class:`~kvtier.engine.Engine`): the chain, the front and
  the tiers share one event loop; an outcome is settled as it arrives, and
  each intent has a :class:`~kvtier.transfer.completion.Completion` that the
  front may await (:meth:`Runtime.completion`).
* **queued** (the vLLM front): the chain lives on vLLM's scheduler thread,
  which never waits; outcomes (and peers' changes, folded per key) are
  queued on the loop thread and settled by :meth:`Runtime.drain` at the
  start of every scheduler call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvtier.chain import Chain, Intent, Outcome, TierChanged, Write, Written
from kvtier.region import CPURegion
from kvtier.tier_driver import TierDriver
from kvtier.tiers.base import Recovers, Tier, Watched
from kvtier.transfer.completion import Completion

__all__ = ["Runtime"]

_SEED_TIMEOUT_S = 60.0


class Runtime:
    """Carries a chain's intents out on its tiers' loop; settles their outcomes on the chain.

    Parameters
    ----------
    chain
        The chain; called only on its owner's thread.
    tiers, names
        The open tiers below the CPU region, in the chain's order, and their names.
    region
        The CPU region whose rows the intents name.
    loop
        The event loop that owns the tiers.
    queued
        False: the owner runs on ``loop`` (outcomes settled at once). True:
        the owner is another thread (outcomes queued until :meth:`drain`).
    on_start
        Called on the loop as each intent is carried out (e.g. to time it).
    on_end
        Called on the loop as each intent's outcome arrives, before it is
        settled or queued (e.g. to time it).
    on_outcome
        Called on the owner's thread after the chain settled an outcome of an
        intent (not for :class:`~kvtier.chain.TierChanged`).
    on_tier_call
        Called on the loop after each outcome, with the tier's index (e.g. to
        take a statistics snapshot or the tier's own events, :meth:`hand_over`).
    on_handed
        Called on the owner's thread, in order with the outcomes, for each
        object :meth:`hand_over` queued.

    Notes
    -----
    Every intent gets exactly one outcome, also when a tier refuses it or
    :meth:`stop_writes` was called (a write then "fails" at once, and its
    pins go): the chain's pins are only ever released through outcomes.
    """

    def __init__(
        self,
        chain: Chain,
        tiers: Sequence[Tier],
        names: Sequence[str],
        region: CPURegion,
        loop: asyncio.AbstractEventLoop,
        *,
        queued: bool,
        on_start: Callable[[Intent], None] | None = None,
        on_end: Callable[[Outcome], None] | None = None,
        on_outcome: Callable[[Outcome], None] | None = None,
        on_tier_call: Callable[[int], None] | None = None,
        on_handed: Callable[[Any], None] | None = None,
    ) -> None:
        self.chain = chain
        self.tiers = list(tiers)
        self.names = list(names)
        self._loop = loop
        self._queued = queued
        self._on_start = on_start
        self._on_end = on_end
        self._on_outcome = on_outcome
        self._on_handed = on_handed
        self._on_tier_call = on_tier_call
        self._driver = TierDriver(tiers, names, region, self._arrived, on_tier_call)
        self._done: dict[int, Completion[None]] = {}
        """Inline: the completion of each intent carried out and not settled yet, by seq."""
        # Queued: filled on the loop thread, drained on the owner's. Deque
        # append and popleft are atomic: the two threads need no lock for it.
        self._queue: collections.deque[Any] = collections.deque()
        self._peer_lock = threading.Lock()
        self._peer_changes: dict[int, dict[bytes, bool]] = {}
        """Queued: peers' changes folded per key (an idle owner drains nothing,
        and a queue of every change would grow with the peers' traffic)."""
        self._writes_stopped = False
        self._seeding: set[Future[None] | asyncio.Future[None]] = set()
        self.abandoned = 0
        """Blocks of writes dropped after :meth:`stop_writes`."""
        self._dropped: set[int] = set()

    # -- owner thread ---------------------------------------------------------------------

    def start(self) -> None:
        """Seed the chain with what the tiers recovered, and follow peers' writes.

        A tier still recovering in the background holds its write-back blocks
        in their rows (:meth:`Chain.recovering`) until its recovery ends.
        Queued: blocks until the tiers' loop has taken the calls.
        """
        for i, tier in enumerate(self.tiers):
            if isinstance(tier, Recovers):
                if tier.recovering:  # its blocks join the chain once the scan ends
                    self.chain.recovering(i)
                    self._spawn(self._seed(i, tier))
                else:  # found at open: known before the first lookup
                    keys = self._on_loop(_recovered(tier))
                    self.chain.settle(TierChanged(i, added=tuple(keys)))
            if isinstance(tier, Watched):
                self._on_loop(_watch(tier, self._peers_callback(i)))

    def dispatch(self) -> list[Intent]:
        """Carry out what the chain decided now (writes, reads, probes); those intents."""
        intents = self.chain.take_intents()
        if not intents:
            return intents
        if self._queued:
            self._loop.call_soon_threadsafe(self._carry_out, intents)
            return intents
        out = []
        while intents:  # an outcome settled at once may lead to more
            for intent in intents:
                self._done[intent.seq] = Completion()
            self._carry_out(intents)
            out.extend(intents)
            intents = self.chain.take_intents()
        return out

    def completion(self, intent: Intent) -> Completion[None] | None:
        """Inline: done once ``intent``'s outcome is settled; None once it is (or queued)."""
        return self._done.get(intent.seq)

    def drain(self) -> bool:
        """Queued: settle what the loop handed back, in order; whether anything was."""
        chain, queue = self.chain, self._queue
        changed = False
        if self._peer_changes:
            with self._peer_lock:
                changes, self._peer_changes = self._peer_changes, {}
            for index, keys in changes.items():
                chain.settle(
                    TierChanged(
                        index,
                        added=tuple(k for k, there in keys.items() if there),
                        removed=tuple(k for k, there in keys.items() if not there),
                    )
                )
            changed = True
        while queue:
            item = queue.popleft()
            changed = True
            if isinstance(item, _Handed):
                if self._on_handed is not None:
                    self._on_handed(item.value)
            else:
                self._settle(item)
        return changed

    def stop_writes(self) -> None:
        """From now on no write goes to a lower tier (a close past its timeout).

        Writes still to carry out end at once as failed: their pins go, their
        blocks are counted in :attr:`abandoned`.
        """
        self._writes_stopped = True

    def cancel_seeding(self) -> None:
        """Stop waiting for recoveries (at close)."""
        for task in list(self._seeding):
            task.cancel()

    # -- the tiers' loop ------------------------------------------------------------------

    def hand_over(self, value: object) -> None:
        """Queue ``value`` for :attr:`on_handed`, in order with the outcomes (loop thread)."""
        self._queue.append(_Handed(value))

    def _carry_out(self, intents: list[Intent]) -> None:
        for intent in intents:
            if self._writes_stopped and isinstance(intent, Write):
                self.abandoned += len(intent.keys)
                self._dropped.add(intent.seq)
                self._arrived(Written(intent, frozenset()))
                continue
            if self._on_start is not None:
                self._on_start(intent)
            self._driver.carry_out(intent)

    def _arrived(self, outcome: Outcome) -> None:
        if self._on_end is not None and not isinstance(outcome, TierChanged):
            self._on_end(outcome)
        if self._queued:
            self._queue.append(outcome)
        else:
            self._settle(outcome)

    def _peers_callback(self, index: int) -> _Changed:
        def changed(added: Sequence[bytes], removed: Sequence[bytes]) -> None:
            if self._on_tier_call is not None:
                self._on_tier_call(index)
            if not self._queued:
                self.chain.settle(TierChanged(index, added=tuple(added), removed=tuple(removed)))
                return
            with self._peer_lock:
                keys = self._peer_changes.setdefault(index, {})
                for k in removed:
                    keys[k] = False
                for k in added:
                    keys[k] = True

        return changed

    async def _seed(self, index: int, tier: Recovers) -> None:
        # A failed recovery leaves the tier empty (it logs why): it takes writes again.
        with contextlib.suppress(Exception):
            await tier.wait_recovered()
        self._driver.seed(index, tier.take_recovered_keys())
        if self._on_tier_call is not None:
            self._on_tier_call(index)

    # -- inside ---------------------------------------------------------------------------

    def _settle(self, outcome: Outcome) -> None:
        """Owner's thread: the chain first, then the front, then who waits for it."""
        self.chain.settle(outcome)
        if isinstance(outcome, TierChanged):
            return
        seq = outcome.intent.seq
        done = self._done.pop(seq, None)
        try:
            if seq in self._dropped:  # never carried out: nothing for the front to count
                self._dropped.discard(seq)
            elif self._on_outcome is not None:
                self._on_outcome(outcome)
        finally:
            if done is not None:
                done.set_result(None)
            if not self._queued:
                # What the outcome led to (promote_up writes, reads held behind a
                # write-back) goes out now.
                self.dispatch()

    def _spawn(self, coro: Any) -> None:
        task: Future[None] | asyncio.Future[None]
        if self._queued:  # cancelling this future cancels the task on the loop
            task = asyncio.run_coroutine_threadsafe(coro, self._loop)
        else:
            task = asyncio.ensure_future(coro, loop=self._loop)
        self._seeding.add(task)
        task.add_done_callback(self._seeding.discard)

    def _on_loop(self, coro: Any) -> Any:
        """Run ``coro`` on the tiers' loop and return its result (queued: blocking)."""
        if not self._queued:
            # Inline: the owner is on the loop, and these are quick, synchronous calls.
            return _run_now(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_SEED_TIMEOUT_S)


class _Handed:
    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


async def _recovered(tier: Recovers) -> list[bytes]:
    return tier.take_recovered_keys()


_Changed = Callable[[Sequence[bytes], Sequence[bytes]], None]


async def _watch(tier: Watched, callback: _Changed) -> None:
    tier.watch(callback)


def _run_now(coro: Any) -> Any:
    """Run a coroutine that never suspends, synchronously (it must not await anything pending)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a runtime call on the owner's loop suspended")  # pragma: no cover
