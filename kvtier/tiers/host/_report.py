"""Private: what a host segment holds, read from outside (``kvtier inspect --shm``).

Reading a segment joins nothing: the file is opened read-only and mapped
read-only, no slot is taken and no lock either (liveness is asked of the
kernel with ``F_OFD_GETLK``, which takes none). What it reports is a
snapshot: instances store and evict while it reads.
"""

from __future__ import annotations

import mmap
import os
import stat
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvtier.shm import held_by_others
from kvtier.tiers.host._janitor import JANITOR_BYTE
from kvtier.tiers.host._layout import FILE_PREFIX, SHM_DIR, Segment, _read_header
from kvtier.tiers.host._table import Table

__all__ = ["HostSegmentReport", "inspect_host_segments"]


@dataclass(frozen=True, slots=True)
class HostSegmentReport:
    """One host segment as ``kvtier inspect --shm`` shows it."""

    path: str
    namespace: str
    """The namespace, in hex (the layout's: model identity and KV layout)."""
    row_bytes: int
    rows: int
    instances: int
    """Instance slots."""
    budget_bytes: int
    live_instances: int
    """Slots whose instance is alive now (its slot lock held)."""
    rows_held: tuple[int, ...]
    """Rows owned by each slot's live instance (0: none live there)."""
    rows_orphaned: int
    """Rows of instances that closed or died (their blocks readable, adopted by the next)."""
    rows_free: int
    blocks: int
    """Rows holding a published block (an owner, an even seq and a key)."""
    rows_writing: int
    watched: bool
    """A janitor watches it (it removes the segment once no instance held it for a while)."""
    creator_pid: int

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values."""
        return asdict(self)


def inspect_host_segments(directory: str = SHM_DIR) -> list[HostSegmentReport]:
    """Every kvtier host segment in ``directory`` this user can read, by path.

    Files under the prefix that are not host segments (another version, a
    damaged header, being created) are left out.
    """
    out: list[HostSegmentReport] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            report = _report(path, fd)
        except (OSError, ValueError):  # removed or truncated under us
            report = None
        finally:
            os.close(fd)
        if report is not None:
            out.append(report)
    return out


def _report(path: str, fd: int) -> HostSegmentReport | None:
    st = os.fstat(fd)
    header = _read_header(fd) if stat.S_ISREG(st.st_mode) else None
    if header is None or st.st_size < header.geometry.total_bytes:
        return None
    g = header.geometry
    m = mmap.mmap(fd, g.total_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    table = Table(Segment(fd, path, m, g, created=False))
    try:
        live = table.live_slots(fd, -1)
        held, orphaned, free = table.rows_held(live)
        seq, owner = table.row_np[:, 0], table.row_np[:, 1]
        keyed = (table.row_np[:, 2] != 0) | (table.row_np[:, 3] != 0)
        blocks = int(np.count_nonzero((owner != 0) & ((seq & np.uint64(1)) == 0) & keyed))
        return HostSegmentReport(
            path=path,
            namespace=g.namespace.hex(),
            row_bytes=g.row_bytes,
            rows=g.rows,
            instances=g.instances,
            budget_bytes=g.budget_bytes,
            live_instances=sum(live),
            rows_held=held,
            rows_orphaned=orphaned,
            rows_free=free,
            blocks=blocks,
            rows_writing=table.writing(),
            watched=held_by_others(fd, JANITOR_BYTE),
            creator_pid=header.creator_pid,
        )
    finally:
        del seq, owner, keyed
        table.release()
        m.close()
