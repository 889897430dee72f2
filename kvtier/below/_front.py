"""The lower front: kvtier's chain of lower tiers below another engine's CPU tier.

One front for every engine that keeps a CPU tier of its own and takes
storage below it (vLLM 0.33's secondary tiers, SGLang HiCache's L3): the
engine's slots are the rows (:class:`~kvtier.region.ForeignRows`), and the
chain (:class:`~kvtier.chain.Chain`) decides as it does for the other fronts:
which tiers hold a block, where a read falls through, whether a read beats
recomputing, how long a lookup may wait. The runtime
(:class:`~kvtier.chain.Runtime`, queued) carries its intents out on kvtier's
loop thread::

    engine threads (any)              LowerFront (this module)        kvtier's loop thread
    lookup(key) / prefix(keys)  --->  chain.locate: HIT / RETRY / MISS
    store(job, keys, slots)     --->  chain.write_from -> Write ----> tier.store(slot views)
    load(job, keys, slots)      --->  chain.read_into  -> Read  ----> tier.load(into slots)
    finished() / wait(job)      <---  JobDone, once per job   <----- outcomes (queued)

Two rules are this front's own:

* **No early completion into the engine's memory.** A job is reported
  (:meth:`LowerFront.finished`, :meth:`LowerFront.wait`) only when no I/O
  touches its slots any more: the engine frees or reuses a slot it was told
  about, and a late read into it would corrupt another block. Deadlines act
  before a slot is handed over (a lookup's wait) and on the reads that fall
  through (none starts past the deadline), never by abandoning I/O.
* **A block is checksummed from the engine's slot** while the engine keeps it
  stable (vLLM until the job is reported, SGLang until its call returns).

Every method is thread-safe (one lock guards the chain; waits happen outside
it) and none raises into the engine for a tier's failure: a failed block is a
miss or a failed key of its job.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.below.settings import LowerSettings
from kvtier.chain import (
    Answer,
    ChainStatistics,
    FrontCounts,
    FrontStatistics,
    LoopThread,
    Read,
    ReadDone,
    Runtime,
    Settled,
    Write,
    Written,
    chain_for,
)
from kvtier.layout import KVLayout
from kvtier.region import ForeignRows
from kvtier.tiers.base import Tier
from kvtier.tiers.factory import aclose_tiers, open_tiers

__all__ = ["JobDone", "LowerCounts", "LowerFront"]

log = logging.getLogger("kvtier.below")

_T = TypeVar("_T")

_CLOSE_WAIT_S = 30.0
"""How long :meth:`LowerFront.close` waits for jobs in flight."""


@dataclass(frozen=True, slots=True)
class JobDone:
    """A job that ended: no I/O touches its slots any more."""

    job: int
    """The engine's number for the job."""
    load: bool
    """A load (into the slots) or a store (from them)."""
    done: frozenset[bytes]
    """Keys that succeeded: loaded and verified into their slot, or stored by at
    least one tier (or held there already)."""
    failed: frozenset[bytes]
    """The job's other keys."""
    seconds: float
    """From the job's submission to its end."""
    moved: int = 0
    """Blocks whose bytes moved: loaded, or written to a tier that lacked them
    (a store of blocks every tier held already moves none)."""

    @property
    def ok(self) -> bool:
        """Every key succeeded."""
        return not self.failed


@dataclass(slots=True)
class LowerCounts:
    """What only the lower front counts (:attr:`FrontStatistics.front`)."""

    jobs_failed: int = 0
    """Jobs with at least one failed key."""
    blocks_failed: int = 0
    """Keys of jobs that failed (each a miss or a block not stored)."""
    refused: int = 0
    """Jobs refused at once (the front closed, or a slot out of range)."""


@dataclass(slots=True)
class _Job:
    job: int
    load: bool
    keys: tuple[bytes, ...]
    started: float
    pending: set[int] = field(default_factory=set)
    done: set[bytes] = field(default_factory=set)
    moved: set[bytes] = field(default_factory=set)


