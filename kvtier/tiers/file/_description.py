"""``namespace.json``: the description of a file tier namespace, written and read back.

A namespace directory's ``namespace.json`` is written by the tier the first
time it opens the directory and read back by every later open, by ``kvtier
inspect``, and by the root's accounting (which needs the slot size of every
namespace, and only removes directories whose description is kvtier's own).
Whatever it holds was on disk, so it is validated field by field here, in one
place, before any of them trusts it: a JSON list, a string, a field of the
wrong type, a missing field or a number out of range is a
:class:`~kvtier.errors.TierIOError` (``EUCLEAN``, "structure needs cleaning")
naming the file and the field, never an ``AttributeError`` or a
``TypeError`` from deep inside the caller.
"""

from __future__ import annotations

import errno as _errno
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import TierIOError
from kvtier.tiers.block_format import HEADER_BYTES

__all__ = [
    "DESCRIPTION_FILE",
    "FORMAT_NAME",
    "LAYOUT_KIND",
    "MAX_BLOCK_BYTES",
    "MAX_PARTITIONS",
    "TIER_FORMAT_VERSION",
    "Description",
    "is_namespace_name",
    "parse_description",
    "partition_dir_name",
    "read_description",
    "split_dir_name",
]

DESCRIPTION_FILE = "namespace.json"
FORMAT_NAME = "kvtier file tier"
"""``format`` of every ``namespace.json`` kvtier writes."""
TIER_FORMAT_VERSION = 2
"""Version of a namespace directory's layout (``namespace.json``): 2 is one
slot file; 1 was one file per block under ``blocks/`` (an open rewrites its
description and reuses the directory; what it left there is not read)."""
LAYOUT_KIND = "slots"
"""``layout_kind`` of ``namespace.json`` for :data:`TIER_FORMAT_VERSION`."""
MAX_BLOCK_BYTES = 1 << 40
"""Largest ``block_bytes`` read back: far above any CPU-region row, and small
enough that slot arithmetic on it cannot go astray."""
_MAX_TEXT = 1 << 20
"""Bytes of ``namespace.json`` read at the most: kvtier writes about 1 KiB."""


