"""The file tier's I/O pipeline: stores and loads of blocks through the I/O engine.

A store's payloads are checksummed on the tier's thread
(:mod:`kvtier.tiers.file._worker`), a few MiB of blocks per call, each block's
header sealed into a page-aligned header page, and header and payload written
with one vectored request at the block's slot; with ``durability="fsync"`` the
blocks written meanwhile share one ``fsync``. A load reads header and payload
with one vectored request and verifies both right after its read is reaped,
before anything else is done with it; a block that fails is handed to the
quarantine, forgotten and reported as a miss.

Nothing here is done per block that can be done per run of blocks: the
blocks that fit in flight start as one engine batch
(:meth:`IOEngine.submit_many`, one compiled call to check and prepare it),
their headers sealed by one call; the engine reports the requests reaped
together in one callback, whose reads are verified by one call
(:data:`~kvtier.tiers.block_format.verify_reaped`, given the engine's outcomes as
they came), and the blocks that succeeded settle together (one residency
call, the counters once): a store's per reap, a load's once per run, with the
run's last read. Only a failed block takes the path of its own. A
load keeps no object per block (:class:`_Loads`: its blocks are positions in
the lists the engine, the verification and the residency take): after each
read the hashing has swept the CPU's caches, and each object a block touches
is a cache miss (run 14 in ``docs/lab/file-tier-runs.md``). At most four blocks per
engine slot are handed to the engine at once (one per slot in the kernel,
the rest in its queue), a load call's in runs of two queues' worth; the
rest wait here, in order. Each call is one job whose
completion resolves once its last block is done, with a :class:`StoreResult`
or :class:`LoadResult`.

Separate from the slot file (:mod:`kvtier.tiers.file._slots`: where a block is, and
clearing slots), from the recovery scan (:mod:`kvtier.tiers.file._recovery`: once,
at open) and from the quarantine (:mod:`kvtier.tiers.file._quarantine`): this module
is the one path every block of every call takes, and its counters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno as _errno
import logging
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import (
    BlockNotFoundError,
    CapacityError,
    IntegrityError,
    KVTierError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.manager import LoadPlan, ResidencyManager
from kvtier.tiers import block_format
from kvtier.tiers.base import LoadResult, StoreResult
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    VERIFY_CHECKSUM,
    VERIFY_HEADER,
    VERIFY_KEY,
    VERIFY_NAMESPACE,
    VERIFY_TRANSFER,
    HeaderError,
    decode_header_fields,
)
from kvtier.tiers.file._quarantine import Quarantine
from kvtier.tiers.file._slots import SlotFile
from kvtier.tiers.file._worker import Worker
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = ["LoadResult", "Pipeline", "StoreResult"]

log = logging.getLogger("kvtier.file_tier")

_SUM_BYTES = 8 << 20
"""Payload bytes checksummed per call to the tier's thread: one hand-off per
few MiB (per block, the hand-offs cost more than XXH3 itself at 64 KiB), and
the first writes start after 8 MiB is hashed (about 0.3 ms), not the whole call."""


@dataclass(slots=True)
class _Job:
    """One store or load call: the blocks still running and what they gave."""

    done: Completion[Any]
    store: bool
    remaining: int
    ok: list[bytes] = field(default_factory=list)
    failed: dict[bytes, KVTierError] = field(default_factory=dict)
    skipped: tuple[bytes, ...] = ()
    evicted: tuple[bytes, ...] = ()
    order: tuple[bytes, ...] = ()


@dataclass(slots=True)
class _BlockOp:
    """One block of a store call (a load call's blocks are :class:`_Loads`)."""

    key: bytes
    view: memoryview
    job: _Job
    slot: int
    """Slot of the file (not the manager's slot number)."""
    page: memoryview | None = None
    """Its header page while its write is in flight."""
    checksum: int = 0
    """XXH3 of the payload (stores), computed off the loop before the write."""
    error: KVTierError | None = None
    """Why the block fails before its I/O (its checksum could not be computed)."""
    syncing: bool = False
    """Written, waiting for an fsync: it holds no I/O slot."""


class _Run:
    """Blocks of a store handed to the engine as one batch, and the lists its calls take."""

    __slots__ = ("keys", "ops", "pages", "views")

    def __init__(self, ops: list[_BlockOp], pages: list[memoryview]) -> None:
        self.ops = ops
        self.pages = pages
        """The header pages, one per block."""
        self.keys = [op.key for op in ops]
        self.views = [op.view for op in ops]


class _Loads:
    """The blocks of one load call, started in order a run at a time.

    A load keeps no object per block: its blocks are positions in these lists,
    which the engine, the verification and the residency take as they are.
    """

    __slots__ = ("job", "keys", "next", "offsets", "views")

    def __init__(
        self, job: _Job, keys: list[bytes], views: list[memoryview], offsets: list[int]
    ) -> None:
        self.job = job
        self.keys = keys
        self.views = views
        self.offsets = offsets
        """Each block's offset in the slot file."""
        self.next = 0
        """The first block not started yet."""


class _LoadRun:
    """Blocks of one load call handed to the engine as one batch."""

    __slots__ = ("failed", "job", "keys", "left", "offsets", "pages", "views")

    def __init__(
        self,
        job: _Job,
        keys: list[bytes],
        views: list[memoryview],
        offsets: list[int],
        pages: list[memoryview],
    ) -> None:
        self.job = job
        self.keys = keys
        self.views = views
        self.offsets = offsets
        self.pages = pages
        self.left = len(keys)
        """Reads not reaped yet: the sound blocks settle together once it is 0."""
        self.failed: set[int] | None = None
        """Blocks that failed (settled on their own as they were reaped)."""


class _HeaderPages:
    """Page-aligned header buffers, one per block in flight (O_DIRECT needs aligned memory)."""

    def __init__(self, count: int) -> None:
        self._map = mmap.mmap(-1, count * HEADER_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._views = [self._view[i * HEADER_BYTES : (i + 1) * HEADER_BYTES] for i in range(count)]
        self._free = self._views[:]

    def take_many(self, count: int) -> list[memoryview]:
        """``count`` free pages (the caller never asks more than are free)."""
        taken = self._free[-count:]
        del self._free[-count:]
        return taken

    @property
    def memory(self) -> mmap.mmap:
        """The mapping of every page (to register with the I/O engine)."""
        return self._map

    def give_many(self, pages: list[memoryview]) -> None:
        self._free.extend(pages)

    def give(self, page: memoryview) -> None:
        self._free.append(page)

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._view.release()
        # A finished request's view may still be alive (a completion's closure):
        # the mapping is then unmapped by the garbage collector once it goes.
        with contextlib.suppress(BufferError):
            self._map.close()


class Pipeline:
    """Blocks of store and load calls, in flight through the I/O engine, and their counters.

    Parameters
    ----------
    loop
        The loop the tier was opened on; completions resolve on it.
    engine
        The I/O engine; four blocks per engine slot are handed to it at most.
    slots
        The slot file the blocks are read from and written to.
    manager
        The residency: plans every call and hears how each block ended.
    namespace
        The namespace written into, and checked against, every header.
    worker
        The tier's thread (payload checksums).
    quarantine
        Where blocks that fail verification are copied.
    fsync
        ``durability="fsync"``: a block is done once flushed.
    on_settled
        Called on the loop after each block ends, so that the tier can tell
        whether anything is still in flight.
    """

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        engine: IOEngine,
        slots: SlotFile,
        manager: ResidencyManager,
        namespace: bytes,
        worker: Worker,
        quarantine: Quarantine,
        fsync: bool,
        on_settled: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._engine = engine
        self._slots = slots
        self._manager = manager
        self._namespace = namespace
        self._worker = worker
        self._quarantine = quarantine
        self._fsync = fsync
        self._on_settled = on_settled
        self._block_bytes = slots.block_bytes
        self._file_bytes = slots.file_bytes
        self._io_alignment = slots.io_alignment
        self._fd = slots.fd
        # Four blocks per engine slot keep the queue full while completions are
        # handled, and bound the header pages (4 KiB each).
        self._max_active = 4 * engine.queue_depth
        # A load call's blocks start in runs of two queues' worth (or the rest
        # of the call), once there is room for a whole run: each engine batch
        # is one report and one verification per reap and settles once, and
        # runs cut to whatever room a reap freed (about 40 blocks at depth 64
        # on the virtio disk here) straddled reaps, each paying that twice.
        # Two runs in the engine keep its queue full while one settles (run
        # 17 in docs/lab/file-tier-runs.md).
        self._load_run = 2 * engine.queue_depth
        self._pages = _HeaderPages(self._max_active)
        self._pending: collections.deque[_BlockOp | _Loads] = collections.deque()
        self._active = 0
        self._summing = 0  # blocks whose payload checksum is being computed
        self._sync_waiting: list[_BlockOp] = []
        self._sync_running: list[_BlockOp] | None = None
        # counters
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.store_failures = 0
        self.evictions = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._busy = {True: 0, False: 0}  # blocks in flight, by "is a store"
        self._busy_since = {True: 0.0, False: 0.0}
        self._busy_seconds = {True: 0.0, False: 0.0}

    @property
    def busy(self) -> bool:
        """True while a block is queued, in flight or waiting for its fsync."""
        return bool(
            self._active
            or self._summing
            or self._pending
            or self._sync_waiting
            or self._sync_running is not None
        )

    def busy_seconds(self, store: bool) -> float:
        """Seconds during which stores (or loads) were in flight, up to now."""
        extra = time.perf_counter() - self._busy_since[store] if self._busy[store] else 0.0
        return self._busy_seconds[store] + extra

    @property
    def header_memory(self) -> mmap.mmap:
        """The header pages' mapping, registered with the engine beside the caller's rows."""
        return self._pages.memory

    def close(self) -> None:
        """Release the header pages (once nothing is in flight)."""
        self._pages.close()

    # -- calls --------------------------------------------------------------------------

    def refuse(self, keys: Sequence[bytes], err: KVTierError) -> Completion[StoreResult]:
        """A store of ``keys`` that fails whole with ``err``, counted as failures."""
        done: Completion[StoreResult] = Completion(self._loop)
        self.store_failures += len(keys)
        done.set_result(StoreResult(stored=(), skipped=(), failed=dict.fromkeys(keys, err)))
        return done

    def store(self, keys: Sequence[bytes], views: list[memoryview]) -> Completion[StoreResult]:
        """Write validated ``views`` as the blocks of ``keys`` (see :meth:`FileTier.store`)."""
        done: Completion[StoreResult] = Completion(self._loop)
        plan = self._manager.prepare_store(list(keys))
        if plan is None:
            present = tuple(k for k in keys if k in self._manager)
            err = CapacityError(
                f"no room for {len(keys) - len(present)} blocks in the file tier "
                f"({self._slots.slots} slots, pinned or in flight ones cannot be evicted)"
            )
            failed: dict[bytes, KVTierError] = {k: err for k in keys if k not in present}
            self.store_failures += len(failed)
            done.set_result(StoreResult(stored=(), skipped=present, failed=failed))
            return done
        file_slot = self._slots.file_slot
        to_write = {k: file_slot[s] for k, s in zip(plan.keys, plan.slots, strict=True)}
        # Withdrawn before their writes start: other instances stop looking
        # for what the slots held (a read racing the write fails verification).
        withdraw = self._slots.index.withdraw
        for written in to_write.values():
            withdraw(written)
        evicted = tuple(plan.evicted)
        self.evictions += len(evicted)
        job = _Job(
            done,
            store=True,
            remaining=len(to_write),
            skipped=tuple(k for k in keys if k not in to_write),
            evicted=evicted,
            order=tuple(keys),
        )
        ops = [
            _BlockOp(key, view, job, slot)
            for key, view in zip(keys, views, strict=True)
            if (slot := to_write.get(key)) is not None
        ]
        if not to_write:
            self._finish_job(job)
        per_call = max(1, _SUM_BYTES // max(1, self._block_bytes))
        for i in range(0, len(ops), per_call):
            self._sum(ops[i : i + per_call])
        return done

    def _sum(self, ops: list[_BlockOp]) -> None:
        """Checksum the payloads of ``ops`` on the tier's thread, then queue their writes."""
        self._summing += len(ops)
        views = [op.view for op in ops]
        self._worker.submit(
            lambda: block_format.checksums(views),
            lambda sums, e: self._summed(ops, sums, e),
            at_once=True,
        )

    def _summed(self, ops: list[_BlockOp], sums: list[int] | None, exc: Exception | None) -> None:
        self._summing -= len(ops)
        if sums is None:
            # The rows were validated, so a failed checksum is a bug: fail the blocks.
            err = TierIOError(_errno.EIO, f"internal error: checksum {exc!r}")
            for op in ops:
                op.error = err
        else:
            for op, summed in zip(ops, sums, strict=True):
                op.checksum = summed
        self._pending.extend(ops)
        self._pump()

    def load(
        self, keys: Sequence[bytes], views: list[memoryview], where: str
    ) -> Completion[LoadResult]:
        """Read validated ``views`` from the blocks of ``keys`` (see :meth:`FileTier.load`).

        ``where`` names the tier in the error of a key that is not ready.
        """
        done: Completion[LoadResult] = Completion(self._loop)
        order = tuple(keys)
        plan: LoadPlan | None
        try:
            # The usual call: every block is here, pinned by one call (which
            # pins nothing when one is not).
            plan = self._manager.prepare_load(order)
        except BlockNotFoundError:
            is_ready = self._manager.is_ready
            ready = [k for k in keys if is_ready(k)]
            plan = self._manager.prepare_load(ready) if ready else None
            by_key = dict(zip(keys, views, strict=True))
            views = [by_key[k] for k in ready]
        job = _Job(done, store=False, remaining=len(plan.keys) if plan else 0, order=order)
        if plan is None or len(plan.keys) < len(order):
            present = set(plan.keys) if plan else set()
            for k in order:
                if k not in present:
                    job.failed[k] = BlockNotFoundError(f"block {k.hex()} is not in the {where}")
        if job.remaining:
            assert plan is not None
            file_slot = self._slots.file_slot
            file_bytes = self._file_bytes
            self._pending.append(
                _Loads(
                    job,
                    list(plan.keys),
                    views,
                    [file_slot[s] * file_bytes for s in plan.slots],
                )
            )
        else:
            self._finish_job(job)
        self._pump()
        return done

    # -- blocks -------------------------------------------------------------------------

    def _pump(self) -> None:
        """Start as many pending blocks as there is room for: each load call's as
        one engine batch, the stores among them as another."""
        pending = self._pending
        stores: list[_BlockOp] = []
        # (The room is read again each time: a load that fails at once settles,
        # and pumps, inside _start_loads.)
        while pending and (room := self._max_active - self._active - len(stores)) > 0:
            head = pending[0]
            if isinstance(head, _Loads):
                left = len(head.keys) - head.next
                want = min(left, self._load_run)
                if room < want and self._active:
                    break  # (blocks in flight free more room: start a whole run then)
                count = min(room, want)
                if count == left:
                    pending.popleft()  # before it starts, so a nested pump cannot see it
                self._start_loads(head, count)
            else:
                pending.popleft()
                stores.append(head)
        if stores:
            self._active += len(stores)
            self._busy_start(True, len(stores))
            self._start_stores(stores)

    def _busy_start(self, store: bool, count: int) -> None:
        if not self._busy[store]:
            self._busy_since[store] = time.perf_counter()
        self._busy[store] += count

    def _busy_end(self, store: bool, count: int) -> None:
        self._busy[store] -= count
        if not self._busy[store]:
            self._busy_seconds[store] += time.perf_counter() - self._busy_since[store]

    # -- loads --------------------------------------------------------------------------

    def _start_loads(self, loads: _Loads, count: int) -> None:
        """Hand the next ``count`` blocks of ``loads`` to the engine as one batch."""
        first, end = loads.next, loads.next + count
        loads.next = end
        whole = first == 0 and end == len(loads.keys)
        run = _LoadRun(
            loads.job,
            loads.keys if whole else loads.keys[first:end],
            loads.views if whole else loads.views[first:end],
            loads.offsets if whole else loads.offsets[first:end],
            self._pages.take_many(count),
        )
        self._active += count
        self._busy_start(False, count)
        try:
            self._engine.submit_many(
                True,
                self._fd,
                [[page, view] for page, view in zip(run.pages, run.views, strict=True)],
                run.offsets,
                lambda done: self._loads_ended(run, done),
                alignment=self._io_alignment,
            )
        except Exception as exc:
            err = exc if isinstance(exc, KVTierError) else self._internal_error(exc, count)
            # Nothing was read: the blocks stay, for the next load to try.
            self._loads_failed(run, [(i, err) for i in range(count)], forget=False)

    def _internal_error(self, exc: Exception, count: int) -> TierIOError:
        """A bug's exception as the error of the ``count`` blocks it failed (never
        left pinned, nor the tier waiting for ever)."""
        log.exception("file tier: %d blocks failed to start", count)
        return TierIOError(_errno.EIO, f"internal error: {exc!r}")

    def _loads_ended(
        self, run: _LoadRun, done: list[tuple[int, int, BaseException | None]]
    ) -> None:
        """Reads of ``run`` reaped: verify them, then settle every block."""
        # Verified here, as soon as the reads are reaped and before any block
        # is reported: no caller ever sees an unchecked block. (block_format's
        # helpers are called through the module: it binds the compiled ones
        # last, after this module may have been imported during its import.)
        bad = block_format.verify_reaped(
            run.pages, run.keys, self._namespace, run.views, done, self._file_bytes
        )
        if bad:
            outcomes = {i: (nbytes, exc) for i, nbytes, exc in done}
            failures: list[tuple[int, KVTierError]] = []
            for i, outcome in bad:
                nbytes, exc = outcomes[i]
                offset = run.offsets[i]
                err: KVTierError
                if outcome == VERIFY_TRANSFER:
                    err = self._transfer_error(False, offset, nbytes, exc)
                else:
                    err = self._verify_error(run.keys[i], offset, run.pages[i], outcome)
                if isinstance(err, IntegrityError | NamespaceMismatchError):
                    # What the slot held (a bad block, a short read's part),
                    # kept before anything else is read into its page or row.
                    self._quarantine.keep(
                        offset // self._file_bytes,
                        run.keys[i],
                        run.pages[i],
                        run.views[i],
                        type(err).__name__,
                    )
                failures.append((i, err))
            if run.failed is None:
                run.failed = set()
            run.failed.update(i for i, _ in failures)
            self._loads_failed(run, failures)
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
            self._loads_ok(run.job, keys, pages)

    def _loads_ok(self, job: _Job, keys: list[bytes], pages: list[memoryview]) -> None:
        """Blocks ``keys`` of ``job`` were read and verified: the residency, the
        counters and the job updated once for all of them."""
        count = len(keys)
        self._pages.give_many(pages)
        self._manager.complete_load(keys)
        self._slots.released_many(keys)
        self.hits += count
        self.bytes_read += count * self._block_bytes
        self._active -= count
        self._busy_end(False, count)
        job.ok += keys
        job.remaining -= count
        if job.remaining == 0:
            self._finish_job(job)
        self._pump()
        self._on_settled()

    def _loads_failed(
        self, run: _LoadRun, failures: list[tuple[int, KVTierError]], *, forget: bool = True
    ) -> None:
        """Blocks of ``run`` failed, each ``(index, error)``: misses, and forgotten
        (``forget``) when their read failed or what it found cannot be served."""
        manager, job = self._manager, run.job
        for i, err in failures:
            key = run.keys[i]
            self._pages.give(run.pages[i])
            manager.complete_load([key])
            if forget and key in manager and manager.is_ready(key):
                self._slots.forget([key])
            self._slots.released(key)
            log.warning("file tier: block %s: %s", key.hex(), err)
            job.failed[key] = err
        count = len(failures)
        self._active -= count
        self._busy_end(False, count)
        job.remaining -= count
        if job.remaining == 0:
            self._finish_job(job)
        self._pump()
        self._on_settled()

    def _verify_error(self, key: bytes, offset: int, page: memoryview, outcome: int) -> KVTierError:
        """The error of a block that failed :func:`verify_block` (the failure path only)."""
        where = f"{self._slots.path} slot {offset // self._file_bytes}"
        if outcome == VERIFY_HEADER:
            try:
                decode_header_fields(page)
            except HeaderError as exc:
                return IntegrityError(f"bad block header ({exc})", where)
            return IntegrityError("bad block header", where)
        found, namespace, payload_bytes, _, _ = decode_header_fields(page)
        if outcome == VERIFY_NAMESPACE:
            return NamespaceMismatchError(
                f"{where} holds a block of namespace {namespace.hex()}, not {self._namespace.hex()}"
            )
        if outcome == VERIFY_KEY:
            return IntegrityError(f"slot holds block {found.hex()}, not {key.hex()}", where)
        if outcome == VERIFY_CHECKSUM:
            return IntegrityError("payload checksum mismatch", where)
        return IntegrityError(
            f"payload of {payload_bytes} bytes, expected {self._block_bytes}", where
        )

    # -- stores -------------------------------------------------------------------------

    def _start_stores(self, ops: list[_BlockOp]) -> None:
        if any(op.error is not None for op in ops):
            for op in ops:
                if op.error is not None:
                    self._store_done(op, op.error)
            ops = [op for op in ops if op.error is None]
        if self._slots.clearing:
            # (When the slot's previous block is being cleared, the write
            # waits: it could land before the zeros, which would erase it.)
            ops = [op for op in ops if not self._slots.after_clearing(op.slot, self._later(op))]
        if not ops:
            return
        try:
            self._submit_stores(ops)
        except Exception as exc:
            err = exc if isinstance(exc, KVTierError) else self._internal_error(exc, len(ops))
            for op in ops:
                self._store_done(op, err)

    def _later(self, op: _BlockOp) -> Callable[[], None]:
        """Start ``op`` (counted active already) once its slot is cleared."""
        return lambda: self._start_stores([op])

    def _submit_stores(self, ops: list[_BlockOp]) -> None:
        """Hand ``ops`` to the engine as one batch: header page and payload per block."""
        run = _Run(ops, self._pages.take_many(len(ops)))
        block_format.seal_headers(
            run.pages,
            run.keys,
            self._namespace,
            self._block_bytes,
            [op.checksum for op in ops],
            int(time.time()),
        )
        for op, page in zip(ops, run.pages, strict=True):
            op.page = page
        file_bytes = self._file_bytes
        try:
            self._engine.submit_many(
                False,
                self._fd,
                [[page, op.view] for page, op in zip(run.pages, ops, strict=True)],
                [op.slot * file_bytes for op in ops],
                lambda done: self._stores_ended(run, done),
                alignment=self._io_alignment,
            )
        except BaseException:
            for op in ops:
                op.page = None
            self._pages.give_many(run.pages)
            raise

    def _stores_ended(self, run: _Run, done: list[tuple[int, int, BaseException | None]]) -> None:
        """Writes of ``run`` reaped: settle every block (or wait for its fsync)."""
        ops = run.ops
        file_bytes = self._file_bytes
        whole = [ops[i] for i, n, e in done if n == file_bytes and e is None]
        if self._fsync:
            self._wait_sync(whole)
        else:
            self._stores_ok(whole)
        if len(whole) < len(done):
            for i, nbytes, exc in done:
                if exc is not None or nbytes != file_bytes:
                    op = ops[i]
                    err = self._transfer_error(True, op.slot * file_bytes, nbytes, exc)
                    self._store_done(op, err)

    def _transfer_error(
        self, store: bool, offset: int, nbytes: int, exc: BaseException | None
    ) -> KVTierError:
        slot = offset // self._file_bytes
        if exc is not None:
            return self._io_error(exc, f"{'writing' if store else 'reading'} slot {slot}")
        what = "write" if store else "read"
        text = f"short {what} of slot {slot}: {nbytes} of {self._file_bytes} bytes"
        if store:
            return TierIOError(0, text, self._slots.path)
        return IntegrityError(text, self._slots.path)

    def _stores_ok(self, ops: list[_BlockOp]) -> None:
        """:meth:`_store_done` of blocks that all succeeded, the counters and the
        residency updated once for all of them."""
        if not ops:
            return
        keys = [op.key for op in ops]
        self._pages.give_many([op.page for op in ops if op.page is not None])
        self._manager.complete_store(keys, success=True)
        self._slots.index.publish_many([op.slot for op in ops], keys)
        self.stores += len(ops)
        self.bytes_written += len(ops) * self._block_bytes
        self._slots.released_many(keys)
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
        self._active -= len(ops) - syncing
        self._busy_end(True, len(ops))
        self._pump()
        self._on_settled()

    def _count_ok(self, job: _Job, keys: list[bytes]) -> None:
        """Blocks ``keys`` of ``job`` succeeded; the job ends with its last block."""
        job.ok += keys
        job.remaining -= len(keys)
        if job.remaining == 0:
            self._finish_job(job)

    def _wait_sync(self, ops: list[_BlockOp]) -> None:
        """Written blocks of ``durability="fsync"``: done once a shared fsync flushes them."""
        if not ops:
            return
        self._pages.give_many([op.page for op in ops if op.page is not None])
        for op in ops:
            op.page = None
            # The I/O slot is free once the data is written: a flush shared by
            # the blocks written meanwhile must not hold back the next writes.
            op.syncing = True
        self._active -= len(ops)
        self._sync_waiting.extend(ops)
        self._start_sync()
        self._pump()

    def _io_error(self, exc: BaseException, what: str) -> TierIOError:
        """A failed request's error as this tier's: its errno (EIO when it has
        none), what the tier was doing, and the slot file's path."""
        code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else _errno.EIO
        text = getattr(exc, "strerror", None) or exc
        return TierIOError(code, f"{what}: {text}", self._slots.path)

    def _start_sync(self) -> None:
        """Flush the slot file for every block written so far (one fsync for many)."""
        if self._sync_running is not None or not self._sync_waiting:
            return
        ops, self._sync_waiting = self._sync_waiting, []
        self._sync_running = ops
        try:
            done = self._engine.fsync(self._fd)
        except Exception as exc:
            self._synced(ops, exc)
            return
        done.add_done_callback(lambda c: self._synced(ops, c.exception()))

    def _synced(self, ops: list[_BlockOp], exc: BaseException | None) -> None:
        self._sync_running = None
        if exc is None:
            self._stores_ok(ops)
        else:
            err = self._io_error(exc, "fsync")
            for op in ops:
                self._store_done(op, err)
        self._start_sync()

    def _store_done(self, op: _BlockOp, err: KVTierError | None) -> None:
        """One block of a store ended on its own (it failed, or waited for its slot)."""
        if op.page is not None:
            self._pages.give(op.page)
            op.page = None
        job = op.job
        key = op.key
        self._manager.complete_store([key], success=err is None)
        if err is None:
            self._slots.index.publish(op.slot, key)
            self.stores += 1
            self.bytes_written += self._block_bytes
        else:
            self.store_failures += 1
            # What the failed write left in the slot is unknown: clear it so
            # that a restart cannot find a block nobody stored.
            self._slots.zero(op.slot)
        self._slots.released(key)
        if err is None:
            job.ok.append(key)
        else:
            job.failed[key] = err
            log.warning("file tier: block %s: %s", key.hex(), err)
        self._busy_end(True, 1)
        if op.syncing:
            op.syncing = False
        else:
            self._active -= 1
        job.remaining -= 1
        if job.remaining == 0:
            self._finish_job(job)
        self._pump()
        self._on_settled()

    def _finish_job(self, job: _Job) -> None:
        if len(job.ok) == len(job.order):
            ordered = job.order  # every block succeeded (the common case)
        else:
            ok = set(job.ok)
            ordered = tuple(k for k in job.order if k in ok)
        if job.store:
            job.done.set_result(
                StoreResult(
                    stored=ordered, skipped=job.skipped, failed=job.failed, evicted=job.evicted
                )
            )
        else:
            self.misses += len(job.failed)
            if ordered:
                # A load is a use: the blocks a request hit move up the policy's order.
                self._manager.touch(list(ordered))
            job.done.set_result(LoadResult(loaded=ordered, missing=job.failed))
