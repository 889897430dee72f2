"""Blocks removed while the hardware still holds their slot: how they are parked and freed.

:meth:`~kvtier.manager.ResidencyManager.remove` of a block being written or
pinned by loads cannot free its slot yet: the data plane is still writing or
reading it. :func:`park` takes the blocks out of the ready and writing maps and
parks the busy ones in the manager's two removed maps;
:func:`complete_removed_stores` and :func:`complete_removed_loads` free them
when the matching completion comes. These are the manager's slow paths (a
removal is a block that failed verification), kept apart from its fast ones:
each is one call per manager call, over the containers the manager passes in.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import ProtocolError

__all__ = ["complete_removed_loads", "complete_removed_stores", "park"]


def park(
    keys: Sequence[bytes],
    index: dict[bytes, int],
    writing: dict[bytes, int],
    pins: dict[int, int],
    removed_writing: dict[bytes, int],
    removed_pinned: dict[bytes, int],
) -> tuple[list[bytes], list[int], list[int], list[bytes]]:
    """Take ``keys`` out of ``index`` and ``writing``, parking the busy ones.

    Returns
    -------
    tuple
        The keys removed and their slots, in the order of ``keys``; the slots
        free now (ready and unpinned); the keys that were ready (to announce).
        Absent keys, and keys removed already, are skipped.
    """
    gone: list[bytes] = []
    slots: list[int] = []
    now: list[int] = []
    announced: list[bytes] = []
    for k in keys:
        s = index.pop(k, None)
        if s is not None:
            announced.append(k)
            if s in pins:
                removed_pinned[k] = s
            else:
                now.append(s)
        else:
            s = writing.pop(k, None)
            if s is None:
                continue  # absent, or removed already
            removed_writing[k] = s
        gone.append(k)
        slots.append(s)
    return gone, slots, now, announced


def complete_removed_stores(
    keys: Sequence[bytes],
    writing: dict[bytes, int],
    removed_writing: dict[bytes, int],
    free: list[int],
) -> list[bytes]:
    """Free the removed blocks among ``keys``; return the others (all being written)."""
    for k in keys:
        if k not in writing and k not in removed_writing:
            raise ProtocolError(f"complete_store: block {k!r} is not being written")
    gone = [k for k in keys if k in removed_writing]
    free.extend(removed_writing.pop(k) for k in gone)
    return [k for k in keys if k in writing]


def complete_removed_loads(
    keys: Sequence[bytes],
    index: dict[bytes, int],
    removed_pinned: dict[bytes, int],
    pins: dict[int, int],
    slot_keys: list[bytes | None],
    free: list[int],
) -> None:
    """complete_load where some keys were removed while pinned (the slow path)."""
    slots: list[int] = []
    for k in keys:
        s = index.get(k)
        if s is None:
            s = removed_pinned.get(k)
        if s is None or s not in pins:
            raise ProtocolError(f"complete_load: block {k!r} is not pinned")
        slots.append(s)
    for k, s in zip(keys, slots, strict=True):
        c = pins[s] - 1
        if c:
            pins[s] = c
            continue
        del pins[s]
        if k in removed_pinned:
            del removed_pinned[k]
            slot_keys[s] = None
            free.append(s)
