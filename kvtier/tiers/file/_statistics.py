"""The file tier's record (:class:`FileTierStatistics`) and its assembly from the tier's parts.

Each figure is counted by the part that does the work (the pipeline its
blocks, the recovery its scan, the quarantine its copies, the peers their
reads); :func:`gather` reads them into one frozen record. Apart from the tier
so that the record, its field docs and the mapping of every figure from its
part stay in one place, and the facade's ``statistics()`` is one call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtier.tiers.file._parts import Parts

__all__ = ["FileTierStatistics", "gather"]


@dataclass(frozen=True, slots=True)
class FileTierStatistics:
    """State and counters of a :class:`FileTier`."""

    capacity_bytes: int
    """Bytes of the slots of ``blocks.dat`` (its size, reserved at open): the
    whole slots of this namespace's share of ``bytes_to_use``, once its
    metadata, quarantine allowance and the other namespaces are counted."""
    used_bytes: int
    """Bytes of the slots holding a block (resident or being written)."""
    blocks: int
    """Blocks resident or being written."""
    block_bytes: int
    """Payload bytes per block."""
    file_bytes: int
    """Bytes per slot (header + payload)."""
    hits: int
    """Blocks loaded and verified."""
    misses: int
    """Blocks asked for and not loaded (absent or failed)."""
    stores: int
    """Blocks written."""
    store_failures: int
    """Blocks whose write failed (I/O error or no room)."""
    evictions: int
    """Blocks evicted to make room."""
    bytes_read: int
    """Payload bytes read by successful loads."""
    bytes_written: int
    """Payload bytes written by successful stores."""
    read_gbps: float
    """``bytes_read`` over the time reads were in flight, in GB/s (1e9 B/s)."""
    write_gbps: float
    """``bytes_written`` over the time writes were in flight, in GB/s."""
    io_engine: str
    """``"io_uring"`` or ``"threads"``."""
    queue_depth: int
    """The I/O engine's queue depth (with ``queue_depth="auto"``, the one measured at open)."""
    direct_io: bool
    """True when the slot file uses O_DIRECT."""
    direct_io_fallback: str | None
    """Why buffered I/O is used instead of O_DIRECT, or None."""
    durability: str
    """``"none"`` or ``"fsync"``."""
    quarantined: int
    """Blocks that failed verification since the tier was opened, and slots
    found at open with a header of another namespace."""
    recovery: Literal["running", "complete", "failed"]
    """State of the rebuild from the slot file: it finishes inside
    :meth:`FileTier.open` with ``recovery="foreground"``; with ``"background"``
    it is ``"running"`` until :meth:`FileTier.wait_recovered` would return."""
    recovered_blocks: int
    """Blocks found valid at open."""
    recovery_seconds: float
    """Time the slot scan and rebuild took at open."""
    torn_slots: int
    """Slots found at open with an invalid header (an interrupted write), zeroed."""
    registered_bytes: int = 0
    """Memory registered with the I/O engine by :meth:`FileTier.register_memory`
    (the caller's buffers and the tier's header pages); 0 when none is."""
    partition: str = ""
    """This tier's partition of the namespace (its directory's name): the
    namespace, then ``.<n>`` for the second and later live instances."""
    peer_partitions: int = 0
    """Other partitions of the namespace on the root (other instances, live or not)."""
    peer_blocks: int = 0
    """Blocks the other partitions hold, as their indexes say."""
    peer_hits: int = 0
    """Blocks loaded from other partitions, verified (also in ``hits``)."""
    peer_stale: int = 0
    """Reads from other partitions that found the slot rewritten or cleared by
    its owner meanwhile: misses, not damage (also in ``misses``)."""

    def metric_figures(self) -> dict[str, int | float | str]:
        """The file tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            # Every block failing verification has its slot quarantined.
            "integrity_failures_total": self.quarantined,
            "quarantined_blocks_total": self.quarantined,
            "evictions_total": self.evictions,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "recovery_blocks": self.recovered_blocks,
            "recovery_torn_slots": self.torn_slots,
            "recovery_seconds": self.recovery_seconds,
            "recovery_state": self.recovery,
            "vanished_blocks_total": self.peer_stale,
            "peer_blocks": self.peer_blocks,
        }


def gather(parts: Parts) -> FileTierStatistics:
    """A snapshot of one tier's figures, read from its parts (no I/O).

    Blocks read from other partitions count in ``hits`` and ``misses`` beside
    the tier's own.
    """
    pipeline, slots, recovery, peers = parts.pipeline, parts.slots, parts.recovery, parts.peers
    read_busy, write_busy = pipeline.busy_seconds(False), pipeline.busy_seconds(True)
    blocks = parts.manager.statistics().used
    return FileTierStatistics(
        capacity_bytes=slots.slots * slots.file_bytes,
        used_bytes=blocks * slots.file_bytes,
        blocks=blocks,
        block_bytes=slots.block_bytes,
        file_bytes=slots.file_bytes,
        hits=pipeline.hits + peers.hits,
        misses=pipeline.misses + parts.sharing.misses,
        stores=pipeline.stores,
        store_failures=pipeline.store_failures,
        evictions=pipeline.evictions,
        bytes_read=pipeline.bytes_read,
        bytes_written=pipeline.bytes_written,
        read_gbps=pipeline.bytes_read / read_busy / 1e9 if read_busy else 0.0,
        write_gbps=pipeline.bytes_written / write_busy / 1e9 if write_busy else 0.0,
        io_engine=parts.engine.name,
        queue_depth=parts.engine.queue_depth,
        direct_io=slots.direct,
        direct_io_fallback=slots.direct_fallback,
        durability=parts.config.durability,
        quarantined=parts.quarantine.count + recovery.foreign,
        recovery=recovery.state,
        recovered_blocks=recovery.recovered,
        recovery_seconds=recovery.seconds,
        torn_slots=recovery.torn,
        registered_bytes=parts.registered,
        partition=slots.dir.name,
        peer_partitions=peers.partitions,
        peer_blocks=peers.blocks,
        peer_hits=peers.hits,
        peer_stale=peers.stale,
    )
