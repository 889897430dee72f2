"""The cluster tier's statistics: the public record, the counters behind it, and its assembly.

:class:`ClusterTierStatistics` is what :meth:`ClusterTier.statistics` returns
(and :mod:`kvtier.metrics` exports through :meth:`~ClusterTierStatistics.metric_figures`);
:class:`Counters` is the mutable tally the tier's store, load and refresh
paths add to, one object they share so that no path owns another's figures.
:func:`snapshot` joins the tally with the client's fault counters into one
record. Kept apart from the tier so that the tier holds behaviour, not a
record of thirty fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvtier.config import ClusterTierConfig

if TYPE_CHECKING:
    # The client imports redis (the optional ``cluster`` extra): a type here only.
    from kvtier.tiers.cluster._client import ClusterClient

__all__ = ["ClusterTierStatistics", "Counters", "snapshot"]


@dataclass(frozen=True, slots=True)
class ClusterTierStatistics:
    """State and counters of one :class:`ClusterTier` instance (not of the cluster)."""

    mode: Literal["cluster", "single"]
    """``cluster`` or ``single`` (one server)."""
    nodes: int
    """Primary nodes known (1 with ``mode="single"``)."""
    blocks: int
    """Keys in this instance's presence set (stored, loaded or refreshed here)."""
    block_bytes: int
    """Payload bytes per block."""
    value_bytes: int
    """Bytes of one value on the server (header + payload)."""
    hits: int
    """Blocks loaded and verified."""
    misses: int
    """Blocks asked for and not loaded (absent, vanished, damaged or failed)."""
    vanished: int
    """Misses of blocks the presence set held (evicted by the server, removed by a peer)."""
    verification_failures: int
    """Values read back and refused: truncated, foreign, of another namespace or
    key, or failing their checksum."""
    stores: int
    """Blocks written."""
    skipped: int
    """Blocks not written because this instance knew them present."""
    store_failures: int
    """Blocks whose write failed (a fault, or the server out of memory)."""
    load_failures: int
    """Blocks whose read failed on a fault (counted in ``misses`` too)."""
    bytes_read: int
    """Payload bytes of successful loads."""
    bytes_written: int
    """Payload bytes of successful stores."""
    read_gbps: float
    """``bytes_read`` over the time loads were in flight, in GB/s (1e9 B/s)."""
    write_gbps: float
    """``bytes_written`` over the time stores were in flight, in GB/s."""
    round_trips: int
    """Pipelines sent (one round trip to one node each)."""
    exists_queries: int
    """Keys asked about with ``EXISTS`` by :meth:`ClusterTier.refresh`."""
    timeouts: int
    """Pipelines that timed out."""
    connection_errors: int
    """Pipelines that lost or could not open their connection."""
    redirections: int
    """Commands left failing with MOVED/ASK/TRYAGAIN after redis-py's own redirection."""
    cluster_down: int
    """Commands refused with CLUSTERDOWN, or keys of a slot no node serves."""
    refused_in_backoff: int
    """Blocks failed at once, without I/O, because their node was down."""
    reconnects: int
    """Tries to reach a node again during its outage (background probes)."""
    outages: int
    """Node outages begun: a node found not answering, at open or by a fault of
    a pipeline (one WARNING each, naming the node); when no node answered at
    open, one for the whole cluster."""
    recoveries: int
    """Outages ended: the node answered again, or serves no slot any more."""
    nodes_down: int
    """Nodes in an outage now: their blocks are misses, without I/O."""

    def metric_figures(self) -> dict[str, int | float | str]:
        """The cluster tier's own figures (:data:`kvtier.metrics.OWN_FIGURES`)."""
        return {
            "integrity_failures_total": self.verification_failures,
            "vanished_blocks_total": self.vanished,
            "node_outages_total": self.outages,
            "nodes_down": self.nodes_down,
            "round_trips_total": self.round_trips,
        }


@dataclass(slots=True)
class Counters:
    """The tier's own counters, shared by its store, load and refresh paths (mutable)."""

    hits: int = 0
    misses: int = 0
    vanished: int = 0
    verify_failed: int = 0
    stores: int = 0
    skipped: int = 0
    store_failures: int = 0
    load_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    exists: int = 0
    read_busy: float = 0.0
    write_busy: float = 0.0


def snapshot(
    config: ClusterTierConfig,
    client: ClusterClient,
    counts: Counters,
    *,
    blocks: int,
    block_bytes: int,
    value_bytes: int,
) -> ClusterTierStatistics:
    """The record of ``counts`` and ``client``'s faults now; ``blocks``: the presence set's size."""
    c, f = counts, client.faults
    return ClusterTierStatistics(
        mode=config.mode,
        nodes=client.node_count(),
        blocks=blocks,
        block_bytes=block_bytes,
        value_bytes=value_bytes,
        hits=c.hits,
        misses=c.misses,
        vanished=c.vanished,
        verification_failures=c.verify_failed,
        stores=c.stores,
        skipped=c.skipped,
        store_failures=c.store_failures,
        load_failures=c.load_failures,
        bytes_read=c.bytes_read,
        bytes_written=c.bytes_written,
        read_gbps=c.bytes_read / c.read_busy / 1e9 if c.read_busy else 0.0,
        write_gbps=c.bytes_written / c.write_busy / 1e9 if c.write_busy else 0.0,
        round_trips=f.round_trips,
        exists_queries=c.exists,
        timeouts=f.timeouts,
        connection_errors=f.connection_errors,
        redirections=f.redirections,
        cluster_down=f.cluster_down,
        refused_in_backoff=f.refused_in_backoff,
        reconnects=f.reconnects,
        outages=f.outages,
        recoveries=f.recoveries,
        nodes_down=client.nodes_down,
    )