@dataclass(frozen=True, slots=True)
class Description:
    """The fields of a ``namespace.json`` that kvtier reads back, validated."""

    path: Path
    """The file read."""
    format_version: int
    """1 (one file per block, legacy) or 2 (one slot file); a newer version is
    refused by the reader (:func:`parse_description`)."""
    namespace: str
    """The namespace, 32 lowercase hex characters."""
    block_bytes: int | None
    """Payload bytes per block; None for version 1 (not read back)."""
    slot_bytes: int | None
    """Bytes per slot (header plus payload); None for version 1."""
    model_id: str | None
    """``layout.model_id``, when the layout names one."""
    raw: dict[str, Any]
    """The whole object as parsed (for display only: nothing reads it further)."""
    bytes_to_use: int | None = None
    """The root's budget the tier that last opened the directory was given
    (``FileTierConfig.bytes_to_use``); None when not recorded (written before
    it was)."""


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` is a namespace (32 lowercase hex)."""
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


MAX_PARTITIONS = 256
"""Partitions of one namespace on a root: live instances sharing it at once, at most."""


def partition_dir_name(namespace: str, partition: int) -> str:
    """The directory of ``partition`` of ``namespace``: the namespace, then ``.<n>`` past 0.

    Partition 0 keeps the plain name, so a root written before partitions
    existed is partition 0 of each of its namespaces.
    """
    return namespace if partition == 0 else f"{namespace}.{partition}"


def split_dir_name(name: str) -> tuple[str, int] | None:
    """``(namespace, partition)`` of a directory kvtier names, or None for any other name."""
    namespace, dot, number = name.partition(".")
    if not is_namespace_name(namespace):
        return None
    if not dot:
        return namespace, 0
    # One spelling per partition (no "01", no "0"), so that two names never
    # mean one partition.
    if not number.isdigit() or not number.isascii() or number[0] == "0":
        return None
    n = int(number)
    return (namespace, n) if n < MAX_PARTITIONS else None


def read_description(path: Path) -> Description | None:
    """Read and validate ``namespace.json``; None when the file does not exist.

    Parameters
    ----------
    path
        The file; opened with ``O_NOFOLLOW`` (a symlink is an error).

    Returns
    -------
    Description | None
        The validated fields, or None when there is no file.

    Raises
    ------
    TierIOError
        When the file cannot be read (its errno), is not JSON, or holds JSON
        of the wrong shape (``EUCLEAN``); the message names the field.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot open namespace.json: {exc.strerror}", path
        ) from exc
    try:
        with os.fdopen(fd, "rb") as fh:
            text = fh.read(_MAX_TEXT + 1)
    except OSError as exc:
        raise TierIOError(
            exc.errno or 0, f"cannot read namespace.json: {exc.strerror}", path
        ) from exc
    if len(text) > _MAX_TEXT:
        raise _bad(path, f"is larger than {_MAX_TEXT} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # ValueError covers bad UTF-8, bad JSON and integers past Python's digit limit.
        raise _bad(path, f"is not valid JSON ({exc})") from exc
    return parse_description(path, data)


def parse_description(path: Path, data: object) -> Description:
    """Validate parsed ``namespace.json`` contents (see :func:`read_description`).

    Raises
    ------
    TierIOError
        ``EUCLEAN``, naming ``path`` and the first field that is missing, of
        the wrong type or out of range.
    """
    if not isinstance(data, dict):
        raise _bad(path, f"holds a JSON {_kind(data)}, not an object")
    if data.get("format") != FORMAT_NAME:
        raise _field(path, "format", data.get("format"), f"is not {FORMAT_NAME!r}")
    version = _int(path, data, "format_version", 1, 1 << 16)
    if version > TIER_FORMAT_VERSION:
        raise _field(path, "format_version", version, "is newer than this kvtier reads")
    namespace = data.get("namespace")
    if not isinstance(namespace, str) or not is_namespace_name(namespace):
        raise _field(path, "namespace", namespace, "is not 32 lowercase hex characters")
    if version < TIER_FORMAT_VERSION:
        # A format 1 directory's description is rewritten by the tier that
        # opens it, and inspect does not read its blocks: nothing more of it
        # is read back.
        return Description(path, version, namespace, None, None, _model(path, data), data)
    block = _int(path, data, "block_bytes", 1, MAX_BLOCK_BYTES)
    header = data.get("header_bytes", HEADER_BYTES)
    if type(header) is not int or header != HEADER_BYTES:
        raise _field(path, "header_bytes", header, f"is not {HEADER_BYTES}")
    slot = _int(path, data, "slot_bytes", 1, MAX_BLOCK_BYTES + HEADER_BYTES)
    if slot != HEADER_BYTES + block:
        raise _field(path, "slot_bytes", slot, f"is not {HEADER_BYTES} + block_bytes ({block})")
    if data.get("layout_kind") != LAYOUT_KIND:
        raise _field(path, "layout_kind", data.get("layout_kind"), f"is not {LAYOUT_KIND!r}")
    budget = (
        None if data.get("bytes_to_use") is None else _int(path, data, "bytes_to_use", 1, 1 << 64)
    )
    return Description(path, version, namespace, block, slot, _model(path, data), data, budget)


def _model(path: Path, data: dict[str, Any]) -> str | None:
    layout = data.get("layout", {})
    if not isinstance(layout, dict):
        raise _field(path, "layout", layout, "is not an object")
    model = layout.get("model_id")
    if model is not None and not isinstance(model, str):
        raise _field(path, "layout.model_id", model, "is not a string")
    return model


def _int(path: Path, data: dict[str, Any], name: str, low: int, high: int) -> int:
    value = data.get(name)
    # bool is an int to Python but never a size or a version here.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _field(path, name, value, "is not an integer")
    if not low <= value <= high:
        raise _field(path, name, value, f"is out of range [{low}, {high}]")
    return value


def _field(path: Path, name: str, value: object, problem: str) -> TierIOError:
    shown = "missing" if value is None else _short(value)
    return _bad(path, f"field {name!r} {problem} (got {shown})")


def _bad(path: Path, problem: str) -> TierIOError:
    return TierIOError(_errno.EUCLEAN, f"namespace.json {problem}", path)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return "number"
