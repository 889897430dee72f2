"""The worker group's counters, and their snapshot as a :class:`TransferStatistics`.

:class:`Counts` is the mutable tally the jobs in flight
(:class:`~kvtier.workers._inflight.InFlight`) add to as each job finishes;
:meth:`Counts.snapshot` turns it into the record
:meth:`~kvtier.workers.group.WorkerGroup.statistics` returns. The jobs add to
the fields directly rather than through a method, because a job's completion
is the hot path of every store and load.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.transfer.device import TransferStatistics

__all__ = ["Counts"]


@dataclass(slots=True)
class Counts:
    """What the group counted since it was bound; bytes are one rank's slices."""

    stores: int = 0
    """Store jobs every rank completed."""
    loads: int = 0
    """Load jobs every rank completed."""
    bytes_stored: int = 0
    """One rank's bytes of those stores."""
    bytes_loaded: int = 0
    """One rank's bytes of those loads."""
    failures: int = 0
    """Jobs that failed on some rank, or whose rank was lost."""

    def snapshot(self, world_size: int, in_flight: int) -> TransferStatistics:
        """The group's record: bytes summed over the ``world_size`` ranks."""
        return TransferStatistics(
            backend="workers",
            stores=self.stores,
            loads=self.loads,
            bytes_stored=self.bytes_stored * world_size,
            bytes_loaded=self.bytes_loaded * world_size,
            copies_issued=0,
            failures=self.failures,
            in_flight=in_flight,
        )
