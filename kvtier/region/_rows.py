"""Rows the tiers store from and load into: kvtier's own region, or another engine's memory.

The tiers and the chain's runtime need little of a region: each row as a
writable view, the whole mapping (a file tier registers it), and the row
geometry. :class:`Rows` names that much; :class:`~kvtier.region.CPURegion`
(kvtier's own rows) and :class:`ForeignRows` (slots of another engine's CPU
buffer, below which kvtier's tiers sit: :mod:`kvtier.below`) both have it.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Protocol

from kvtier.errors import AlignmentError, ClosedError, InvalidArgumentError

__all__ = ["ForeignRows", "Rows", "address_of"]


class Rows(Protocol):
    """What a tier and the runtime use of rows: geometry, one row, the whole buffer."""

    @property
    def rows(self) -> int: ...
    @property
    def row_stride(self) -> int: ...
    @property
    def slice_bytes(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def alignment(self) -> int: ...
    def row(self, i: int) -> memoryview: ...
    def buffer(self) -> memoryview: ...


def address_of(view: memoryview) -> int:
    """The address of a writable memoryview's first byte."""
    if view.readonly:
        raise InvalidArgumentError("the buffer must be writable")
    if view.nbytes == 0:
        raise InvalidArgumentError("the buffer is empty")
    with view.cast("B") as flat:  # a view of our own: released here, not the caller's
        char = ctypes.c_char.from_buffer(flat)
        address = ctypes.addressof(char)
        del char  # the export ends with it
    return address


class ForeignRows:
    """``rows`` slots of ``row_stride`` bytes in memory another engine owns (zero-copy).

    Slot ``i`` is ``buffer[i * row_stride:(i + 1) * row_stride]``. kvtier
    reads into and writes from the slots directly (O_DIRECT included), so
    the buffer's address and the stride must be multiples of ``alignment``.

    Parameters
    ----------
    buffer
        The engine's buffer: writable, C-contiguous, at least ``rows *
        row_stride`` bytes (vLLM 0.33's ``primary_kv_view``).
    row_stride
        Bytes from one slot to the next: one block.
    alignment
        What the address and the stride must be multiples of (a power of two).

    Raises
    ------
    InvalidArgumentError
        A read-only, non-contiguous or too small buffer, or a stride below one byte.
    AlignmentError
        The address or the stride is not a multiple of ``alignment``.
    """

    def __init__(self, buffer: memoryview, row_stride: int, *, alignment: int = 4096) -> None:
        if not buffer.c_contiguous:
            raise InvalidArgumentError("the engine's buffer must be C-contiguous")
        if isinstance(row_stride, bool) or operator.index(row_stride) < 1:
            raise InvalidArgumentError(f"row_stride must be a positive int, got {row_stride!r}")
        if alignment < 1 or alignment & (alignment - 1):
            raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
        flat = buffer.cast("B")  # a view of our own (release() must not end the engine's)
        address = address_of(flat)
        if address % alignment or row_stride % alignment:
            flat.release()
            raise AlignmentError(address, row_stride, alignment)
        self.rows = flat.nbytes // row_stride
        if not self.rows:
            flat.release()
            raise InvalidArgumentError(
                f"the engine's buffer of {buffer.nbytes} bytes holds no {row_stride}-byte slot"
            )
        self.row_stride = row_stride
        self.slice_bytes = row_stride
        self.world_size = 1
        self.alignment = alignment
        self.address = address
        """The address of slot 0."""
        self._flat: memoryview | None = flat
        self._slots: list[memoryview] | None = None

    def row(self, i: int) -> memoryview:
        """Slot ``i`` as a writable view (made once per slot, then reused)."""
        slots = self._slots
        if slots is None:
            flat = self._view()
            stride = self.row_stride
            slots = self._slots = [flat[j * stride : (j + 1) * stride] for j in range(self.rows)]
        try:
            index = operator.index(i)
        except TypeError:
            index = -1
        if isinstance(i, bool) or not 0 <= index < self.rows:
            raise InvalidArgumentError(f"slot index must be an int in [0, {self.rows}), got {i!r}")
        return slots[index]

    def buffer(self) -> memoryview:
        """Every slot as one writable view (what a file tier registers)."""
        return self._view()[: self.rows * self.row_stride]

    def release(self) -> None:
        """Release every view of the engine's buffer made here (idempotent): the engine
        may unmap it then. Views handed out before stay valid only while the engine's
        mapping lives."""
        slots, self._slots = self._slots, None
        for view in slots or ():
            view.release()
        flat, self._flat = self._flat, None
        if flat is not None:
            flat.release()

    def _view(self) -> memoryview:
        if self._flat is None:
            raise ClosedError("the engine's buffer was released")
        return self._flat
