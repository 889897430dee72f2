"""Private, transitional: :mod:`kvtier.shm` under its old name, until every import moves."""

from kvtier.shm import acquire, allocate, create_or_join, held_by_others, release, set_lock

__all__ = ["acquire", "allocate", "create_or_join", "held_by_others", "release", "set_lock"]
