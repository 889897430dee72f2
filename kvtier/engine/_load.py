"""Loading: CPU rows to the device; loads' claims on the jobs in flight, promotion windows."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvtier.chain import Read, ReadDone
from kvtier.engine._jobs import BlockIds, _guarded, _Job, _Load, _wait, _window_ids, log
from kvtier.engine._state import _State
from kvtier.errors import BlockNotFoundError, ClosedError, InvalidArgumentError
from kvtier.keys import check_keys
from kvtier.transfer.completion import Completion
from kvtier.transfer.device import check_block_ids


class _Loading(_State):
    """Loading (:meth:`~kvtier.engine.Engine.load`) and promotions' reads."""

    def _read_done(self, done: ReadDone) -> None:
        """A promotion's read ended (its settlement hands the outcome on as the chain
        settles it): the chain made its blocks ready, read the others from a tier
        below (:meth:`~kvtier.chain.Chain.follow_ups`), or found them misses."""
        read = done.intent
        good = [k for k in read.keys if k in done.loaded]
        job = self._read_jobs.pop(read.seq, None)
        if job is None:  # pragma: no cover - every read is the engine's
            return
        for again in self._chain.follow_ups(read):
            self._carry_on(job, again)
        job.ok.update(good)
        for k in read.keys:
            if self._inflight.get(k) is job:
                del self._inflight[k]
        self._finish(job)  # the loads waiting take their blocks before anything else runs

    def _carry_on(self, job: _Job, again: Read) -> None:
        """The blocks of ``again`` that ``job`` did not deliver come from a lower tier:
        a job of their own, which the loads waiting for them wait on instead."""
        moved = set(again.keys)
        nxt = _Job(again.keys, Completion())
        self._read_jobs[again.seq] = nxt
        self._runtime.expect(again).then(self._read_done)
        for k in again.keys:
            self._inflight[k] = nxt
        self._track(nxt.done)
        for st in job.claims:
            keys = st.waits.get(job)
            if not keys:
                continue
            mine = [k for k in keys if k in moved]
            if mine:
                # What is left stays claimed from ``job`` (an empty list is fine:
                # its claim then takes nothing).
                st.waits[job] = [k for k in keys if k not in moved]
                self._wait_on(st, nxt, mine)

    async def _load(self, keys: Sequence[bytes], device_block_ids: BlockIds, skip: int = 0) -> int:
        """:meth:`~kvtier.engine.Engine.load`."""
        self._check_open()
        check_keys(keys)
        if isinstance(skip, bool) or not isinstance(skip, int) or not 0 <= skip < self._bpc:
            raise InvalidArgumentError(f"skip must be an int in [0, {self._bpc}), got {skip!r}")
        if skip and not keys:
            raise InvalidArgumentError("skip needs at least one key")
        ids = check_block_ids(
            self._layout, device_block_ids, len(keys) * self._bpc - skip, unique=True
        )
        self._counts.loads += 1
        if not keys:
            return 0
        chain, inflight = self._chain, self._inflight
        ready = True  # every key ready in the CPU tier (none in flight)
        for k in keys:
            if k in inflight:
                ready = False
            elif not chain.is_ready(k):
                ready = False
                if chain.lower_of(k) is None:
                    raise BlockNotFoundError(f"block {k.hex()} is in no tier")
        chain.touch(keys)
        index = {k: i for i, k in enumerate(keys)}
        st = _Load(index, ids, skip, len(keys), [] if ready else list(keys))
        try:
            # The first round runs before the first await: what is ready now is
            # pinned and its copy started, so a lookup just before cannot lose it.
            if ready:
                self._deliver(st, list(keys))  # the first round, known to start them all
            else:
                while self._load_round(st):
                    await self._load_wait(st)
            if copies := [c for c in st.copies if not c.done()]:
                await _wait(copies)
            else:
                # Copied on this thread: one turn of the loop, as a copy on the
                # copier's thread gives (other tasks run, a cancellation lands).
                await asyncio.sleep(0)
        finally:
            for job in st.waits:
                job.claims.remove(st)
            st.waits.clear()
        if st.error is not None:
            raise st.error
        if st.end < len(keys):
            self._own.load_shortfalls += len(keys) - st.end
        return st.end

    def _load_round(self, st: _Load) -> bool:
        """Start what a load can start now; True while it has something to wait for.

        Synchronous: nothing changes between a look at a block and the pin or
        the promotion that acts on it.
        """
        if st.error is not None:
            return False
        if st.todo and self._closed:
            raise ClosedError("the engine closed during the load")
        ready: list[bytes] = []
        promote: list[bytes] = []
        for k in st.todo:
            if st.index[k] >= st.end:
                break  # past a miss: nothing more to start
            job = self._inflight.get(k)
            if job is not None:
                self._wait_on(st, job, [k])
            elif self._chain.is_ready(k):
                ready.append(k)
            elif self._chain.lower_of(k) is not None:
                promote.append(k)
            else:
                st.end = min(st.end, st.index[k])  # it left every tier since the call
                break
        if ready:
            self._deliver(st, ready)  # pinned before a promotion below could evict them
        st.todo = self._promote_some(st, promote)
        return bool(st.todo) or any(st.index[k] < st.end for ks in st.waits.values() for k in ks)

    async def _load_wait(self, st: _Load) -> None:
        """Wait until a copy or a job of the load ends, or, while it needs rows, any work."""
        running = [c for c in st.copies if not c.done()]
        running += [job.done for job in st.waits if not job.done.done()]
        if st.todo:
            # Every row that is not free is held by a copy, a promotion, a store
            # or a tier write in flight; the first to end may free one.
            running += [c for c in (*self._runtime.writes(), *self._pending) if not c.done()]
        if running:
            await _wait(running, first=True)
        elif st.todo:  # pragma: no cover - a row held by nothing running is a leaked pin
            log.error("load: no CPU row frees up for %d blocks; they are misses", len(st.todo))
            st.end = min(st.end, st.index[st.todo[0]])
            st.todo.clear()

    def _promote_some(self, st: _Load, todo: list[bytes]) -> list[bytes]:
        """Promote the leading keys of ``todo`` that rows can take (in the chain's
        windows); the rest."""
        while todo:
            placed: set[bytes] = set()
            for read in self._chain.promote(todo):
                job = _Job(read.keys, Completion())
                self._read_jobs[read.seq] = job
                self._runtime.expect(read).then(self._read_done)
                for k in read.keys:
                    self._inflight[k] = job
                self._track(job.done)
                placed.update(read.keys)
                st.promoted.update(read.keys)
                self._wait_on(st, job, read.keys)
            if not placed:
                break
            self._dispatch()
            todo = [k for k in todo if k not in placed]
        return todo

    def _wait_on(self, st: _Load, job: _Job, keys: Sequence[bytes]) -> None:
        """The load takes ``keys`` from ``job`` when it finishes (:meth:`_claim`)."""
        mine = st.waits.get(job)
        if mine is None:
            mine = st.waits[job] = []
            job.claims.append(st)
        mine.extend(keys)

    def _claim(self, st: _Load, job: _Job) -> None:
        """``job`` has finished: pin the blocks the load waits for and copy them.

        Runs in the job's completion callback right after its blocks became
        ready, so nothing can evict them before they are pinned.
        """
        got: list[bytes] = []
        retry: list[bytes] = []
        for k in st.waits.pop(job, []):
            if k in job.ok and self._chain.is_ready(k):
                got.append(k)
            elif k in st.promoted:
                st.end = min(st.end, st.index[k])  # its read failed: a miss ends the prefix
            else:
                retry.append(k)  # another call's store or promotion failed: look again
        if retry:
            st.todo = sorted({*st.todo, *retry}, key=st.index.__getitem__)
        got = [k for k in got if st.index[k] < st.end]
        if got:
            self._deliver(st, got)

    def _deliver(self, st: _Load, keys: list[bytes]) -> None:
        """Pin ready blocks of a load and start their copy; unpinned when it ends."""
        if len(keys) == len(st.index):  # every key of the load: its ids as given
            keys, ids, skip = list(st.index), st.ids, st.skip
        else:
            keys.sort(key=st.index.__getitem__)
            where = [st.index[k] for k in keys]
            ids = _window_ids(st.ids, where, self._bpc, st.skip)
            skip = st.skip if where[0] == 0 else 0
        slots = self._chain.pin_for_device_load(keys)
        self._cpu_busy.begin(False)
        copy = _guarded(lambda: self._copy(False, slots, ids, skip))
        if copy.done():  # copied on this thread: unpinned before anything else runs
            self._loaded(st, keys, copy)
            return
        # What flush waits for: done only after the rows are unpinned, not when
        # the copy is (its done callbacks run a loop iteration later).
        settled: Completion[None] = Completion()

        def copied(c: Completion[None]) -> None:
            try:
                self._loaded(st, keys, c)
            finally:
                settled.set_result(None)  # never leave flush waiting

        copy.add_done_callback(copied)
        self._track(settled)
        st.copies.append(settled)

    def _loaded(self, st: _Load, keys: list[bytes], copy: Completion[None]) -> None:
        """A copy of a load ended: unpin its rows, count it, keep its error."""
        self._chain.unpin_device_load(keys)
        exc = copy.exception()
        self._cpu_busy.end(False)
        if exc is not None and st.error is None:
            st.error = exc

    def _finish(self, job: _Job) -> None:
        """Hand the blocks of a finished job to the loads waiting for them; resolve it."""
        claims, job.claims = job.claims, []
        try:
            for st in claims:
                self._claim(st, job)
        finally:
            job.done.set_result(None)
