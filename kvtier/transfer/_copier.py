"""What differs between the device-copy backends: the :class:`_Copier` contract.

:class:`~kvtier.transfer.device.DeviceTransfer` runs a worker thread per
direction, plans each request once (:class:`CopyPlan`: every piece contiguous on
both sides, computed with numpy) and hands the plan to a copier: memcpy on CPU
(:mod:`kvtier.transfer._cpu_copy`), CUDA streams and events
(:mod:`kvtier.transfer._cuda_copy`), or a fault-injecting one in tests. Both
backends run a plan through the compiled loops of ``kvtier.transfer._copy``
where it is built, and through :func:`copy_pieces` (a Python loop, one slice
copy per piece) where it is not. A module of its own, below the backends and
:mod:`kvtier.transfer.device` (which picks one), so that no module imports one
that imports it back.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["COLUMNS", "CopyPlan", "CopyTable", "_Copier", "copy_pieces", "native"]

COLUMNS = ("dev", "host", "unit", "row_stride", "dev_bytes", "row_bytes", "rows")
"""The columns of :attr:`CopyTable.table`, in order (``_copy.c`` reads them so)."""


def _native() -> ModuleType | None:
    try:
        from kvtier.transfer import _copy
    except ImportError:  # not built (no C compiler): the Python loop copies
        return None
    return _copy


native = _native()
"""The compiled copy loops (``kvtier.transfer._copy``), or None where not built."""


@dataclass(frozen=True, slots=True)
class CopyTable:
    """Where every KV tensor and its slice of the host rows live; built once per transfer."""

    table: np.ndarray
    """``int64 (tensors, 7)``, one row per tensor with :data:`COLUMNS`: device and
    host (row 0) base addresses, the unit a piece counts in (one sub-block, or
    one K or V half of it, in bytes), the host row stride, the device tensor's
    bytes, the bytes of the tensor's slice of a row, and the number of rows."""
    dev: list[Any]
    """Per tensor, a flat uint8 view of the device tensor (torch, or numpy for
    the CPU backend): what :func:`copy_pieces` slices."""
    host: list[Any]
    """Per tensor, a flat uint8 view from row 0 of its slice to the end of the
    last row's (the bytes between slices included, never written)."""


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One request's copies, every one contiguous on both sides.

    Pieces are counted in each tensor's unit, so tensors of one kind (K/V-first
    or block-first) and one KV group share theirs: a tensor's pieces are rows
    ``spans[t, 0]:spans[t, 1]`` of :attr:`pieces`.
    """

    store: bool
    """Device -> host (a store), else host -> device."""
    tensors: CopyTable
    """The transfer's tensors."""
    pieces: np.ndarray
    """``int64 (n, 4)``: host row, host unit in the row, device unit, units."""
    spans: np.ndarray
    """``int64 (tensors, 2)``: each tensor's ``[start, stop)`` in :attr:`pieces`."""
    copies: int
    """Pieces over every tensor: the copies a piece-at-a-time loop issues."""
    nbytes: int
    """Bytes over every tensor."""


def copy_pieces(
    plan: CopyPlan, copy: Callable[[Any, Any], object], part: int = 0, parts: int = 1
) -> None:
    """Copy the pieces of every ``parts``-th tensor from ``part`` with ``copy(dst, src)``.

    The loop for where ``kvtier.transfer._copy`` is not built (or for torch
    views): offsets are computed with numpy per tensor, then one slice of each
    flat view per piece, so the same plan gives the same bytes as the compiled
    loops.
    """
    t = plan.tensors
    for i in range(part, len(t.dev), parts):
        unit, stride = int(t.table[i, 2]), int(t.table[i, 3])
        a, b = plan.spans[i].tolist()
        p = plan.pieces[a:b]
        host = (p[:, 0] * stride + p[:, 1] * unit).tolist()
        dev = (p[:, 2] * unit).tolist()
        lengths = (p[:, 3] * unit).tolist()
        hv, dv = t.host[i], t.dev[i]
        for h, d, n in zip(host, dev, lengths, strict=True):
            if plan.store:
                copy(hv[h : h + n], dv[d : d + n])
            else:
                copy(dv[d : d + n], hv[h : h + n])


class _Copier(abc.ABC):
    """What differs between backends: how a plan's copies run and complete.

    Implemented in :mod:`kvtier.transfer._cpu_copy` and
    :mod:`kvtier.transfer._cuda_copy`; tests plug fault-injecting ones in.
    """

    name: str
    numpy_views: bool = False
    """Whether :attr:`CopyTable.dev` and ``host`` should be numpy (else torch) views."""

    @abc.abstractmethod
    def mark(self) -> object:
        """Called on the submitting thread: a marker of the compute stream's progress."""

    @abc.abstractmethod
    def run(self, plan: CopyPlan, marker: object) -> tuple[int, Callable[[], None] | None]:
        """Issue every piece of ``plan``, in order after ``marker``.

        Returns the number of copies issued and, when the copies may still be
        running on return, a callable that blocks until they are done (it runs
        on a waiter thread, so the next request can be issued meanwhile).
        """

    def close(self) -> None:  # noqa: B027 - most copiers hold nothing to release
        """Release helper threads; called once no request is in flight."""
