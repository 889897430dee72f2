"""Storing: device blocks into CPU rows, streaming through them to the lower tiers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.engine._jobs import BlockIds, _chunk_ids, _guarded, _Ids, _Job, _Starter, _wait
from kvtier.engine._state import _State
from kvtier.keys import check_keys
from kvtier.manager import StorePlan
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import check_block_ids

__all__ = ["StoreSummary"]


@dataclass(frozen=True, slots=True)
class StoreSummary:
    """What one :meth:`Engine.store` did."""

    stored: int
    """Blocks newly copied into the CPU region."""
    present: int
    """Blocks skipped because some tier already held (or was storing) them."""
    dropped: int
    """Blocks not stored because no row could be freed (all pinned or in flight)."""


class _Storing(_State):
    """Storing (:meth:`~kvtier.engine.Engine.store`)."""

    async def _store(self, keys: Sequence[bytes], device_block_ids: BlockIds) -> StoreSummary:
        """:meth:`~kvtier.engine.Engine.store`."""
        self._check_open()
        check_keys(keys)
        ids = check_block_ids(self._layout, device_block_ids, len(keys) * self._bpc, unique=True)
        self._counts.stores += 1
        # A key already in the CPU tier (ready or being written) needs no copy; one
        # only in a lower tier is copied anyway: it is hot now, and that tier's
        # write skips it.
        chain = self._chain
        todo, present, stored = list(keys), 0, 0
        stream = chain.streams
        while todo:
            # Looked at again each round: another store may have taken some meanwhile.
            holds = chain.holds
            fresh = [k for k in todo if not holds(k)]
            present += len(todo) - len(fresh)
            todo = fresh
            # The chain places the leading keys that the free or evictable rows
            # take; without a tier that takes what it evicts, never by evicting
            # this call's own prefix for its tail.
            own = () if len(todo) == len(keys) else keys
            plan = chain.place(todo, keep=own) if todo else None
            if plan is None:
                # Backpressure: rows held by copies, loads and file writes free up
                # when those end; waiting beats dropping blocks that fit a moment
                # later. With nothing running, no row will free up.
                if not todo or not await self._wait_for_rows():
                    break
                self._check_open()
                continue
            if len(plan.keys) == len(keys):  # all of them, in call order: the ids as given
                chosen = ids
            else:
                index = {k: i for i, k in enumerate(keys)}
                chosen = _chunk_ids(ids, [index[k] for k in plan.keys], self._bpc)
            await self._copy_in(plan, chosen)
            stored += len(plan.keys)
            placed = set(plan.keys)
            todo = [k for k in todo if k not in placed]
            if not stream:
                break  # no lower tier: reusing rows would evict this call's own prefix
        self._own.dropped += len(todo)
        return StoreSummary(stored, present, len(todo))

    async def _copy_in(self, plan: StorePlan, chosen: _Ids) -> None:
        """Copy device blocks into the rows of ``plan``; publish them when done."""
        job = _Job(plan.keys, Completion())
        cancelled = False
        inflight = self._inflight
        for k in plan.keys:
            inflight[k] = job
        self._cpu_busy.begin(True)

        def copied(c: Completion[None]) -> None:
            ok = c.exception() is None and not cancelled
            self._cpu_busy.end(True)
            # Ready in the CPU tier, and written through (or marked for write-back).
            self._chain.stored(plan.keys, ok, write_down=not self._abandoning)
            for k in plan.keys:
                self._inflight.pop(k, None)
            try:
                if ok:
                    job.ok.update(plan.keys)
                    if self._abandoning and self._links:
                        self._abandon(plan.keys)
                    self._dispatch()
            finally:
                self._finish(job)

        copy = self._after_claim(plan, lambda: self._copy(True, plan.slots, chosen))
        if copy.done():
            # Copied on this thread (or refused at once): one turn of the loop,
            # as a copy on the copier's thread gives, so that the call is still
            # a point where other tasks run and a cancellation lands; a
            # cancelled store publishes nothing, as with a copy in flight.
            self._pending.add(job.done)
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                copied(copy)
                self._pending.discard(job.done)
            copy.result()  # its error, if any
            return
        copy.add_done_callback(copied)
        self._track(job.done)
        try:
            await copy
        except asyncio.CancelledError:
            cancelled = True
            raise

    async def _wait_for_rows(self) -> bool:
        """Wait until some work that holds CPU rows ends; False when none is running."""
        running = [c for c in (*self._runtime.writes(), *self._pending) if not c.done()]
        if running:
            await _wait(running, first=True)
        return bool(running)

    def _after_claim(self, plan: StorePlan, start: _Starter) -> Completion[None]:
        """Run ``start`` once the rows of ``plan`` may be overwritten.

        A victim whose row was its only copy is written back first (the
        chain's :meth:`~kvtier.chain.Chain.evicting_writes`); otherwise the
        rows are free at once.
        """
        writes = self._chain.evicting_writes(plan)
        if writes:
            self._dispatch()
        pending = [d for w in writes if (d := self._runtime.completion(w)) is not None]
        if not pending:
            return _guarded(start)
        out: Completion[None] = Completion()
        left = [len(pending)]

        def go(_c: Completion[None]) -> None:
            left[0] -= 1
            if left[0]:
                return
            inner = _guarded(start)
            inner.add_done_callback(
                lambda c: out.set_exception(e) if (e := c.exception()) else out.set_result(None)
            )

        for written in pending:
            written.add_done_callback(go)
        return out
