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
run's last read. Only a failed block takes the path of its own. A load keeps
no object per block (:class:`~kvtier.tiers.file._pipeline_flight.Loads`: its
blocks are positions in the lists the engine, the verification and the
residency take): after each read the hashing has swept the CPU's caches, and
each object a block touches is a cache miss (run 14 in
``docs/lab/file-tier-runs.md``). At most four blocks per engine slot are handed
to the engine at once (one per slot in the kernel, the rest in its queue), a
load call's in runs of two queues' worth; the rest wait here, in order. Each
call is one job whose completion resolves once its last block is done, with a
:class:`StoreResult` or :class:`LoadResult`.

:class:`Pipeline` is the face and the admission: the queue both kinds of call
wait in, the room in flight, the pump that starts what fits. What happens to a
block once started is a collaborator's it owns: the read side
(:mod:`kvtier.tiers.file._pipeline_reads`) and the write side
(:mod:`kvtier.tiers.file._pipeline_writes`), over the records both take
(:mod:`kvtier.tiers.file._pipeline_flight`).

Separate from the slot file (:mod:`kvtier.tiers.file._slots`: where a block is, and
clearing slots), from the recovery scan (:mod:`kvtier.tiers.file._recovery`: once,
at open) and from the quarantine (:mod:`kvtier.tiers.file._quarantine`): this module
and its parts are the one path every block of every call takes, and its counters.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable, Sequence

from kvtier.errors import KVTierError
from kvtier.manager import ResidencyManager
from kvtier.tiers.base import LoadResult, StoreResult
from kvtier.tiers.file._pipeline_flight import Flight, HeaderPages, Loads, StoreBlock
from kvtier.tiers.file._pipeline_reads import Reads
from kvtier.tiers.file._pipeline_writes import Writes
from kvtier.tiers.file._quarantine import Quarantine
from kvtier.tiers.file._slots import SlotFile
from kvtier.tiers.file._worker import Worker
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = ["LoadResult", "Pipeline", "StoreResult"]


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
        # Kept though only the sides use them: the tests and
        # benchmarks/paired_loads.py reach the engine, residency and slot file here.
        self._engine = engine
        self._slots = slots
        self._manager = manager
        self._namespace = namespace
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
        self._flight = Flight(
            loop=loop,
            engine=engine,
            slots=slots,
            manager=manager,
            namespace=namespace,
            pages=HeaderPages(self._max_active),
            pump=self._pump,
            on_settled=on_settled,
        )
        self._reads = Reads(self._flight, quarantine)
        self._writes = Writes(self._flight, worker, fsync)

    @property
    def busy(self) -> bool:
        """True while a block is queued, in flight or waiting for its fsync."""
        flight = self._flight
        return bool(flight.active or flight.pending or self._writes.busy)

    def busy_seconds(self, store: bool) -> float:
        """Seconds during which stores (or loads) were in flight, up to now."""
        return (self._writes if store else self._reads).clock.seconds()

    @property
    def header_memory(self) -> mmap.mmap:
        """The header pages' mapping, registered with the engine beside the caller's rows."""
        return self._flight.pages.memory

    def close(self) -> None:
        """Release the header pages (once nothing is in flight)."""
        self._flight.pages.close()

    # -- counters (each side counts its own) --------------------------------------------

    @property
    def hits(self) -> int:
        return self._reads.hits

    @property
    def misses(self) -> int:
        return self._reads.misses

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes_read

    @property
    def stores(self) -> int:
        return self._writes.stores

    @property
    def store_failures(self) -> int:
        return self._writes.store_failures

    @property
    def evictions(self) -> int:
        return self._writes.evictions

    @property
    def bytes_written(self) -> int:
        return self._writes.bytes_written

    # -- calls --------------------------------------------------------------------------

    def refuse(self, keys: Sequence[bytes], err: KVTierError) -> Completion[StoreResult]:
        """A store of ``keys`` that fails whole with ``err``, counted as failures."""
        return self._writes.refuse(keys, err)

    def store(self, keys: Sequence[bytes], views: list[memoryview]) -> Completion[StoreResult]:
        """Write validated ``views`` as the blocks of ``keys`` (see :meth:`FileTier.store`)."""
        return self._writes.store(keys, views)

    def load(
        self, keys: Sequence[bytes], views: list[memoryview], where: str
    ) -> Completion[LoadResult]:
        """Read validated ``views`` from the blocks of ``keys`` (see :meth:`FileTier.load`).

        ``where`` names the tier in the error of a key that is not ready.
        """
        return self._reads.load(keys, views, where)

    # -- blocks -------------------------------------------------------------------------

    def _pump(self) -> None:
        """Start as many pending blocks as there is room for: each load call's as
        one engine batch, the stores among them as another."""
        flight = self._flight
        pending = flight.pending
        stores: list[StoreBlock] = []
        # (The room is read again each time: a load that fails at once settles,
        # and pumps, inside Reads.start.)
        while pending and (room := self._max_active - flight.active - len(stores)) > 0:
            head = pending[0]
            if isinstance(head, Loads):
                left = len(head.keys) - head.next
                want = min(left, self._load_run)
                if room < want and flight.active:
                    break  # (blocks in flight free more room: start a whole run then)
                count = min(room, want)
                if count == left:
                    pending.popleft()  # before it starts, so a nested pump cannot see it
                self._reads.start(head, count)
            else:
                pending.popleft()
                stores.append(head)
        if stores:
            flight.active += len(stores)
            self._writes.clock.start(len(stores))
            self._writes.start(stores)
