"""Private: :class:`Membership`, one instance's place in a host segment, from join to leave.

Everything :class:`~kvtier.tiers.host._tier.HostTier` does to become, stay and stop
being one of the segment's instances lives here, apart from what it does with its
rows: taking a slot and an epoch while the segment is created or joined
(:func:`~kvtier.tiers.host._layout.attach`), handing the segment to a janitor
process, the segment's mutex for the rare table changes that need it, entering
the mapping in the page tables, and leaving (slot released, segment removed by
the last one). Kept apart so the tier's own code is about rows and keys; what
can go wrong while joining (a half-registered slot) is undone in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from kvtier.errors import SharedRegionError
from kvtier.shm import MADV_POPULATE_READ, madvise
from kvtier.tiers.host._janitor import ensure_janitor
from kvtier.tiers.host._layout import (
    Geometry,
    Segment,
    acquire_mutex,
    attach,
    release_mutex,
    release_slot,
    unlink_if_last,
)
from kvtier.tiers.host._table import Table

__all__ = ["Membership"]

T = TypeVar("T")

_MUTEX_WAIT = 5.0
"""Seconds a member waits for the segment's mutex once joined (closing, sweeping,
adopting): longer means its holder is stopped or stuck."""


class Membership:
    """A joined instance's segment, its tables, its slot and its epoch (fixed until it leaves)."""

    __slots__ = ("epoch", "seg", "slot", "table")

    def __init__(self, seg: Segment, table: Table, slot: int, epoch: int) -> None:
        self.seg = seg
        self.table = table
        self.slot = slot
        """This instance's slot in the instance table."""
        self.epoch = epoch
        """The slot's epoch, in every row entry this instance owns."""

    @staticmethod
    def join(
        geometry: Geometry,
        directory: str,
        join_timeout: float,
        orphan_grace_s: float | None,
        build: Callable[[Membership], T],
    ) -> T:
        """Create or join the segment of ``geometry``, take a slot, and ``build`` on it.

        ``build`` runs under the segment's mutex (before the file is named, for
        its creator), so what it claims no other instance can claim too; if it
        raises, or another creator linked first, the slot is released again.
        Raises what :meth:`HostTier.open <kvtier.tiers.host.HostTier.open>` says.
        """

        def register(seg: Segment) -> tuple[Membership, T]:
            table = Table(seg)
            try:
                slot = table.take_slot(seg.fd)
                table.sweep(seg.fd, slot)
                member = Membership(seg, table, slot, table.enter(slot))
                return member, build(member)
            except BaseException:
                table.release()
                raise

        def undo(made: tuple[Membership, T]) -> None:
            made[0].table.release()

        seg, (_, built) = attach(geometry, directory, join_timeout, register, undo)
        if orphan_grace_s is not None:
            ensure_janitor(seg.path, seg.fd, orphan_grace_s)
        return built

    @contextlib.contextmanager
    def mutex(self) -> Iterator[None]:
        """Hold the segment's mutex for the block's duration.

        Raises
        ------
        SharedRegionError
            The mutex stayed held past the wait (its holder is stopped or stuck).
        """
        fd = self.seg.fd
        if not acquire_mutex(fd, time.monotonic() + _MUTEX_WAIT):
            raise SharedRegionError(
                f"host segment {self.seg.path} stayed locked for {_MUTEX_WAIT} s: the "
                "instance holding it is stopped or stuck"
            )
        try:
            yield
        finally:
            release_mutex(fd)

    def populate(self, stop: Callable[[], bool], chunk: int) -> int:
        """Map the segment's pages ahead (see :meth:`HostTier.prefault`); bytes populated."""
        m = self.seg.map
        size = len(m)
        anchor = ctypes.c_char.from_buffer(m)  # the map's address; close waits for us
        try:
            base = ctypes.addressof(anchor)
            done = 0
            while done < size and not stop():
                n = min(chunk, size - done)
                if madvise(base + done, n, MADV_POPULATE_READ):
                    break
                done += n
            return done
        finally:
            del anchor

    def leave(self) -> None:
        """Drop the slot (and its leases), remove the segment if last, unmap and close it."""
        seg, t = self.seg, self.table
        try:
            if acquire_mutex(seg.fd, time.monotonic() + _MUTEX_WAIT):
                try:
                    t.leave(self.slot)
                    release_slot(seg.fd, self.slot)
                    unlink_if_last(seg)
                finally:
                    release_mutex(seg.fd)
            # Without the mutex (an instance stuck holding it) the name stays; closing
            # the descriptor drops this slot's lock, and the next joiner or reap sees it.
        finally:
            t.release()
            with contextlib.suppress(BufferError):
                seg.map.close()
            os.close(seg.fd)
