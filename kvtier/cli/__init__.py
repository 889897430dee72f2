"""The ``kvtier`` command: ``demo``, ``bench``, ``inspect`` and ``gc``.

Exit status: 0 success; 1 the command ran and its check failed (a wrong demo
answer, a damaged block or host segment found by ``inspect``, a ``gc`` target
out of reach);
2 it could not run as asked (a bad argument, a missing directory, a system
error), said in one line on stderr; 130 interrupted.
"""

from __future__ import annotations

from kvtier.cli._main import main

__all__ = ["main"]
