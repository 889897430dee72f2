"""``kvtier inspect``: what a file tier root holds, read without opening the tier.

Reading is safe while a tier has the root open: block files are immutable once
renamed into place, and nothing here writes, renames or takes the tier's lock.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError, TierIOError
from kvtier.tiers._format import HEADER_BYTES, HeaderError, checksum, decode_header

__all__ = ["BadFile", "NamespaceReport", "inspect_root"]

_READ_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class BadFile:
    """A block file that fails verification."""

    path: str
    """Path of the file."""
    reason: str
    """Why it fails."""


@dataclass(slots=True)
class NamespaceReport:
    """What one namespace directory of a root holds."""

    namespace: str
    """The namespace (directory name, 32 hex characters)."""
    description: dict[str, Any] | None
    """Contents of ``namespace.json`` (None when missing or unreadable)."""
    blocks: int = 0
    """Block files in ``blocks/``."""
    bytes: int = 0
    """Bytes of those files on disk (``st_size``)."""
    temporaries: int = 0
    """Files in ``tmp/`` (interrupted writes or recycled spares)."""
    quarantined: int = 0
    """Files in ``quarantine/``."""
    strays: int = 0
    """Entries in ``blocks/`` that are not regular files named like a key."""
    verified: int = 0
    """Block files whose header and payload checksum were checked and good."""
    bad: list[BadFile] = field(default_factory=list)
    """Files failing verification (only with ``verify=True``)."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able summary."""
        desc = self.description or {}
        layout = desc.get("layout") or {}
        return {
            "namespace": self.namespace,
            "model_id": layout.get("model_id"),
            "block_bytes": desc.get("block_bytes"),
            "blocks": self.blocks,
            "bytes": self.bytes,
            "temporaries": self.temporaries,
            "quarantined": self.quarantined,
            "strays": self.strays,
            "verified": self.verified,
            "bad": [{"path": b.path, "reason": b.reason} for b in self.bad],
            "layout": layout,
        }


def inspect_root(root: Path, *, verify: bool = False) -> list[NamespaceReport]:
    """Describe every namespace under a file tier root.

    Parameters
    ----------
    root
        The ``root`` of a :class:`~kvtier.config.FileTierConfig`.
    verify
        Also read every block file and check its header, its key (against its
        name), its namespace (against its directory) and its payload checksum.

    Returns
    -------
    list[NamespaceReport]
        One per namespace directory, sorted by name.

    Raises
    ------
    InvalidArgumentError
        When ``root`` does not exist or is not a directory.
    TierIOError
        When ``root`` cannot be listed.
    """
    try:
        st = os.stat(root, follow_symlinks=False)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{root} does not exist") from None
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot stat the root: {exc.strerror}", root) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgumentError(f"{root} is not a directory")
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise TierIOError(exc.errno or 0, f"cannot list the root: {exc.strerror}", root) from exc
    reports = []
    for name in names:
        ns_dir = root / name
        if len(name) != 32 or not _is_hex(name) or not ns_dir.is_dir() or ns_dir.is_symlink():
            continue
        reports.append(_inspect_namespace(ns_dir, verify))
    return reports


def _inspect_namespace(ns_dir: Path, verify: bool) -> NamespaceReport:
    report = NamespaceReport(ns_dir.name, _read_description(ns_dir / "namespace.json"))
    report.temporaries = _count(ns_dir / "tmp")
    report.quarantined = _count(ns_dir / "quarantine")
    blocks = ns_dir / "blocks"
    expected = None
    if report.description is not None:
        expected = report.description.get("file_bytes")
    for fan in sorted(_list(blocks)):
        fan_dir = blocks / fan
        if not fan_dir.is_dir() or fan_dir.is_symlink():
            report.strays += 1
            continue
        for entry in sorted(_list(fan_dir)):
            path = fan_dir / entry
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue  # evicted while we looked
            if not stat.S_ISREG(st.st_mode) or len(entry) != 32 or not _is_hex(entry):
                report.strays += 1
                continue
            report.blocks += 1
            report.bytes += st.st_size
            if verify:
                reason = _verify(path, entry, ns_dir.name, expected)
                if reason is None:
                    report.verified += 1
                else:
                    report.bad.append(BadFile(str(path), reason))
    return report


def _verify(path: Path, key_hex: str, namespace: str, file_bytes: int | None) -> str | None:
    """Why the block file at ``path`` is bad, or None when it verifies."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None  # evicted while we looked: nothing to serve, nothing wrong
    except OSError as exc:
        return f"cannot open: {exc.strerror}"
    try:
        size = os.fstat(fd).st_size
        if file_bytes is not None and size != file_bytes:
            return f"size {size} is not the namespace's {file_bytes} bytes"
        head = os.pread(fd, HEADER_BYTES, 0)
        try:
            header = decode_header(memoryview(head))
        except HeaderError as exc:
            return f"bad header: {exc}"
        if header.key.hex() != key_hex:
            return f"header names key {header.key.hex()}, not the file's name"
        if header.namespace.hex() != namespace:
            return f"header namespace {header.namespace.hex()} is not the directory's"
        if size != HEADER_BYTES + header.payload_bytes:
            return f"truncated: {size} bytes for a {header.payload_bytes}-byte payload"
        payload = bytearray(header.payload_bytes)
        view = memoryview(payload)
        pos = 0
        while pos < len(payload):
            got = os.preadv(fd, [view[pos : pos + _READ_CHUNK]], HEADER_BYTES + pos)
            if got == 0:
                return "truncated while reading"
            pos += got
        if checksum(view) != header.payload_checksum:
            return "payload checksum mismatch"
        return None
    except OSError as exc:
        return f"read failed: {exc.strerror}"
    finally:
        os.close(fd)


def _read_description(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            data = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _list(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _count(path: Path) -> int:
    return len(_list(path))


def _is_hex(name: str) -> bool:
    return all(c in "0123456789abcdef" for c in name)