class LowerFront:
    """kvtier's lower tiers below an engine's CPU buffer (see the module docstring).

    Use :meth:`open`; call :meth:`close` at the end.
    """

    def __init__(
        self,
        settings: LowerSettings,
        slots: ForeignRows,
        loop: LoopThread,
        tiers: list[Tier],
        lookup_limit: int | None = None,
    ) -> None:
        """Use :meth:`open`."""
        config = settings.config
        self.slots = slots
        self._loop = loop
        self._tiers = tiers
        self.tier_names = [name for name, _spec in config.chain]
        # The chain's own CPU tier is not used (one row): the engine's CPU tier
        # is above the chain; a request may look up as many keys as that tier
        # holds (its slots, unless the adapter stages through fewer).
        self._chain = chain_for(
            config,
            tiers,
            1,
            lookup_deadline_s=settings.lookup_deadline_s,
            measure_recompute=False,
            row_limit=slots.rows if lookup_limit is None else lookup_limit,
        )
        self._deadline_s = settings.lookup_deadline_s
        self._lock = threading.Lock()
        self._runtime = Runtime(
            self._chain,
            tiers,
            self.tier_names,
            slots,
            loop.loop,
            queued=True,
        )
        self._arrivals = self._runtime.arrivals
        self._jobs: dict[int, _Job] = {}
        self._by_seq: dict[int, int] = {}
        self._ended: dict[int, JobDone] = {}
        self._counts = FrontCounts()
        self._own = LowerCounts()
        self._closed = False
        self._released = False
        with self._lock:
            self._runtime.start()  # what the tiers recovered; peers followed
            self._drain()

    @classmethod
    def open(
        cls,
        settings: LowerSettings,
        layout: KVLayout,
        slots: ForeignRows,
        *,
        name: str,
        lookup_limit: int | None = None,
    ) -> LowerFront:
        """Open the tiers of ``settings`` for blocks of ``slots`` on a loop thread.

        Parameters
        ----------
        settings
            The chain of lower tiers and the lookup deadline.
        layout
            Names what the blocks' bytes mean: its namespace salts every key
            the tiers hold, so engines, models and layouts never share a block.
        slots
            The engine's buffer (released by :meth:`close`).
        name
            The loop thread's name.
        lookup_limit
            The most leading keys of one request a lookup serves: the engine's
            CPU tier's blocks (default: the slots; an adapter that stages
            through fewer slots than the engine has passes the engine's count).

        Raises
        ------
        KVTierError
            A tier failed to open (those opened before it are closed).
        """
        loop: LoopThread | None = None
        tiers: list[Tier] = []
        config = settings.config
        try:
            loop = LoopThread(name)
            tiers = loop.run(open_tiers(config, layout, slots))
            log.info(
                "kvtier: tiers %s below the engine's CPU tier (%d slots of %d bytes), namespace %s",
                ",".join(n for n, _s in config.chain),
                slots.rows,
                slots.row_stride,
                layout.namespace.hex(),
            )
            return cls(settings, slots, loop, tiers, lookup_limit)
        except BaseException:
            if loop is not None:
                if tiers:
                    with contextlib.suppress(Exception):  # each failure is logged
                        names = [n for n, _s in config.chain]
                        loop.run(aclose_tiers(tiers, names), timeout=60.0 * len(tiers))
                loop.stop()
            raise

    # -- lookups: no I/O, never block ------------------------------------------------------

    def lookup(self, key: bytes, request: object = None) -> Answer:
        """Whether a lower tier can serve ``key`` now: HIT (load it), RETRY (a shared
        tier is asked: ask again later), MISS (recompute it).

        ``request`` (any hashable) bounds a request's wait by ``lookup_deadline_s``
        and lets the load decision count its reads (see
        :meth:`Chain.locate <kvtier.chain.Chain.locate>`).
        """
        with self._lock:
            self._drain()
            answer = self._chain.locate(key, request)
            if answer is Answer.MISS:
                self._counts.lookup_misses += 1
            elif answer is Answer.RETRY:
                self._runtime.dispatch()  # the probe goes out now
            return answer

    def prefix(self, keys: Sequence[bytes], *, wait_s: float | None = None) -> int:
        """How many leading ``keys`` the lower tiers can serve (a shared tier asked and
        waited for, ``wait_s`` at most: default ``lookup_deadline_s``).

        Blocks the calling thread while a shared tier is asked (SGLang's prefetch
        thread asks this way); otherwise answers at once.
        """
        request = object()  # one request: the load decision counts its reads
        deadline = time.monotonic() + (self._deadline_s if wait_s is None else wait_s)
        n = 0
        try:
            while n < len(keys):
                with self._lock:
                    generation = self._arrivals.count
                    self._drain()
                    answer = self._chain.locate(keys[n], request)
                    if answer is Answer.RETRY:
                        self._runtime.dispatch()
                if answer is Answer.HIT:
                    n += 1
                elif answer is Answer.MISS or not self._sleep(generation, deadline):
                    break
        finally:
            with self._lock:
                self._chain.forget_request(request)
        if n < len(keys):
            with self._lock:
                self._counts.lookup_misses += 1
        return n

    def forget_request(self, request: object) -> None:
        """``request`` looks nothing up any more (it finished)."""
        with self._lock:
            self._chain.forget_request(request)

    # -- transfers: return at once; each job ends exactly once ------------------------------

    def store(self, job: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Write the blocks in ``slots`` to every tier below that lacks them.

        The engine keeps the slots stable until the job is reported.
        """
        self._submit(job, keys, slots, load=False)

    def load(self, job: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Read each block into its slot (verified), from the highest tier that holds it."""
        self._submit(job, keys, slots, load=True)

    def finished(self) -> list[JobDone]:
        """The jobs that ended since the last call (and that nobody :meth:`wait`\\ s on)."""
        with self._lock:
            self._drain()
            self._runtime.dispatch()
            out = list(self._ended.values())
            self._ended.clear()
            return out

    def wait(self, job: int, timeout: float | None = None) -> JobDone | None:
        """Block until ``job`` ends; its result (None past ``timeout``: it goes on)."""

        def ended() -> JobDone | bool:
            done = self._ended.pop(job, None)
            if done is not None:
                return done
            return job not in self._jobs  # True: unknown, or reported already

        result = self._until(ended, timeout)
        return result if isinstance(result, JobDone) else None

    @property
    def busy(self) -> bool:
        """Jobs, probes or reads are in flight."""
        with self._lock:
            self._drain()
            return bool(self._jobs) or self._chain.busy

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no job is in flight (vLLM's ``drain_jobs``); whether none is."""
        return self._until(lambda: not self._jobs or False, timeout) is True

    # -- statistics and close ------------------------------------------------------------

    def statistics(self) -> FrontStatistics[LowerCounts]:
        """Every lower tier's figures, the chain's counts, and this front's own."""

        def front(_chain: ChainStatistics) -> LowerCounts:
            return LowerCounts(**{k: getattr(self._own, k) for k in LowerCounts.__slots__})

        with self._lock:
            self._drain()
            return self._runtime.statistics(self._counts, front)

    def tier_statistics(self) -> dict[str, Any]:
        """Each lower tier's own record (the latest, taken on kvtier's loop)."""
        return dict(zip(self.tier_names, self._runtime.tier_statistics(), strict=True))

    @property
    def closed(self) -> bool:
        """:meth:`close` was called."""
        return self._closed

    def close(self) -> bool:
        """Wait for jobs in flight (30 s at most), close the tiers, release the slots;
        whether the slots were released (the engine may unmap its buffer then).

        Jobs still in flight past the wait keep their slots' views: the
        engine's memory stays mapped until they end (never unmapped under I/O).
        """
        if self._closed:
            return self._released
        self._closed = True
        ended = self.drain(_CLOSE_WAIT_S)
        self._runtime.cancel_seeding()
        try:
            self._loop.run(aclose_tiers(self._tiers, self.tier_names), timeout=60.0)
        except Exception:
            log.exception("closing kvtier's tiers failed")
        finally:
            self._loop.stop()
            if ended:
                self.slots.release()
                self._released = True
            else:
                log.warning(
                    "kvtier: jobs still in flight at close; the engine's buffer stays mapped"
                )
        return self._released

    # -- inside --------------------------------------------------------------------------

    def _submit(self, job: int, keys: Sequence[bytes], slots: Sequence[int], *, load: bool) -> None:
        keys = tuple(keys)
        rows = tuple(int(s) for s in slots)
        now = time.monotonic()
        with self._lock:
            self._drain()
            if job in self._jobs or job in self._ended:
                raise ValueError(f"job {job} is in flight already")
            record = _Job(job, load, keys, now)
            bad = (
                self._closed
                or len(rows) != len(keys)
                or any(not 0 <= r < self.slots.rows for r in rows)
            )
            if bad:
                self._own.refused += 1
                self._end(record)
                return
            if load:
                self._counts.loads += 1
                intents: Sequence[Read | Write]
                intents, _missing = self._chain.read_into(keys, rows)
            else:
                self._counts.stores += 1
                intents = self._chain.write_from(keys, rows)
                # What every tier holds already is stored.
                written = {k for w in intents for k in w.keys}
                record.done.update(k for k in keys if k not in written)
            if not intents:
                self._end(record)
                return
            for intent in intents:
                record.pending.add(intent.seq)
                self._by_seq[intent.seq] = job
            self._jobs[job] = record
            self._runtime.dispatch()

    def _drain(self) -> None:
        """Settle what the loop handed back; end the jobs it completes (lock held)."""
        for item in self._runtime.drain():
            if isinstance(item, Settled):
                self._settled(item)

    def _settled(self, item: Settled) -> None:
        outcome = item.outcome
        if not isinstance(outcome, Written | ReadDone):
            return
        seq = outcome.intent.seq
        job_id = self._by_seq.pop(seq, None)
        if job_id is None:
            return
        record = self._jobs[job_id]
        record.pending.discard(seq)
        if isinstance(outcome, Written):
            record.done.update(outcome.stored)
            record.moved.update(outcome.stored)
        else:
            record.done.update(outcome.loaded)
            record.moved.update(outcome.loaded)
            for again in self._chain.follow_ups(outcome.intent):
                record.pending.add(again.seq)
                self._by_seq[again.seq] = job_id
        if not record.pending:
            del self._jobs[job_id]
            self._end(record)

    def _end(self, record: _Job) -> None:
        done = frozenset(k for k in record.keys if k in record.done)
        failed = frozenset(record.keys) - done
        if failed:
            self._own.jobs_failed += 1
            self._own.blocks_failed += len(failed)
        self._ended[record.job] = JobDone(
            record.job,
            record.load,
            done,
            failed,
            time.monotonic() - record.started,
            len(record.moved),
        )

    def _until(self, check: Callable[[], _T | bool], timeout: float | None) -> _T | bool:
        """Drain until ``check`` (run with the lock held) returns other than False; that
        value, or False past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                seen = self._arrivals.count
                self._drain()
                self._runtime.dispatch()
                result = check()
                if result is not False:
                    return result
            if not self._sleep(seen, deadline):
                return False

    def _sleep(self, seen: int, deadline: float | None) -> bool:
        """Wait until an outcome arrives after ``seen`` (the runtime's count when the
        caller last drained); False past ``deadline``."""
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        return self._arrivals.wait_past(seen, left)
