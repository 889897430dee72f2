"""What makes a model's KV cache compatible: its identity, not the path it was loaded from.

vLLM names a model by whatever the user typed: a hub id, a local directory,
a symlink to one, another mount of the same disk. Two names for the same
weights must share a namespace (or a restart through a symlink finds nothing
and, with ``reclaim="lru"``, removes the cache it should have used), and two
different weights under one name (a directory refreshed in place) must not.

No vLLM import here: the main test suite checks it without vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SAMPLE_BYTES", "WEIGHT_SUFFIXES", "model_identity"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
"""Files taken as weights in a model directory."""

SAMPLE_BYTES = 1 << 20
"""Bytes read at the start, the middle and the end of each weight file."""

_CONFIG = "config.json"


def model_identity(name: str, revision: str | None = None) -> dict[str, Any]:
    """The identity of the model vLLM loaded as ``name``, for the namespace's fingerprint.

    Parameters
    ----------
    name
        vLLM's model: a local directory, or a hub id.
    revision
        A name for these weights that the user gives (``model_revision`` in
        ``kv_connector_extra_config``: a hub commit, a release tag). When set
        it is the identity, and no file is read.

    Returns
    -------
    dict
        JSON-serialisable; equal for equal identities.

    Notes
    -----
    A directory (or a hub id found in the local hub cache) is identified by
    its ``config.json`` (parsed, so formatting does not count) and, for each
    weight file (:data:`WEIGHT_SUFFIXES`, by path inside the directory), its
    size and a digest of :data:`SAMPLE_BYTES` at its start, middle and end:
    what a fine-tune changes, read in milliseconds from the page cache that
    vLLM's load just filled, where hashing whole multi-GB files would delay
    every start by seconds. Weights that differ only outside those samples
    and have the same sizes would share a namespace; name a ``revision`` to
    tell such weights apart. A hub id with no local copy is identified by the
    id itself.
    """
    if revision is not None:
        return {"revision": revision}
    where = _local_dir(name)
    if where is None:
        return {"name": name}
    config: Any = None
    cfg = where / _CONFIG
    if cfg.is_file():
        try:
            config = json.loads(cfg.read_text())
        except (OSError, ValueError):
            config = hashlib.blake2b(cfg.read_bytes(), digest_size=16).hexdigest()
    weights = []
    for path in sorted(where.rglob("*")):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            weights.append([path.relative_to(where).as_posix(), *_sample(path)])
    if config is None and not weights:
        return {"name": name}  # nothing to fingerprint: a directory of another kind
    return {"config": config, "weights": weights}


def _local_dir(name: str) -> Path | None:
    """The directory holding ``name``'s files: itself, or its copy in the hub cache."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import try_to_load_from_cache  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, _CONFIG)
    except Exception:  # a name that is not a hub id: identified by itself
        return None
    return Path(found).parent if isinstance(found, str) else None


def _sample(path: Path) -> tuple[int, str]:
    """Size and digest of the start, middle and end of ``path``."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            fh.seek(at)
            h.update(fh.read(SAMPLE_BYTES))
    return size, h.hexdigest()
