"""Reclaiming a root by hand (``kvtier gc``): namespaces nobody has open, by age, to a size.

The same deletion as an open's reclaim
(:func:`~kvtier.tiers.file._delete.remove_namespace`: only what kvtier wrote,
in namespaces it recognizes and no tier has open), chosen by the operator's
rules instead of an open's need.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvtier.tiers.file._delete import remove_namespace
from kvtier.tiers.file._root import NamespaceUsage, scan_root
from kvtier.tiers.file._root_lock import lock_root_blocking

__all__ = ["Collection", "collect"]

log = logging.getLogger("kvtier.file_tier")


@dataclass(frozen=True, slots=True)
class Collection:
    """What :func:`collect` removed (or, in a dry run, would remove)."""

    chosen: tuple[NamespaceUsage, ...]
    """Namespaces removed, least recently used first (in a dry run: to be removed)."""
    freed_bytes: int
    """Bytes freed (in a dry run: the chosen namespaces' bytes on disk)."""
    before_bytes: int
    """Bytes on disk under the root before."""
    after_bytes: int
    """Bytes on disk under the root after (in a dry run: expected)."""
    kept: tuple[NamespaceUsage, ...]
    """Namespaces left: open ones, directories not recognized as kvtier's, and
    those no rule chose."""
    target_met: bool
    """False when ``keep_bytes`` was given and could not be reached (what is
    left is open, or not kvtier's)."""


def collect(
    root: Path,
    *,
    keep_bytes: int | None = None,
    unused_for: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
) -> Collection:
    """Remove namespaces no tier has open, by age and to a size (``kvtier gc``).

    A namespace is chosen when ``unused_for`` is given and it was last used
    at least that many seconds ago (or its last use is unknown); then, when
    ``keep_bytes`` is given, more are chosen, least recently used first,
    until the root takes at most ``keep_bytes`` on disk. Only namespaces
    recognized as kvtier's and not open are ever chosen, and only what
    kvtier wrote in them is removed (see
    :func:`~kvtier.tiers.file._delete.remove_namespace`). The whole run
    holds the root lock, so no tier opens meanwhile (a dry run holds it
    shared and creates nothing).

    Parameters
    ----------
    root
        The file tier root (an existing directory).
    keep_bytes
        Bytes the root may keep on disk, everything under it counted.
    unused_for
        Seconds since the last use after which a namespace goes.
    dry_run
        Choose, remove nothing.
    now
        The time to measure ``unused_for`` from (default: now).

    Returns
    -------
    Collection
        What was chosen (and, unless ``dry_run``, removed), what was kept, the
        bytes before and after, and whether ``keep_bytes`` was reached.

    Raises
    ------
    TierIOError
        When the root cannot be locked or listed.
    """
    moment = time.time() if now is None else now
    lock = lock_root_blocking(root, shared=dry_run, create=not dry_run)
    try:
        usage = scan_root(root, probe=True)
        idle = sorted(
            (ns for ns in usage.namespaces if ns.removable), key=lambda ns: ns.last_used or 0.0
        )
        chosen: list[NamespaceUsage] = []
        if unused_for is not None:
            chosen = [
                ns for ns in idle if ns.last_used is None or moment - ns.last_used >= unused_for
            ]
        left = usage.disk_bytes - sum(ns.disk_bytes for ns in chosen)
        if keep_bytes is not None:
            for ns in idle:
                if left <= keep_bytes:
                    break
                if ns not in chosen:
                    chosen.append(ns)
                    left -= ns.disk_bytes
        chosen.sort(key=lambda ns: ns.last_used or 0.0)
        if dry_run:
            freed = sum(ns.disk_bytes for ns in chosen)
            after = usage.disk_bytes - freed
        else:
            freed = 0
            for ns in chosen:
                freed += remove_namespace(ns)
                log.info("file tier: removed namespace %s", ns.describe())
            after = scan_root(root, probe=False).disk_bytes
    finally:
        if lock is not None:
            os.close(lock)
    kept = tuple(ns for ns in usage.namespaces if ns not in chosen)
    met = keep_bytes is None or after <= keep_bytes
    return Collection(tuple(chosen), freed, usage.disk_bytes, after, kept, met)
