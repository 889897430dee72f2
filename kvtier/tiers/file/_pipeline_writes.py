"""The write side of the file tier's I/O pipeline: store calls, checksummed, written, flushed.

A store's payloads are checksummed on the tier's thread
(:mod:`kvtier.tiers.file._worker`), a few MiB of blocks per call, and its blocks
queued one by one; the pipeline (:mod:`kvtier.tiers.file._pipeline`) starts the
ones that fit as one engine batch, their headers sealed into page-aligned header
pages by one call, and header and payload written with one vectored request at
each block's slot. The blocks a reap reports written settle together; with
``durability="fsync"`` they first wait for one ``fsync`` shared by the blocks
written meanwhile. A block whose slot is still being cleared waits for the zeros;
one that fails has its slot cleared and settles on its own.

Apart from the read side (:mod:`kvtier.tiers.file._pipeline_reads`) because the
two share only the queue and the room in flight: a store keeps one record per
block (its checksum is computed before its write starts), may wait for its slot
or an fsync, and publishes what it wrote to the slot index.
"""

from __future__ import annotations

import errno as _errno
import logging
import time
from collections.abc import Callable, Sequence

from kvtier.errors import CapacityError, KVTierError, TierIOError
from kvtier.tiers import block_format
from kvtier.tiers.base import StoreResult
from kvtier.tiers.file._pipeline_flight import (
    BusyClock,
    Flight,
    Job,
    StoreBlock,
    StoreRun,
    internal_error,
    io_error,
    transfer_error,
)
from kvtier.tiers.file._worker import Worker
from kvtier.transfer.completion import Completion

__all__ = ["Writes"]

log = logging.getLogger("kvtier.file_tier")

_SUM_BYTES = 8 << 20
"""Payload bytes checksummed per call to the tier's thread: one hand-off per
few MiB (per block, the hand-offs cost more than XXH3 itself at 64 KiB), and
the first writes start after 8 MiB is hashed (about 0.3 ms), not the whole call."""


