"""Private: :class:`HostTierStatistics`, and the counts and reads that fill it.

A host tier's record has two halves: what this instance counted as it went
(:class:`Counters`, bumped on the store and load paths, so plain attributes and
no calls) and what the segment's tables say now (slots, rows, leases, read
when asked). :func:`collect` puts them together; kept apart from the tier so
its class holds the paths that move blocks, and so each figure keeps one name
from where it is counted to the record (the counters are named as its fields).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers.host._leases import Leases
from kvtier.tiers.host._membership import Membership

__all__ = ["Counters", "HostTierStatistics", "collect"]


@dataclass(frozen=True, slots=True)
class HostTierStatistics:
    """One instance's figures, and the segment's as it sees them now."""

    path: str
    """The segment file."""
    rows: int
    """Rows of the segment (the host budget, in rows)."""
    row_bytes: int
    """Payload bytes of a row."""
    instances: int
    """Instance slots of the segment."""
    quota: int
    """Rows one instance may own (``rows // instances``)."""
    slot: int
    """This instance's slot."""
    live_instances: int
    """Instances attached now (this one included)."""
    rows_held: tuple[int, ...]
    """Rows owned by the live instance of each slot (0 for a free or dead slot)."""
    rows_orphaned: int
    """Rows of instances that closed or died, not adopted yet (their blocks stay readable)."""
    rows_free: int
    """Rows nobody owns."""
    blocks: int
    """Distinct keys the host holds, as far as this instance last refreshed."""
    own_blocks: int
    """Blocks in this instance's own rows."""
    stores: int
    """Blocks this instance stored."""
    duplicates_skipped: int
    """Stores skipped because some instance on the host held the key already."""
    stores_without_room: int
    """Stores skipped because every row this instance may use was leased by a reader."""
    own_hits: int
    """Verified loads from this instance's own rows."""
    peer_hits: int
    """Verified loads from other instances' rows."""
    stale_peer_reads: int
    """Loads of a peer's row that found it rewritten, being written, or failing its
    checksum: a miss, never wrong bytes."""
    misses: int
    """Loads of keys no row held as far as this instance knew."""
    rows_writing: int
    """Rows with an odd seq: being written now, or left so by a writer that died (never
    read; the instance that adopts them resets them)."""
    leases_outstanding: int
    """Leases held now by live readers, younger than ``lease_ttl_s``."""
    leases_expired: int
    """Lease entries of dead readers, or older than ``lease_ttl_s``, not dropped yet (no
    owner honours them)."""
    rows_adopted: int
    """Rows this instance took over from instances that closed or died."""
    rows_reset: int
    """Of those, rows whose owner died writing them (reset: they held nothing readable)."""
    evictions: int = 0
    """Blocks of this instance's rows evicted to make room for its stores."""
    integrity_failures: int = 0
    """Loads of this instance's own rows that failed verification (damaged in
    memory): dropped, a miss."""

    # The figures every tier of a chain reports (kvtier.tiers.base.TierStatistics).

    @property
    def block_bytes(self) -> int:
        """Payload bytes per block (a row's)."""
        return self.row_bytes

    @property
    def hits(self) -> int:
        """Verified loads, from this instance's rows and its peers'."""
        return self.own_hits + self.peer_hits

    @property
    def store_failures(self) -> int:
        """Stores that found no row (every row of this instance leased)."""
        return self.stores_without_room

    @property
    def bytes_read(self) -> int:
        """Payload bytes of verified loads."""
        return self.hits * self.row_bytes

    @property
    def bytes_written(self) -> int:
        """Payload bytes of this instance's stores."""
        return self.stores * self.row_bytes

    def metric_figures(self) -> dict[str, int | float | str]:
        """The host tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            "integrity_failures_total": self.integrity_failures,
            "evictions_total": self.evictions,
            "vanished_blocks_total": self.stale_peer_reads,
            "peer_blocks": self.blocks - self.own_blocks,
            "peer_hits_total": self.peer_hits,
            "stale_peer_reads_total": self.stale_peer_reads,
            "leases_outstanding": self.leases_outstanding,
            "rows_held": self.rows_held[self.slot],
            "used_bytes": self.own_blocks * self.row_bytes,
            "capacity_bytes": self.quota * self.row_bytes,
        }


@dataclass(slots=True)
class Counters:
    """What one instance counted since it opened (the fields of :class:`HostTierStatistics`
    of the same names)."""

    stores: int = 0
    duplicates_skipped: int = 0
    stores_without_room: int = 0
    own_hits: int = 0
    peer_hits: int = 0
    stale_peer_reads: int = 0
    misses: int = 0
    rows_adopted: int = 0
    rows_reset: int = 0
    evictions: int = 0
    integrity_failures: int = 0


def collect(
    member: Membership, leases: Leases, counts: Counters, blocks: int, own_blocks: int
) -> HostTierStatistics:
    """The record of one instance: its ``counts`` and the segment's tables as they are now
    (a syscall per live slot); ``blocks`` and ``own_blocks`` as the tier knows them."""
    t, fd, g = member.table, member.seg.fd, member.seg.geometry
    live = t.live_slots(fd, member.slot)
    held, orphaned, free = t.rows_held(live)
    outstanding, expired = leases.counts()
    return HostTierStatistics(
        path=member.seg.path,
        rows=g.rows,
        row_bytes=g.row_bytes,
        instances=g.instances,
        quota=g.quota,
        slot=member.slot,
        live_instances=sum(live),
        rows_held=held,
        rows_orphaned=orphaned,
        rows_free=free,
        blocks=blocks,
        own_blocks=own_blocks,
        rows_writing=t.writing(),
        leases_outstanding=outstanding,
        leases_expired=expired,
        stores=counts.stores,
        duplicates_skipped=counts.duplicates_skipped,
        stores_without_room=counts.stores_without_room,
        own_hits=counts.own_hits,
        peer_hits=counts.peer_hits,
        stale_peer_reads=counts.stale_peer_reads,
        misses=counts.misses,
        rows_adopted=counts.rows_adopted,
        rows_reset=counts.rows_reset,
        evictions=counts.evictions,
        integrity_failures=counts.integrity_failures,
    )
