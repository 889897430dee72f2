"""The root's one budget: the share of a namespace being opened, and reclaiming for it.

A namespace being opened wants the root's budget (``bytes_to_use``) less what
the others hold (:meth:`~kvtier.tiers.file._root.NamespaceUsage.held_bytes`:
an open namespace what it may still grow to, one not open what it has on
disk, a directory kvtier does not recognize what it has on disk, never
removed) and what else the root holds. With ``reclaim="lru"`` it deletes
namespaces nobody has open, least recently used first, until it has what it
wants (:func:`plan_share`). Live instances sharing a root split the budget
(``FileTierConfig.instances``) and must all have been given the same one
(:func:`check_budget`). Both run under the root lock
(:mod:`kvtier.tiers.file._root_lock`), on a root just measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvtier._sizes import format_size
from kvtier.errors import CapacityError, ConfigurationError
from kvtier.tiers.file._delete import remove_namespace
from kvtier.tiers.file._root import NamespaceUsage, RootUsage
from kvtier.tiers.file._sizing import disk_usage, slots_within

__all__ = ["OUTSIDE_WARN", "Share", "check_budget", "plan_share"]

log = logging.getLogger("kvtier.file_tier")

OUTSIDE_WARN = 0.5
"""Share of the budget above which what kvtier does not own in the root is warned of."""


@dataclass(frozen=True, slots=True)
class Share:
    """What the accounting gave a namespace being opened."""

    slots: int
    """Slots of its slot file."""
    wanted: int
    """Slots it would have with every namespace not open reclaimed."""
    room: int
    """Bytes of the budget left to the namespace: its metadata and slot file
    and quarantine must fit in them."""
    reclaimed: tuple[NamespaceUsage, ...]
    """Namespaces removed to make room, oldest first."""


def plan_share(
    usage: RootUsage,
    *,
    budget: int,
    slot_bytes: int,
    metadata: int,
    reclaim: bool,
    namespace: str,
    instances: int = 1,
) -> Share:
    """Give a namespace being opened its share of the root's budget.

    The namespace wants the budget less what namespaces in use (open, or not
    recognized as kvtier's) and other files hold. Namespaces not open hold
    what they have on disk; with ``reclaim`` the least recently used are
    removed, oldest first, until the namespace has what it wants.

    Parameters
    ----------
    usage
        The root without the namespace, from
        :func:`~kvtier.tiers.file._root.scan_root` with ``probe``.
    budget
        ``bytes_to_use``.
    slot_bytes
        Bytes per slot of the namespace.
    metadata
        Bytes its metadata takes (see
        :func:`~kvtier.tiers.file._sizing.metadata_estimate`).
    reclaim
        Remove namespaces not open when the share is less than wanted.
    namespace
        Its name, for messages.
    instances
        Live instances the root is shared by (``FileTierConfig.instances``):
        a partition takes at most ``budget // instances``.

    Raises
    ------
    CapacityError
        When not even one slot fits; the message names the budget and what
        holds the rest, namespace by namespace.
    """
    unit = usage.unit
    kept = [ns for ns in usage.namespaces if not ns.removable]
    idle = sorted(
        (ns for ns in usage.namespaces if ns.removable), key=lambda ns: ns.last_used or 0.0
    )
    held = usage.other_bytes + sum(ns.held_bytes(unit) for ns in kept)
    # Fair share: each of ``instances`` live partitions gets an equal part of
    # the budget (the root's own bytes come out of the first's).
    cap = budget // instances - (usage.other_bytes if instances > 1 else 0)
    most = slots_within(cap - metadata, slot_bytes, unit)
    wanted = min(most, slots_within(budget - held - metadata, slot_bytes, unit))

    def room() -> int:
        return min(cap, budget - held - sum(ns.disk_bytes for ns in idle))

    def slots_now() -> int:
        return slots_within(room() - metadata, slot_bytes, unit)

    # Namespaces whose partitions live instances read: they may hold a
    # reclaimed partition's index mapped (and its slot file open, truncated
    # to nothing by the reclaim) until their next listing of the root.
    read = {_namespace_of(ns.name) for ns in kept if ns.open}
    reclaimed: list[NamespaceUsage] = []
    while reclaim and idle and slots_now() < wanted:
        ns = idle.pop(0)
        freed = remove_namespace(ns)
        # A WARNING: another model's cache is gone, which an operator must be able
        # to see (serving engines show WARNING and above by default).
        log.warning(
            "file tier: reclaimed namespace %s (not open, last used %s) for %s: %s freed",
            ns.describe(),
            _when(ns.last_used),
            namespace,
            format_size(freed),
        )
        reclaimed.append(ns)
        if ns.path.exists():
            # Files kvtier did not write kept the directory: they still count.
            held += disk_usage(ns.path)
        if _namespace_of(ns.name) in read:
            # Its index stays allocated while a reader maps it (it cannot be
            # shrunk under a mapping): counted as held, so the budget holds.
            held += ns.index_bytes
    slots = slots_now()
    holders = _holders(usage.other_bytes, kept, idle, unit, reclaim)
    if slots < 1:
        shared = any(ns.open for ns in kept)
        raise CapacityError(
            f"bytes_to_use ({format_size(budget)}) of the file tier root {usage.root} leaves "
            f"no room for one slot of {format_size(slot_bytes)} for namespace {namespace}"
            + (f" (at most 1/{instances} of it per instance)" if instances > 1 else "")
            + f": {holders}"
            + (
                "; live instances sharing a root split its budget by the file tier's "
                "`instances` (each takes at most bytes_to_use // instances)"
                if shared
                else ""
            )
        )
    full = min(most, slots_within(budget - usage.other_bytes - metadata, slot_bytes, unit))
    if slots < full:
        log.warning(
            "file tier: namespace %s gets %d slots (%s) of bytes_to_use %s, not %d: %s",
            namespace,
            slots,
            format_size(slots * slot_bytes),
            format_size(budget),
            full,
            holders,
        )
    else:
        log.info(
            "file tier: namespace %s gets %d slots (%s) of bytes_to_use %s: %s",
            namespace,
            slots,
            format_size(slots * slot_bytes),
            format_size(budget),
            holders,
        )
    _warn_outside(usage, kept, budget, namespace, slots * slot_bytes)
    return Share(slots, wanted, room(), tuple(reclaimed))


def check_budget(usage: RootUsage, budget: int, namespace: str) -> None:
    """Refuse a budget other than the one the instances open on the root were given.

    Every tier records its ``bytes_to_use`` in its partition's
    ``namespace.json`` at open. A root has one budget: with a larger one, a
    later instance would take its share out of room the first counted on,
    and the root's usage exceed the first's budget. Instances of one
    namespace (one model sharing the root, split by ``instances``) must
    agree: another budget is refused. A tier of another namespace open with
    another budget is warned of, naming both (each model's budget is then the
    root's only as far as the other's leaves it).

    Parameters
    ----------
    usage
        The root, from :func:`~kvtier.tiers.file._root.scan_root` with
        ``probe``.
    budget
        ``bytes_to_use`` of the tier being opened.
    namespace
        Its namespace (32 hex characters).

    Raises
    ------
    ConfigurationError
        Naming both budgets and the partitions open with the other one.
    """
    same: dict[int, list[str]] = {}
    other: dict[int, list[str]] = {}
    for ns in usage.namespaces:
        theirs = ns.description.bytes_to_use if ns.open and ns.description else None
        if theirs is not None and theirs != budget:
            into = same if _namespace_of(ns.name) == namespace else other
            into.setdefault(theirs, []).append(ns.name)
    if same:
        first = format_size(min(same))
        what = (
            f"bytes_to_use ({format_size(budget)}) differs from what the instances open on "
            f"the root {usage.root} were given: {_budgets(same)}. A root has one budget, "
            "split between the live instances sharing it: give every instance the same "
            f"bytes_to_use ({first}), or close them first"
        )
        raise ConfigurationError(what, (("bytes_to_use", what),))
    if other:
        log.warning(
            "file tier: bytes_to_use (%s) differs from what the file tiers of other models "
            "open on the root %s were given: %s; the root's usage may exceed the smaller "
            "budget. Give every tier on a root the same bytes_to_use",
            format_size(budget),
            usage.root,
            _budgets(other),
        )


def _budgets(given: dict[int, list[str]]) -> str:
    return "; ".join(
        f"{format_size(size)} ({', '.join(names)})" for size, names in sorted(given.items())
    )


def _namespace_of(name: str) -> str:
    """The namespace a partition directory belongs to (its name without ``.<n>``)."""
    return name.partition(".")[0]


def _warn_outside(
    usage: RootUsage, kept: Iterable[NamespaceUsage], budget: int, namespace: str, left: int
) -> None:
    """WARN when what kvtier does not own in the root takes most of the budget."""
    foreign = [ns for ns in kept if not ns.open and ns.problem is not None]
    outside = usage.other_bytes + sum(ns.disk_bytes for ns in foreign)
    if outside <= budget * OUTSIDE_WARN:
        return
    largest = [(name, size) for name, size in usage.outside] + [
        (ns.name, ns.disk_bytes) for ns in foreign
    ]
    largest.sort(key=lambda entry: -entry[1])
    named = ", ".join(f"{name} ({format_size(size)})" for name, size in largest[:3])
    log.warning(
        "file tier: files kvtier did not write take %s of the root %s's bytes_to_use %s "
        "(they count in it and are never removed), leaving namespace %s %s of slots%s",
        format_size(outside),
        usage.root,
        format_size(budget),
        namespace,
        format_size(left),
        f": {named}" if named else "",
    )


def _holders(
    other: int,
    kept: Iterable[NamespaceUsage],
    idle: Iterable[NamespaceUsage],
    unit: int,
    reclaim: bool,
) -> str:
    parts = []
    opened = [ns for ns in kept if ns.open]
    foreign = [ns for ns in kept if not ns.open]
    if opened:
        total = sum(ns.held_bytes(unit) for ns in opened)
        parts.append(
            f"{format_size(total)} held by open namespaces "
            + ", ".join(f"{ns.describe()}" for ns in opened)
        )
    idle = list(idle)
    if idle:
        why = "reclaim is off" if not reclaim else "not reclaimed"
        parts.append(
            f"{format_size(sum(ns.disk_bytes for ns in idle))} by namespaces not open ({why}) "
            + ", ".join(ns.describe() for ns in idle)
        )
    if foreign:
        parts.append(
            f"{format_size(sum(ns.disk_bytes for ns in foreign))} by directories kvtier does not "
            "recognize (never removed) " + ", ".join(f"{ns.name} ({ns.problem})" for ns in foreign)
        )
    parts.append(f"{format_size(other)} by the root directory and other files")
    return "; ".join(parts)


def _when(t: float | None) -> str:
    if t is None:
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
