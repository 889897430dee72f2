"""Stable chained block keys.

A key names one offloaded block of tokens *in its context*: it digests the parent
block's key, the block's token ids and the namespace (the layout fingerprint), so
equal keys mean equal prefixes under an identical model and layout. Keys are
BLAKE2b digests, identical across processes and machines (never Python's
``hash()``, which is salted per process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvtier.errors import InvalidArgumentError

__all__ = ["KEY_BYTES", "chain_keys", "check_keys"]

KEY_BYTES = 16
"""Length of every block key in bytes."""

_PERSON = b"kvtier.key.v1"
_ROOT_PARENT = bytes(KEY_BYTES)


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    namespace: bytes,
    parent: bytes | None = None,
) -> list[bytes]:
    """Return one key per full block of ``block_tokens`` tokens.

    Parameters
    ----------
    token_ids
        The token ids of the sequence, from its start (or from the block after
        ``parent``). Non-negative integers below 2**63.
    block_tokens
        Tokens per offloaded block (``Engine.block_tokens``).
    namespace
        The layout namespace (``KVLayout.namespace``); keys of different
        namespaces never collide.
    parent
        Key of the block preceding ``token_ids``, to continue a chain.

    Returns
    -------
    list[bytes]
        ``len(token_ids) // block_tokens`` keys of :data:`KEY_BYTES` bytes; a
        partial trailing block gets no key.

    Raises
    ------
    InvalidArgumentError
        For a non-positive ``block_tokens``, an empty or non-bytes namespace, a
        parent of the wrong length, or token ids that are not non-negative integers.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgumentError(f"block_tokens must be a positive int, got {block_tokens!r}")
    if not isinstance(namespace, bytes) or not namespace:
        raise InvalidArgumentError("namespace must be non-empty bytes (KVLayout.namespace)")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
        raise InvalidArgumentError(f"parent must be a {KEY_BYTES}-byte key, got {parent!r}")
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"token_ids must be integers: {exc}") from exc
    if tokens.size == 0:
        return []
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"token_ids must be a flat sequence of integers, got dtype {tokens.dtype} "
            f"and shape {tokens.shape}"
        )
    if tokens.dtype.kind == "i" and int(tokens.min()) < 0:
        raise InvalidArgumentError("token_ids must be non-negative")
    if tokens.dtype.kind == "u" and int(tokens.max()) >= 2**63:
        raise InvalidArgumentError("token_ids must be below 2**63")
    # One fixed byte form (little-endian int64) so keys match on any machine.
    raw = tokens.astype("<i8", copy=False).tobytes()
    stride = block_tokens * 8
    seed = hashlib.blake2b(namespace, digest_size=KEY_BYTES, person=_PERSON)
    keys: list[bytes] = []
    prev = _ROOT_PARENT if parent is None else parent
    for start in range(0, (len(tokens) // block_tokens) * stride, stride):
        h = seed.copy()
        h.update(prev)
        h.update(raw[start : start + stride])
        prev = h.digest()
        keys.append(prev)
    return keys


def check_keys(keys: Sequence[bytes], *, what: str = "keys") -> None:
    """Raise unless ``keys`` is a sequence of distinct :data:`KEY_BYTES`-byte keys.

    Raises
    ------
    InvalidArgumentError
        For a non-sequence, a key that is not bytes of the right length, or a
        key that appears twice.
    """
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(f"{what} must be a sequence of bytes keys, got {type(keys)}")
    for k in keys:
        if type(k) is not bytes or len(k) != KEY_BYTES:
            raise InvalidArgumentError(f"{what}: every key must be {KEY_BYTES} bytes, got {k!r}")
    if len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"{what}: duplicate keys in one call")
