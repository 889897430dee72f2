"""Private: what every subcommand shares: the exit codes, argument types, checks."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.errors import InvalidArgumentError

__all__ = [
    "EXIT_CODES",
    "SHM_DIR",
    "check_directory",
    "parse_size",
    "parse_size_or_zero",
    "warn_native",
    "when",
]


EXIT_CODES = """exit status:
  0    success
  1    the command ran and its check failed: a demo answer differs from the
       recompute, inspect found a damaged block or host segment, gc could not
       reach --keep-bytes
  2    it could not run as asked: a bad argument, a missing directory, a
       system error (one line on stderr; -v logs more)
  130  interrupted (Ctrl-C)"""
"""The exit codes, as ``--help`` prints them."""


SHM_DIR = "/dev/shm"
"""Where ``--shm`` looks without a DIR (the host tier's default ``directory``)."""


def check_directory(path: Path | None, flag: str) -> None:
    """Refuse ``flag``'s ``path`` unless it is an existing directory."""
    if path is None:
        return
    if not path.exists():
        raise InvalidArgumentError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: not a directory")


def parse_size(text: str) -> int:
    """A byte size from the command line: ``2MiB``, ``256KiB``, ``4096``."""
    from pydantic import TypeAdapter, ValidationError

    from kvtier.config import Bytes  # the configuration's rule: 2M is 2 MiB

    try:
        return int(TypeAdapter(Bytes).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 2MiB)") from None


def parse_size_or_zero(text: str) -> int:
    """A byte size that may be 0 (``gc --keep-bytes 0``: down to nothing), by the same rule."""
    from kvtier.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} ({exc})") from None


def warn_native() -> None:
    """Say once, before the work starts, which compiled parts are missing (if any)."""
    from kvtier._native_status import warn_if_missing

    warn_if_missing(python_warning=False)  # logged: the command configures logging


def when(t: float | None) -> str:
    import time

    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
