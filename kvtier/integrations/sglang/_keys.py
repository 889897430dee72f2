"""SGLang's page keys in kvtier's terms: one function, one place (no SGLang import)."""

from __future__ import annotations

import hashlib
import re

__all__ = ["page_key"]

_PERSON = b"kvtier.sglang"

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def page_key(key: object, namespace: bytes) -> bytes | None:
    """kvtier's 16-byte key for SGLang's page key ``key`` in ``namespace``; None when
    ``key`` is not what SGLang 0.5 names a page with (64 hexadecimal characters: the
    SHA-256 of the page's tokens, chained page by page).

    The namespace (the layout's, :attr:`~kvtier.layout.KVLayout.namespace`) keys the
    hash: two models, dtypes, host layouts, page sizes or shards sharing a tier
    never hit each other's pages.
    """
    if not isinstance(key, str) or not _HEX64.fullmatch(key):
        return None
    h = hashlib.blake2b(bytes.fromhex(key), digest_size=16, key=namespace, person=_PERSON)
    return h.digest()
