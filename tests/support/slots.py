"""Finding blocks in a file tier's ``blocks.dat`` from outside the tier, for tests.

Tests that damage stored blocks on purpose (a flipped byte, a planted header)
need to know where a key lives without reaching into a tier's internals; these
helpers read ``namespace.json`` and the slot headers the way ``kvtier
inspect`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvtier.tiers.block_format import HEADER_BYTES, HeaderError, decode_header

__all__ = ["block_offsets", "find_block", "slot_bytes"]


def slot_bytes(ns_dir: Path) -> int:
    """Bytes per slot of the namespace directory ``ns_dir`` (from its ``namespace.json``)."""
    desc = json.loads((ns_dir / "namespace.json").read_text())
    return int(desc["slot_bytes"])


def block_offsets(ns_dir: Path) -> dict[bytes, int]:
    """Byte offset in ``blocks.dat`` of every block whose header decodes, by key.

    A key found in two slots (an evicted copy not yet overwritten) maps to the
    newer one, as the tier's recovery would choose.
    """
    size = slot_bytes(ns_dir)
    out: dict[bytes, tuple[int, int]] = {}
    fd = os.open(ns_dir / "blocks.dat", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size
        for offset in range(0, end - size + 1, size):
            try:
                header = decode_header(memoryview(os.pread(fd, HEADER_BYTES, offset)))
            except HeaderError:
                continue
            prev = out.get(header.key)
            if prev is None or prev[0] < header.stored_at:
                out[header.key] = (header.stored_at, offset)
    finally:
        os.close(fd)
    return {key: offset for key, (_, offset) in out.items()}


def find_block(root: Path, key: bytes) -> tuple[Path, int]:
    """The ``blocks.dat`` under ``root`` holding ``key``, and the block's byte offset.

    Raises
    ------
    LookupError
        When no namespace under ``root`` holds the key.
    """
    for data in sorted(root.glob("*/blocks.dat")):
        offset = block_offsets(data.parent).get(key)
        if offset is not None:
            return data, offset
    raise LookupError(f"no block {key.hex()} under {root}")
