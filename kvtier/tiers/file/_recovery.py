"""Recovery: the file tier's residency rebuilt from the slot headers at open.

Every slot that holds data (never-written ranges are skipped with
``SEEK_DATA``) has its header read, runs of whole small slots in one request,
two batches in flight: valid blocks of this namespace become resident, oldest
first; invalid headers (interrupted writes), headers of another namespace and
the older of two slots holding one key are zeroed before the tier takes
writes. It runs inside :meth:`FileTier.open`, or after it with
``recovery="background"``, while the tier knows no block.

Separate from the I/O pipeline (:mod:`kvtier.tiers.file._pipeline`) because it
runs once, reads headers only, and decides what the slots hold; the pipeline
then serves blocks from the mapping it sets on the slot file
(:mod:`kvtier.tiers.file._slots`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as _errno
import logging
import mmap
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import Literal

from kvtier.errors import TierIOError
from kvtier.manager import ResidencyManager
from kvtier.tiers.block_format import HEADER_BYTES, HeaderError, scan_header
from kvtier.tiers.file._slots import SlotFile, data_runs
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine

__all__ = ["Recovery"]

log = logging.getLogger("kvtier.file_tier")

_RECOVERY_BATCH = 1024
_SCAN_BUFFER = 8 << 20
"""Bytes of slot headers read per batch at open (two batches in flight)."""
_SCAN_READS = 256
"""Reads per batch at open."""
_SCAN_WHOLE_SLOTS = 64 << 10
"""Slots up to this size are scanned by reading runs of whole slots (one
request per run); larger ones by one 4 KiB read per header. Measured here, a
4 KiB read costs about as much as 30-45 KiB of sequential reading."""
_ZERO_PAGE = bytes(HEADER_BYTES)


class Recovery:
    """The rebuild of one tier's residency from its slot file, and its outcome.

    Parameters
    ----------
    slots
        The slot file: read, its bad slots zeroed, its mapping set.
    engine
        The I/O engine that reads the headers.
    manager
        The residency, empty; the blocks found are stored into it.
    namespace
        The tier's namespace: headers of another are not this tier's blocks.
    settle
        Waits until every slot being zeroed is zeroed.
    """

    def __init__(
        self,
        *,
        slots: SlotFile,
        engine: IOEngine,
        manager: ResidencyManager,
        namespace: bytes,
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        self._slots = slots
        self._engine = engine
        self._manager = manager
        self._namespace = namespace
        self._settle = settle
        self.state: Literal["running", "complete", "failed"] = "complete"
        """``"running"`` during a background recovery, ``"failed"`` after one that failed."""
        self._task: asyncio.Task[None] | None = None
        self.recovered = 0
        """Blocks found valid."""
        self.seconds = 0.0
        """Time the scan and rebuild took."""
        self.torn = 0
        """Slots found with an invalid header (an interrupted write), zeroed."""
        self.foreign = 0
        """Slots found with a header of another namespace, zeroed."""
        self.keys: tuple[bytes, ...] = ()
        """The keys of the blocks found, oldest first, until
        :meth:`~kvtier.tiers.file.FileTier.take_recovered_keys` takes them."""

    def text(self) -> str:
        """The tier, named for an error while it is not recovered."""
        return (
            "file tier, still recovering"
            if self.state == "running"
            else ("file tier, whose recovery failed")
        )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the recovery in the background: :attr:`state` is ``"running"`` until it ends."""
        self.state = "running"
        self._task = loop.create_task(self._run_in_background())

    async def wait(self) -> None:
        """Wait until a background recovery ends (see :meth:`FileTier.wait_recovered`)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(task)
        if self.state == "failed":
            raise TierIOError(_errno.EIO, "the file tier's recovery failed", self._slots.dir)

    async def stop(self) -> None:
        """Stop a background recovery still running (the slot file is left as it was)."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task)

    async def _run_in_background(self) -> None:
        try:
            await self.run()
        except asyncio.CancelledError:
            self.state = "failed"  # stopped by aclose
            raise
        except Exception:
            log.exception("file tier %s: recovery failed; the tier stays empty", self._slots.dir)
            self.state = "failed"
        else:
            self.state = "complete"

    async def run(self) -> None:
        """Scan the slot headers, zero the bad ones and hand the blocks found to the manager."""
        started = time.perf_counter()
        sf = self._slots
        candidates = await asyncio.to_thread(_slots_with_data, sf.fd, sf.slots, sf.file_bytes)
        found: dict[bytes, tuple[int, int]] = {}  # key -> (stored_at, file slot)
        bad: list[int] = []
        stale: list[int] = []
        span = sf.file_bytes
        batches = _scan_batches(candidates, span)
        buffer = mmap.mmap(-1, 2 * _SCAN_BUFFER)
        view = memoryview(buffer)
        try:

            def submit(half: int, batch: list[tuple[int, int]]) -> list[Completion[int]]:
                out, at = [], half * _SCAN_BUFFER
                for first, count in batch:
                    size = (count - 1) * span + HEADER_BYTES
                    out.append(
                        self._engine.readv(
                            sf.fd,
                            [view[at : at + size]],
                            first * span,
                            alignment=sf.io_alignment,
                        )
                    )
                    at += size
                return out

            inflight = submit(0, batches[0]) if batches else []
            for n, batch in enumerate(batches):
                current = inflight
                # The next batch's reads run while this one is decoded.
                inflight = submit((n + 1) % 2, batches[n + 1]) if n + 1 < len(batches) else []
                at = (n % 2) * _SCAN_BUFFER
                for (first, count), done in zip(batch, current, strict=True):
                    size = (count - 1) * span + HEADER_BYTES
                    try:
                        got = await done
                    except Exception as exc:
                        log.error("file tier: cannot read slots from %d at open: %s", first, exc)
                        at += size
                        continue
                    for i in range(count):
                        offset = i * span
                        header = view[at + offset : at + offset + HEADER_BYTES]
                        valid = HEADER_BYTES if got >= offset + HEADER_BYTES else 0
                        self._classify(first + i, header, valid, found, bad, stale)
                    at += size
        finally:
            # Slices of the buffer may still be referenced by finished
            # requests; the mapping then goes with them.
            with contextlib.suppress(BufferError):
                view.release()
                buffer.close()
        for slot in bad + stale:
            sf.zero(slot)
        self._restore(found)
        if sf.clearing:
            # Torn headers are cleared before the tier takes writes.
            await self._settle()
        self.seconds = time.perf_counter() - started
        if found or bad:
            log.info(
                "file tier %s: recovered %d blocks in %.3f s (%d slots read, %d torn, "
                "%d of another namespace)",
                sf.dir,
                self.recovered,
                self.seconds,
                len(candidates),
                self.torn,
                len(bad) - self.torn,
            )

    def _classify(
        self,
        slot: int,
        page: memoryview,
        got: int,
        found: dict[bytes, tuple[int, int]],
        bad: list[int],
        stale: list[int],
    ) -> None:
        if got == HEADER_BYTES and page[:8] != _ZERO_PAGE[:8]:
            try:
                key, namespace, payload, stored_at = scan_header(page)
            except HeaderError:
                payload = -1
            if payload != self._slots.block_bytes:
                self.torn += 1
                bad.append(slot)
            elif namespace != self._namespace:
                self.foreign += 1
                bad.append(slot)
            else:
                prev = found.get(key)
                # Two slots may hold one key (evicted, stored again, then a
                # crash): both are valid; keep the newer and clear the other,
                # or it would come back once the newer is removed.
                if prev is None:
                    found[key] = (stored_at, slot)
                elif prev[0] < stored_at:
                    found[key] = (stored_at, slot)
                    stale.append(prev[1])
                else:
                    stale.append(slot)
        elif got == HEADER_BYTES and page != _ZERO_PAGE:
            self.torn += 1  # a header without its magic: a write cut short
            bad.append(slot)

    def _restore(self, found: dict[bytes, tuple[int, int]]) -> None:
        """Hand the blocks found to the manager, oldest first, and fix the slot mapping."""
        slots = self._slots.slots
        order = sorted(found, key=lambda k: found[k])
        mapping = array("q", [-1]) * slots
        taken: set[int] = set()
        for i in range(0, len(order), _RECOVERY_BATCH):
            # The manager takes the first key of a call as the most recent:
            # each batch goes newest first, the batches oldest first.
            batch = order[i : i + _RECOVERY_BATCH][::-1]
            plan = self._manager.prepare_store(batch)
            if plan is None or plan.evicted:
                # Cannot happen: at most one block per file slot was found.
                raise TierIOError(_errno.EIO, "internal error: recovery overflowed the manager")
            for key, mslot in zip(plan.keys, plan.slots, strict=True):
                mapping[mslot] = found[key][1]
                taken.add(found[key][1])
            self._manager.complete_store(list(plan.keys), success=True)
        free = (s for s in range(slots) if s not in taken)
        for mslot, slot in enumerate(mapping):
            if slot < 0:
                mapping[mslot] = next(free)
        self._slots.file_slot = mapping
        self._slots.index.rebuild({found[key][1]: key for key in order})
        self.recovered = len(order)
        self.keys = tuple(order)