class Writes:
    """The stores of the pipeline: checksummed, queued, written, flushed, settled.

    Parameters
    ----------
    flight
        The queue, the room in flight and the parts shared with the read side.
    worker
        The tier's thread (payload checksums).
    fsync
        ``durability="fsync"``: a block is done once flushed.
    """

    def __init__(self, flight: Flight, worker: Worker, fsync: bool) -> None:
        self._flight = flight
        self._worker = worker
        self._fsync = fsync
        self._summing = 0  # blocks whose payload checksum is being computed
        self._sync_waiting: list[StoreBlock] = []
        self._sync_running: list[StoreBlock] | None = None
        self.clock = BusyClock()
        """Time during which writes were in flight."""
        self.stores = 0
        self.store_failures = 0
        self.evictions = 0
        self.bytes_written = 0

    @property
    def busy(self) -> bool:
        """True while a block is being checksummed or waits for its fsync (blocks
        queued or in flight are the pipeline's to tell)."""
        return bool(self._summing or self._sync_waiting or self._sync_running is not None)

    def refuse(self, keys: Sequence[bytes], err: KVTierError) -> Completion[StoreResult]:
        """A store of ``keys`` that fails whole with ``err``, counted as failures."""
        done: Completion[StoreResult] = Completion(self._flight.loop)
        self.store_failures += len(keys)
        done.set_result(StoreResult(stored=(), skipped=(), failed=dict.fromkeys(keys, err)))
        return done

    def store(self, keys: Sequence[bytes], views: list[memoryview]) -> Completion[StoreResult]:
        """Write validated ``views`` as the blocks of ``keys`` (see :meth:`FileTier.store`)."""
        flight = self._flight
        done: Completion[StoreResult] = Completion(flight.loop)
        plan = flight.manager.prepare_store(list(keys))
        if plan is None:
            present = tuple(k for k in keys if k in flight.manager)
            err = CapacityError(
                f"no room for {len(keys) - len(present)} blocks in the file tier "
                f"({flight.slots.slots} slots, pinned or in flight ones cannot be evicted)"
            )
            failed: dict[bytes, KVTierError] = {k: err for k in keys if k not in present}
            self.store_failures += len(failed)
            done.set_result(StoreResult(stored=(), skipped=present, failed=failed))
            return done
        file_slot = flight.slots.file_slot
        to_write = {k: file_slot[s] for k, s in zip(plan.keys, plan.slots, strict=True)}
        # Withdrawn before their writes start: other instances stop looking
        # for what the slots held (a read racing the write fails verification).
        withdraw = flight.slots.index.withdraw
        for written in to_write.values():
            withdraw(written)
        evicted = tuple(plan.evicted)
        self.evictions += len(evicted)
        job = Job(
            done,
            remaining=len(to_write),
            skipped=tuple(k for k in keys if k not in to_write),
            evicted=evicted,
            order=tuple(keys),
        )
        ops = [
            StoreBlock(key, view, job, slot)
            for key, view in zip(keys, views, strict=True)
            if (slot := to_write.get(key)) is not None
        ]
        if not to_write:
            self._finish(job)
        per_call = max(1, _SUM_BYTES // max(1, flight.block_bytes))
        for i in range(0, len(ops), per_call):
            self._sum(ops[i : i + per_call])
        return done

    def _sum(self, ops: list[StoreBlock]) -> None:
        """Checksum the payloads of ``ops`` on the tier's thread, then queue their writes."""
        self._summing += len(ops)
        views = [op.view for op in ops]
        self._worker.submit(
            lambda: block_format.checksums(views),
            lambda sums, e: self._summed(ops, sums, e),
            at_once=True,
        )

    def _summed(self, ops: list[StoreBlock], sums: list[int] | None, exc: Exception | None) -> None:
        flight = self._flight
        self._summing -= len(ops)
        if sums is None:
            # The rows were validated, so a failed checksum is a bug: fail the blocks.
            err = TierIOError(_errno.EIO, f"internal error: checksum {exc!r}")
            for op in ops:
                op.error = err
        else:
            for op, summed in zip(ops, sums, strict=True):
                op.checksum = summed
        flight.pending.extend(ops)
        flight.pump()

    def start(self, ops: list[StoreBlock]) -> None:
        """Start ``ops``, already counted in flight: those that failed their
        checksum settle, those whose slot is being cleared wait, the rest are
        written as one engine batch."""
        flight = self._flight
        if any(op.error is not None for op in ops):
            for op in ops:
                if op.error is not None:
                    self._done(op, op.error)
            ops = [op for op in ops if op.error is None]
        if flight.slots.clearing:
            # (When the slot's previous block is being cleared, the write
            # waits: it could land before the zeros, which would erase it.)
            ops = [op for op in ops if not flight.slots.after_clearing(op.slot, self._later(op))]
        if not ops:
            return
        try:
            self._submit(ops)
        except Exception as exc:
            err = exc if isinstance(exc, KVTierError) else internal_error(exc, len(ops))
            for op in ops:
                self._done(op, err)

    def _later(self, op: StoreBlock) -> Callable[[], None]:
        """Start ``op`` (counted active already) once its slot is cleared."""
        return lambda: self.start([op])

    def _submit(self, ops: list[StoreBlock]) -> None:
        """Hand ``ops`` to the engine as one batch: header page and payload per block."""
        flight = self._flight
        run = StoreRun(ops, flight.pages.take_many(len(ops)))
        block_format.seal_headers(
            run.pages,
            run.keys,
            flight.namespace,
            flight.block_bytes,
            [op.checksum for op in ops],
            int(time.time()),
        )
        for op, page in zip(ops, run.pages, strict=True):
            op.page = page
        file_bytes = flight.file_bytes
        try:
            flight.engine.submit_many(
                False,
                flight.fd,
                [[page, op.view] for page, op in zip(run.pages, ops, strict=True)],
                [op.slot * file_bytes for op in ops],
                lambda done: self._ended(run, done),
                alignment=flight.io_alignment,
            )
        except BaseException:
            for op in ops:
                op.page = None
            flight.pages.give_many(run.pages)
            raise

    def _ended(self, run: StoreRun, done: list[tuple[int, int, BaseException | None]]) -> None:
        """Writes of ``run`` reaped: settle every block (or wait for its fsync)."""
        flight = self._flight
        ops = run.ops
        file_bytes = flight.file_bytes
        whole = [ops[i] for i, n, e in done if n == file_bytes and e is None]
        if self._fsync:
            self._wait_sync(whole)
        else:
            self._ok(whole)
        if len(whole) < len(done):
            for i, nbytes, exc in done:
                if exc is not None or nbytes != file_bytes:
                    op = ops[i]
                    err = transfer_error(
                        True, op.slot * file_bytes, nbytes, exc, file_bytes, flight.slots.path
                    )
                    self._done(op, err)

    def _ok(self, ops: list[StoreBlock]) -> None:
        """:meth:`_done` of blocks that all succeeded, the counters and the
        residency updated once for all of them."""
        if not ops:
            return
        flight = self._flight
        keys = [op.key for op in ops]
        flight.pages.give_many([op.page for op in ops if op.page is not None])
        flight.manager.complete_store(keys, success=True)
        flight.slots.index.publish_many([op.slot for op in ops], keys)
        self.stores += len(ops)
        self.bytes_written += len(ops) * flight.block_bytes
        flight.slots.released_many(keys)
        syncing = 0
        job = ops[0].job
        start = 0  # of the run of blocks of one job, counted together
        for i, op in enumerate(ops):
            op.page = None
            if op.syncing:
                op.syncing = False
                syncing += 1
            if op.job is not job:
                self._count_ok(job, keys[start:i])
                job, start = op.job, i
        self._count_ok(job, keys[start:] if start else keys)
        flight.active -= len(ops) - syncing
        self.clock.end(len(ops))
        flight.pump()
        flight.on_settled()

    def _count_ok(self, job: Job, keys: list[bytes]) -> None:
        """Blocks ``keys`` of ``job`` succeeded; the job ends with its last block."""
        job.ok += keys
        job.remaining -= len(keys)
        if job.remaining == 0:
            self._finish(job)

    def _wait_sync(self, ops: list[StoreBlock]) -> None:
        """Written blocks of ``durability="fsync"``: done once a shared fsync flushes them."""
        if not ops:
            return
        flight = self._flight
        flight.pages.give_many([op.page for op in ops if op.page is not None])
        for op in ops:
            op.page = None
            # The I/O slot is free once the data is written: a flush shared by
            # the blocks written meanwhile must not hold back the next writes.
            op.syncing = True
        flight.active -= len(ops)
        self._sync_waiting.extend(ops)
        self._start_sync()
        flight.pump()

    def _start_sync(self) -> None:
        """Flush the slot file for every block written so far (one fsync for many)."""
        if self._sync_running is not None or not self._sync_waiting:
            return
        flight = self._flight
        ops, self._sync_waiting = self._sync_waiting, []
        self._sync_running = ops
        try:
            done = flight.engine.fsync(flight.fd)
        except Exception as exc:
            self._synced(ops, exc)
            return
        done.add_done_callback(lambda c: self._synced(ops, c.exception()))

    def _synced(self, ops: list[StoreBlock], exc: BaseException | None) -> None:
        self._sync_running = None
        if exc is None:
            self._ok(ops)
        else:
            err = io_error(exc, "fsync", self._flight.slots.path)
            for op in ops:
                self._done(op, err)
        self._start_sync()

    def _done(self, op: StoreBlock, err: KVTierError | None) -> None:
        """One block of a store ended on its own (it failed, or waited for its slot)."""
        flight = self._flight
        if op.page is not None:
            flight.pages.give(op.page)
            op.page = None
        job = op.job
        key = op.key
        flight.manager.complete_store([key], success=err is None)
        if err is None:
            flight.slots.index.publish(op.slot, key)
            self.stores += 1
            self.bytes_written += flight.block_bytes
        else:
            self.store_failures += 1
            # What the failed write left in the slot is unknown: clear it so
            # that a restart cannot find a block nobody stored.
            flight.slots.zero(op.slot)
        flight.slots.released(key)
        if err is None:
            job.ok.append(key)
        else:
            job.failed[key] = err
            log.warning("file tier: block %s: %s", key.hex(), err)
        self.clock.end(1)
        if op.syncing:
            op.syncing = False
        else:
            flight.active -= 1
        job.remaining -= 1
        if job.remaining == 0:
            self._finish(job)
        flight.pump()
        flight.on_settled()

    def _finish(self, job: Job) -> None:
        job.done.set_result(
            StoreResult(
                stored=job.ordered(), skipped=job.skipped, failed=job.failed, evicted=job.evicted
            )
        )
