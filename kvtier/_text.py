"""Text helpers of the ``kvtier`` command and the demo: widths, sizes, plurals, fitting tables.

A table that does not fit the terminal is printed as one block per row, its
cells as ``name: value`` pairs, so that no cell is ever cut (a namespace is 64
hex digits, a model id can be longer than a narrow terminal's line).
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

__all__ = ["fit_table", "human_bytes", "make_console", "output_width", "plural"]

PIPE_WIDTH = 160
"""Columns laid out for a pipe or a file when ``$COLUMNS`` does not say."""


def output_width(fallback: int = PIPE_WIDTH) -> int:
    """The columns to lay out for standard output.

    ``$COLUMNS`` when set, else the terminal's width, else ``fallback`` (a pipe
    or a file: lines are not folded there, so tables are not squeezed).
    """
    if sys.stdout.isatty():
        return shutil.get_terminal_size((fallback, 24)).columns
    # Not a terminal: shutil would measure the terminal of sys.__stdout__, which
    # is not where this output goes; only $COLUMNS speaks for it.
    columns = os.environ.get("COLUMNS", "").strip()
    return int(columns) if columns.isdigit() and int(columns) > 0 else fallback


def make_console(fallback: int = PIPE_WIDTH, *, stderr: bool = False) -> Console:
    """A rich console as wide as :func:`output_width` says."""
    from rich.console import Console

    return Console(width=output_width(fallback), stderr=stderr)


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB, whichever keeps the number readable."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:,.1f} TiB"


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 namespace``, ``2 namespaces``."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def _needed(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    """Per column, the least width that cuts nothing: every cell whole, headers
    folded at their spaces."""
    widths = []
    for i, header in enumerate(columns):
        cells = [len(r[i]) for r in rows]
        words = [len(w) for w in header.split()] or [0]
        widths.append(max([*cells, *words]))
    return widths


def _widths(
    columns: Sequence[str], rows: Sequence[Sequence[str]], needed: list[int], room: int
) -> list[int]:
    """Column widths within ``room``, at least ``needed``: the room left widens the
    headers folded into the most lines first, one line less at a time."""
    widths = list(needed)
    spare = room - sum(widths)
    while True:
        best: tuple[int, int, int] | None = None  # (lines, -cost, column)
        for i, header in enumerate(columns):
            lines = len(textwrap.wrap(header, widths[i], break_long_words=False))
            if lines <= 1:
                continue
            cost = _folded(header, lines - 1) - widths[i]
            if cost <= spare and (best is None or (lines, -cost) > best[:2]):
                best = (lines, -cost, i)
        if best is None:
            return widths
        _, cost, i = best
        widths[i] -= cost
        spare += cost


def _folded(header: str, lines: int) -> int:
    """The narrowest width that folds ``header`` at its spaces into ``lines`` lines."""
    width = max((len(w) for w in header.split()), default=0)
    while len(textwrap.wrap(header, width, break_long_words=False)) > lines:
        width += 1
    return width


def fit_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    left: Collection[str] = (),
    caption: str | None = None,
    own_line: Collection[str] = (),
    name_heading: bool = True,
) -> RenderableType:
    """A rich table of ``rows`` when it fits in ``width`` columns uncut, else blocks.

    Parameters
    ----------
    left
        Columns aligned left (the others right).
    caption
        Printed under the table, or under the blocks.
    own_line
        Columns that get a line of their own in a block (the others are packed
        into lines of ``width``, separated by semicolons).
    name_heading
        Whether a block's heading names the first column (``namespace: ...``)
        or is the first cell alone.
    """
    from rich.table import Table
    from rich.text import Text

    needed = _needed(columns, rows)
    room = width - 3 * len(columns) - 1  # each cell's padding and border, and the last border
    if sum(needed) <= room:
        widths = _widths(columns, rows, needed, room)
        table = Table(title=title, caption=caption)
        for col, w in zip(columns, widths, strict=True):
            table.add_column(col, justify="left" if col in left else "right", width=w)
        for row in rows:
            table.add_row(*row)
        return table
    lines = textwrap.wrap(title, width) or [""]
    for row in rows:
        lines.append("")
        head = f"{columns[0]}: {row[0]}" if name_heading and columns[0] else row[0]
        lines.append(head)
        line = ""
        for col, cell in zip(columns[1:], row[1:], strict=True):
            pair = f"{col}: {cell}"
            if col in own_line:
                if line:
                    lines.append(line)
                lines.append(f"  {pair}")
                line = ""
            elif not line:
                line = f"  {pair}"
            elif len(line) + 2 + len(pair) <= width:
                line += f"; {pair}"
            else:
                lines.append(line)
                line = f"  {pair}"
        if line:
            lines.append(line)
    if caption:
        lines += ["", *textwrap.wrap(caption, width)]
    return Text("\n".join([*lines, ""]))
