"""Which of kvtier's compiled parts are in use, and what runs instead of a missing one.

kvtier builds five small C extensions at install (``setup.py``). Each is
optional: where one cannot be built (no C compiler), ``pip install`` still
succeeds and kvtier runs a pure-Python equivalent, which gives the same bytes
and the same answers, only slower. This module says which are in use:
``kvtier --version`` and ``kvtier bench`` print :func:`describe`, and
:func:`warn_if_missing` warns once per process when one is missing.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from dataclasses import dataclass
from functools import cache

__all__ = [
    "EXTENSIONS",
    "ExtensionStatus",
    "NativeExtensionWarning",
    "describe",
    "missing",
    "status",
    "warn_if_missing",
]

_log = logging.getLogger("kvtier.native")


class NativeExtensionWarning(RuntimeWarning):
    """A compiled part of kvtier is not built: its pure-Python equivalent runs, slower."""


@dataclass(frozen=True, slots=True)
class Extension:
    """One compiled part: what it does, and what runs when it is missing."""

    module: str
    """Its import name, e.g. ``kvtier.manager._native``."""
    does: str
    """What it does, in a few words."""
    fallback: str
    """What runs instead when it is missing, and what that costs."""


EXTENSIONS: tuple[Extension, ...] = (
    Extension(
        "kvtier.manager._native",
        "the residency manager's state and LRU/ARC policies",
        "the pure-Python manager: 1.7-3.8 us a key at 1M slots instead of under 1 us",
    ),
    Extension(
        "kvtier.transfer._address",
        "buffer addresses and io_uring request loops of the file tier",
        "ctypes/NumPy addresses and a Python loop: a few us more per file tier I/O request",
    ),
    Extension(
        "kvtier.transfer._copy",
        "the device transfers' copy loops (memcpy, CUDA runtime)",
        "a Python loop of one copy per piece: a few us of Python per piece of a KV row",
    ),
    Extension(
        "kvtier.transfer._gather",
        "the CUDA gather kernel (one launch per round of pieces)",
        "torch indexing kernels: about 1.5 ms of Python per round, with a GPU only",
    ),
    Extension(
        "kvtier.tiers._blocks",
        "the tiers' block headers and XXH3 checksums",
        "Python struct packing and the xxhash module: more CPU per block than its read",
    ),
)
"""Every C extension ``setup.py`` builds, in its order."""


@dataclass(frozen=True, slots=True)
class ExtensionStatus:
    """Whether one compiled part imports here."""

    extension: Extension
    available: bool
    """It imported."""
    error: str | None
    """Why it did not import (None when it did)."""
    note: str | None = None
    """A remark on its use (for instance, an environment variable that turns it off)."""


@cache
def status() -> tuple[ExtensionStatus, ...]:
    """Import each extension once; whether it is available, and why not."""
    out = []
    for ext in EXTENSIONS:
        try:
            importlib.import_module(ext.module)
        except ImportError as exc:
            out.append(ExtensionStatus(ext, False, str(exc) or type(exc).__name__))
            continue
        note = None
        if ext.module == "kvtier.manager._native" and os.environ.get("KVTIER_MANAGER") == "python":
            note = "built, but KVTIER_MANAGER=python selects the pure-Python manager"
        out.append(ExtensionStatus(ext, True, None, note))
    return tuple(out)


def missing() -> list[ExtensionStatus]:
    """The extensions that do not import."""
    return [s for s in status() if not s.available]


def describe(*, every: bool = True) -> list[str]:
    """Lines that say which compiled parts are in use and what a missing one costs.

    Without ``every``, the summary line and the missing parts only.
    """
    parts = status()
    gone = [s for s in parts if not s.available]
    lines = [
        f"compiled parts: {len(parts) - len(gone)} of {len(parts)} in use"
        + ("" if not gone else "; the others run pure-Python equivalents, slower")
    ]
    for s in parts:
        if s.available and not every:
            continue
        if s.available:
            lines.append(f"  {s.extension.module}: in use; {s.extension.does}")
            if s.note:
                lines.append(f"    note: {s.note}")
        else:
            lines.append(f"  {s.extension.module}: MISSING; {s.extension.does}")
            lines.append(f"    instead: {s.extension.fallback}")
            lines.append(f"    import error: {s.error}")
    if gone:
        lines.append(
            "  to build them: install a C compiler and Python's headers (e.g. apt-get install "
            "gcc python3-dev), then reinstall kvtier"
        )
    return lines


_warned = False


def warn_if_missing(*, python_warning: bool = True) -> bool:
    """Warn once per process when a compiled part is missing; whether one is.

    The warning goes to the ``kvtier.native`` logger at WARNING, and, with
    ``python_warning``, through :func:`warnings.warn` as a
    :class:`NativeExtensionWarning` (a command line that configures logging
    passes False, so that it is not said twice).
    """
    global _warned
    gone = missing()
    if gone and not _warned:
        _warned = True
        text = (
            f"{len(gone)} of {len(EXTENSIONS)} compiled parts of kvtier are not built "
            "(no C compiler at install?), so slower pure-Python code runs instead: "
            + "; ".join(f"{s.extension.module} -> {s.extension.fallback}" for s in gone)
            + ". `kvtier --version` lists them."
        )
        _log.warning("%s", text)
        if python_warning:
            warnings.warn(text, NativeExtensionWarning, stacklevel=2)
    return bool(gone)
