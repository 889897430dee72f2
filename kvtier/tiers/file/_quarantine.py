"""Quarantine: copies of the file tier's blocks that failed verification, bounded.

A block whose header or payload checksum is wrong is copied (header page and
payload) to ``<namespace>/quarantine/`` for inspection, at most
:func:`~kvtier.tiers.file._sizing.quarantine_keep` copies, the oldest deleted first.
Separate from the I/O pipeline because it is a policy about the disk, not about
moving blocks: the pipeline only says which block failed and why; what is kept,
under which name and within which bound is decided here, and the copies are
written on the tier's one thread (:mod:`kvtier.tiers.file._worker`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.tiers.file._delete import trim_quarantine
from kvtier.tiers.file._namespace import write_file
from kvtier.tiers.file._sizing import quarantine_keep
from kvtier.tiers.file._worker import Worker

__all__ = ["Quarantine"]

log = logging.getLogger("kvtier.file_tier")


class Quarantine:
    """The quarantine directory of one open namespace, and its copies in flight.

    Parameters
    ----------
    ns_dir
        The namespace directory (its ``quarantine/`` exists).
    slots
        Slots of the tier: they bound the copies kept (none below 16 slots).
    worker
        The tier's thread, which writes and trims copies one at a time.
    on_settled
        Called on the loop once a copy is written (or failed), so that the
        tier can tell whether anything is still in flight.
    """

    def __init__(
        self, ns_dir: Path, slots: int, worker: Worker, on_settled: Callable[[], None]
    ) -> None:
        self._dir = ns_dir / "quarantine"
        self._slots = slots
        self._worker = worker
        self._on_settled = on_settled
        self._seq = 0
        self._writing = 0
        self.count = 0
        """Blocks that failed verification since the tier was opened."""

    @property
    def busy(self) -> bool:
        """True while a copy is being written."""
        return self._writing > 0

    def keep(
        self, slot: int, key: bytes, header: memoryview, payload: memoryview, reason: str
    ) -> None:
        """Keep a copy of a block that failed verification, for inspection (bounded).

        The bytes are copied before this returns: the caller's buffers may be
        reused at once.
        """
        self._seq += 1
        self.count += 1
        keep = quarantine_keep(self._slots)
        if not keep:
            # Copies count in the root's budget: a tier this small keeps none.
            log.warning(
                "file tier: slot %d (block %s) failed verification (%s); no copy kept "
                "(a tier of %d slots keeps none)",
                slot,
                key.hex(),
                reason,
                self._slots,
            )
            return
        data = bytes(header) + bytes(payload)
        name = f"{key.hex()}.{time.time_ns()}.{self._seq}.{reason}"
        log.warning("file tier: slot %d (block %s) quarantined as %s", slot, key.hex(), name)
        qdir = self._dir
        self._writing += 1
        # On the tier's one thread: copies are written and trimmed one at a time.
        self._worker.submit(lambda: _write_quarantine(qdir, name, data, keep), self._written)

    def _written(self, _result: object, exc: Exception | None) -> None:
        self._writing -= 1
        if exc is not None:
            log.error("file tier: quarantine copy failed: %s", exc)
        self._on_settled()


def _write_quarantine(qdir: Path, name: str, data: bytes, keep: int) -> None:
    """Write a quarantine copy, first deleting the oldest so that at most ``keep`` exist.

    Trimming before writing, not after, keeps the quarantine within the
    bytes the root's accounting gave it at every instant.
    """
    trim_quarantine(qdir, keep - 1)
    path = qdir / name
    try:
        write_file(path, data, os.O_EXCL)
    except OSError as exc:
        log.error("file tier: cannot write the quarantine copy %s: %s", name, exc)
        with contextlib.suppress(OSError):
            os.unlink(path)  # a partial copy is no use, and takes disk