# -- helpers (run in worker threads where they touch the disk) -------------------------


def _scan_batches(slots: list[int], span: int) -> list[list[tuple[int, int]]]:
    """Group the slots to scan into reads ``(first slot, count)``, and reads into batches.

    A read covers ``(count - 1) * span + 4096`` bytes: from the first header to
    the end of the last one; a batch fits in :data:`_SCAN_BUFFER`.
    """
    per_read = max(1, (_SCAN_BUFFER // 4) // span) if span <= _SCAN_WHOLE_SLOTS else 1
    reads: list[tuple[int, int]] = []
    for slot in slots:
        if reads and reads[-1][0] + reads[-1][1] == slot and reads[-1][1] < per_read:
            reads[-1] = (reads[-1][0], reads[-1][1] + 1)
        else:
            reads.append((slot, 1))
    batches: list[list[tuple[int, int]]] = []
    used = _SCAN_BUFFER
    for first, count in reads:
        size = (count - 1) * span + HEADER_BYTES
        if used + size > _SCAN_BUFFER or len(batches[-1]) >= _SCAN_READS:
            batches.append([])
            used = 0
        batches[-1].append((first, count))
        used += size
    return batches


def _slots_with_data(fd: int, slots: int, slot_bytes: int) -> list[int]:
    """Slots whose header lies in a range ``SEEK_DATA`` reports (all where unsupported).

    Ranges never written since the file was reserved read back as zeros, so a
    tier opened half full reads only the headers of the slots it used.
    """
    out: list[int] = []
    try:
        for start, stop in data_runs(fd, slots * slot_bytes):
            # Slots whose header [s*slot_bytes, s*slot_bytes + 4096) meets [start, stop).
            first = max(0, (start - HEADER_BYTES) // slot_bytes + 1) if start >= HEADER_BYTES else 0
            last = min(slots, -(-stop // slot_bytes))
            if out and first <= out[-1]:
                first = out[-1] + 1
            out.extend(range(first, last))
    except OSError as exc:
        if exc.errno not in (_errno.EINVAL, _errno.EOPNOTSUPP):
            raise TierIOError(exc.errno or 0, f"cannot scan the slot file: {exc.strerror}") from exc
        return list(range(slots))
    return out
