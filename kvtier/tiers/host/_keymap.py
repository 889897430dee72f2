"""Private: :class:`KeyMap`, which rows of the segment hold which key, as one instance knows it.

Every instance keeps its own map of the whole segment, folded from the row
table's seq words (:meth:`KeyMap.refresh`: no syscall, no lock) and from its own
stores and evictions as it makes them. It is apart from the tier because it is
about every instance's rows, where the tier's own bookkeeping (least recently
used order, free rows) is about its own; the tier reads :attr:`KeyMap.where`
and :attr:`KeyMap.row_key` directly on its per-block paths.
"""

from __future__ import annotations

import contextlib

import numpy as np
import numpy.typing as npt

from kvtier.tiers.host._table import Table

__all__ = ["KeyMap"]


class KeyMap:
    """Key -> the rows holding it, row -> its key, and the changes since they were last taken."""

    def __init__(self, table: Table, rows: int) -> None:
        self._table = table
        self.where: dict[bytes, list[int]] = {}
        """Each key held, with its rows (this instance's first when it wrote one)."""
        self.row_key: list[bytes | None] = [None] * rows
        """Each row's key as last folded (None: it holds nothing)."""
        self._seen: npt.NDArray[np.uint64] = np.zeros(rows, dtype=np.uint64)
        self._changes: dict[bytes, bool] = {}
        """Keys that came to be held on the host (True) or stopped being so
        (False) since :meth:`take_changes`."""

    def refresh(self) -> int:
        """Fold what every instance changed in the row table; return the rows folded."""
        changed = self._table.changes(self._seen)
        row_key = self.row_key
        for row, key, _settled in changed:
            old = row_key[row]
            if old == key:
                continue
            if old is not None:
                self._unplace(old, row)
            row_key[row] = key
            if key is not None:
                self._place(key, row, first=False)
        return len(changed)

    def stored(self, row: int, key: bytes, seq: int) -> None:
        """This instance wrote ``key`` in ``row``, now at ``seq`` (readers find it first)."""
        self._seen[row] = seq
        self.row_key[row] = key
        self._place(key, row, first=True)

    def emptied(self, row: int, seq: int) -> None:
        """This instance's ``row`` holds nothing now, at ``seq``."""
        self._seen[row] = seq
        self.forget(row)

    def forget(self, row: int) -> None:
        """``row`` no longer holds the key it held (its seq not folded yet)."""
        old = self.row_key[row]
        if old is not None:
            self._unplace(old, row)
            self.row_key[row] = None

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """``(added, removed)``: keys whose last change since the previous call was to
        come to be held, or to stop being held, and which the map still agrees with."""
        changes, self._changes = self._changes, {}
        where = self.where
        added = [k for k, there in changes.items() if there and k in where]
        removed = [k for k, there in changes.items() if not there and k not in where]
        return added, removed

    def _place(self, key: bytes, row: int, *, first: bool) -> None:
        rows = self.where.get(key)
        if rows is None:
            self.where[key] = [row]
            self._changes[key] = True
        elif first:
            rows.insert(0, row)
        else:
            rows.append(row)

    def _unplace(self, key: bytes, row: int) -> None:
        rows = self.where.get(key)
        if rows is None:
            return
        with contextlib.suppress(ValueError):
            rows.remove(row)
        if not rows:
            del self.where[key]
            self._changes[key] = False
