"""The read side of the file tier's I/O pipeline: load calls, their reads verified and settled.

A load call's ready blocks are pinned by one residency call and queued as one
entry (:class:`~kvtier.tiers.file._pipeline_flight.Loads`); the pipeline
(:mod:`kvtier.tiers.file._pipeline`) starts them a run at a time, each run one
engine batch. When the engine reports the reads reaped together, they are
verified by one call, before anything else is done with them; a block that
fails is handed to the quarantine, forgotten and reported as a miss, and the
sound blocks of the run settle together with its last read.

Apart from the write side (:mod:`kvtier.tiers.file._pipeline_writes`) because the
two share only the queue and the room in flight: a load keeps no object per block,
verifies what it reads and counts hits and misses; a store checksums, seals,
writes and may wait for an fsync.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.errors import (
    BlockNotFoundError,
    IntegrityError,
    KVTierError,
    NamespaceMismatchError,
)
from kvtier.manager import LoadPlan
from kvtier.tiers import block_format
from kvtier.tiers.base import LoadResult
from kvtier.tiers.block_format import (
    VERIFY_CHECKSUM,
    VERIFY_HEADER,
    VERIFY_KEY,
    VERIFY_NAMESPACE,
    VERIFY_TRANSFER,
    HeaderError,
    decode_header_fields,
)
from kvtier.tiers.file._pipeline_flight import (
    BusyClock,
    Flight,
    Job,
    LoadRun,
    Loads,
    internal_error,
    transfer_error,
)
from kvtier.tiers.file._quarantine import Quarantine
from kvtier.transfer.completion import Completion

__all__ = ["Reads"]

log = logging.getLogger("kvtier.file_tier")


class Reads:
    """The loads of the pipeline: queued, read a run at a time, verified, settled.

    Parameters
    ----------
    flight
        The queue, the room in flight and the parts shared with the write side.
    quarantine
        Where blocks that fail verification are copied.
    """

    def __init__(self, flight: Flight, quarantine: Quarantine) -> None:
        self._flight = flight
        self._quarantine = quarantine
        self.clock = BusyClock()
        """Time during which reads were in flight."""
        self.hits = 0
        self.misses = 0
        self.bytes_read = 0

    def load(
        self, keys: Sequence[bytes], views: list[memoryview], where: str
    ) -> Completion[LoadResult]:
        """Read validated ``views`` from the blocks of ``keys`` (see :meth:`FileTier.load`).

        ``where`` names the tier in the error of a key that is not ready.
        """
        flight = self._flight
        done: Completion[LoadResult] = Completion(flight.loop)
        order = tuple(keys)
        plan: LoadPlan | None
        try:
            # The usual call: every block is here, pinned by one call (which
            # pins nothing when one is not).
            plan = flight.manager.prepare_load(order)
        except BlockNotFoundError:
            is_ready = flight.manager.is_ready
            ready = [k for k in keys if is_ready(k)]
            plan = flight.manager.prepare_load(ready) if ready else None
            by_key = dict(zip(keys, views, strict=True))
            views = [by_key[k] for k in ready]
        job = Job(done, remaining=len(plan.keys) if plan else 0, order=order)
        if plan is None or len(plan.keys) < len(order):
            present = set(plan.keys) if plan else set()
            for k in order:
                if k not in present:
                    job.failed[k] = BlockNotFoundError(f"block {k.hex()} is not in the {where}")
        if job.remaining:
            assert plan is not None
            file_slot = flight.slots.file_slot
            file_bytes = flight.file_bytes
            flight.pending.append(
                Loads(
                    job,
                    list(plan.keys),
                    views,
                    [file_slot[s] * file_bytes for s in plan.slots],
                )
            )
        else:
            self._finish(job)
        flight.pump()
        return done

    def start(self, loads: Loads, count: int) -> None:
        """Hand the next ``count`` blocks of ``loads`` to the engine as one batch."""
        flight = self._flight
        first, end = loads.next, loads.next + count
        loads.next = end
        whole = first == 0 and end == len(loads.keys)
        run = LoadRun(
            loads.job,
            loads.keys if whole else loads.keys[first:end],
            loads.views if whole else loads.views[first:end],
            loads.offsets if whole else loads.offsets[first:end],
            flight.pages.take_many(count),
        )
        flight.active += count
        self.clock.start(count)
        try:
            flight.engine.submit_many(
                True,
                flight.fd,
                [[page, view] for page, view in zip(run.pages, run.views, strict=True)],
                run.offsets,
                lambda done: self._ended(run, done),
                alignment=flight.io_alignment,
            )
        except Exception as exc:
            err = exc if isinstance(exc, KVTierError) else internal_error(exc, count)
            # Nothing was read: the blocks stay, for the next load to try.
            self._failed(run, [(i, err) for i in range(count)], forget=False)

    def _ended(self, run: LoadRun, done: list[tuple[int, int, BaseException | None]]) -> None:
        """Reads of ``run`` reaped: verify them, then settle every block."""
        flight = self._flight
        # Verified here, as soon as the reads are reaped and before any block
        # is reported: no caller ever sees an unchecked block. (block_format's
        # helpers are called through the module: it binds the compiled ones
        # last, after this module may have been imported during its import.)
        bad = block_format.verify_reaped(
            run.pages, run.keys, flight.namespace, run.views, done, flight.file_bytes
        )
        if bad:
            outcomes = {i: (nbytes, exc) for i, nbytes, exc in done}
            failures: list[tuple[int, KVTierError]] = []
            for i, outcome in bad:
                nbytes, exc = outcomes[i]
                offset = run.offsets[i]
                err: KVTierError
                if outcome == VERIFY_TRANSFER:
                    err = transfer_error(
                        False, offset, nbytes, exc, flight.file_bytes, flight.slots.path
                    )
                else:
                    err = self._verify_error(run.keys[i], offset, run.pages[i], outcome)
                if isinstance(err, IntegrityError | NamespaceMismatchError):
                    # What the slot held (a bad block, a short read's part),
                    # kept before anything else is read into its page or row.
                    self._quarantine.keep(
                        offset // flight.file_bytes,
                        run.keys[i],
                        run.pages[i],
                        run.views[i],
                        type(err).__name__,
                    )
                failures.append((i, err))
            if run.failed is None:
                run.failed = set()
            run.failed.update(i for i, _ in failures)
            self._failed(run, failures)
        run.left -= len(done)
        if run.left:
            # The sound blocks settle once, with the run's last read: a reap
            # holds part of a run, and settling each part would build its keys
            # and pages, Python per block (run 17 in docs/lab/file-tier-runs.md).
            return
        keys, pages = run.keys, run.pages
        if run.failed:
            good = [i for i in range(len(keys)) if i not in run.failed]
            keys, pages = [keys[i] for i in good], [pages[i] for i in good]
        if keys:
            self._ok(run.job, keys, pages)

    def _ok(self, job: Job, keys: list[bytes], pages: list[memoryview]) -> None:
        """Blocks ``keys`` of ``job`` were read and verified: the residency, the
        counters and the job updated once for all of them."""
        flight = self._flight
        count = len(keys)
        flight.pages.give_many(pages)
        flight.manager.complete_load(keys)
        flight.slots.released_many(keys)
        self.hits += count
        self.bytes_read += count * flight.block_bytes
        flight.active -= count
        self.clock.end(count)
        job.ok += keys
        job.remaining -= count
        if job.remaining == 0:
            self._finish(job)
        flight.pump()
        flight.on_settled()

    def _failed(
        self, run: LoadRun, failures: list[tuple[int, KVTierError]], *, forget: bool = True
    ) -> None:
        """Blocks of ``run`` failed, each ``(index, error)``: misses, and forgotten
        (``forget``) when their read failed or what it found cannot be served."""
        flight = self._flight
        manager, job = flight.manager, run.job
        for i, err in failures:
            key = run.keys[i]
            flight.pages.give(run.pages[i])
            manager.complete_load([key])
            if forget and key in manager and manager.is_ready(key):
                flight.slots.forget([key])
            flight.slots.released(key)
            log.warning("file tier: block %s: %s", key.hex(), err)
            job.failed[key] = err
        count = len(failures)
        flight.active -= count
        self.clock.end(count)
        job.remaining -= count
        if job.remaining == 0:
            self._finish(job)
        flight.pump()
        flight.on_settled()

    def _verify_error(self, key: bytes, offset: int, page: memoryview, outcome: int) -> KVTierError:
        """The error of a block that failed :func:`verify_block` (the failure path only)."""
        flight = self._flight
        where = f"{flight.slots.path} slot {offset // flight.file_bytes}"
        if outcome == VERIFY_HEADER:
            try:
                decode_header_fields(page)
            except HeaderError as exc:
                return IntegrityError(f"bad block header ({exc})", where)
            return IntegrityError("bad block header", where)
        found, namespace, payload_bytes, _, _ = decode_header_fields(page)
        if outcome == VERIFY_NAMESPACE:
            return NamespaceMismatchError(
                f"{where} holds a block of namespace {namespace.hex()}, "
                f"not {flight.namespace.hex()}"
            )
        if outcome == VERIFY_KEY:
            return IntegrityError(f"slot holds block {found.hex()}, not {key.hex()}", where)
        if outcome == VERIFY_CHECKSUM:
            return IntegrityError("payload checksum mismatch", where)
        return IntegrityError(
            f"payload of {payload_bytes} bytes, expected {flight.block_bytes}", where
        )

    def _finish(self, job: Job) -> None:
        ordered = job.ordered()
        self.misses += len(job.failed)
        if ordered:
            # A load is a use: the blocks a request hit move up the policy's order.
            self._flight.manager.touch(list(ordered))
        job.done.set_result(LoadResult(loaded=ordered, missing=job.failed))
