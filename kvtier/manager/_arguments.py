"""Checks of a residency manager's arguments: the keys of every call, and its construction.

Every call of :class:`~kvtier.manager.ResidencyManager` checks its keys with
:func:`check_keys` before it changes anything (a call that raises changes
nothing); the native manager checks its construction with
:func:`check_construction` too. They live here, apart from the manager, because
they are the part of each call that only raises: the manager's module keeps the
state changes. :func:`check_keys` is one call per manager call, its loops in C.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError
from kvtier.manager.policies import ARCPolicy, CachePolicy, LRUPolicy

__all__ = ["check_construction", "check_keys", "make_policy"]

_BYTES_ONLY = frozenset({bytes})


def check_keys(keys: Sequence[bytes], what: str, *, distinct: bool = True) -> None:
    """Raise unless ``keys`` is a sequence of bytes keys, distinct unless told otherwise.

    Two passes in C: the type of every key (exactly ``bytes``: a ``memoryview``
    hashes and compares equal to the bytes it shows, so only the type keeps one
    out of the index and out of plans), then ``set``, which counts duplicates.
    A caller that detects duplicates on its own passes ``distinct=False`` and
    skips the ``set``.
    """
    if (
        type(keys) is not list
        and type(keys) is not tuple
        and (
            isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence)
        )
    ):
        raise InvalidArgumentError(f"{what}: keys must be a sequence of bytes, got {keys!r}")
    if not _BYTES_ONLY.issuperset(map(type, keys)):
        bad = next(k for k in keys if type(k) is not bytes)
        raise InvalidArgumentError(f"{what}: every key must be bytes, got {bad!r}")
    if distinct and len(set(keys)) != len(keys):
        raise InvalidArgumentError(f"{what}: duplicate keys in one call")


def check_construction(capacity_slots: object, tier: object) -> None:
    """Raise InvalidArgumentError unless the capacity is a positive int and the tier a str."""
    if (
        isinstance(capacity_slots, bool)
        or not isinstance(capacity_slots, int)
        or capacity_slots < 1
    ):
        raise InvalidArgumentError(f"capacity_slots must be a positive int, got {capacity_slots!r}")
    if not isinstance(tier, str):
        raise InvalidArgumentError(f"tier must be a str, got {tier!r}")


def make_policy(policy: str | CachePolicy) -> CachePolicy:
    """The policy a manager runs: the instance given, or a new one of the name given."""
    if isinstance(policy, CachePolicy):
        return policy
    if policy == "lru":
        return LRUPolicy()
    if policy == "arc":
        return ARCPolicy()
    raise InvalidArgumentError(
        f"policy must be 'lru', 'arc' or a CachePolicy instance, got {policy!r}"
    )
