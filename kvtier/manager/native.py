"""The residency manager with its state and its LRU / ARC policy in C.

:class:`ResidencyManager` returns a :class:`NativeResidencyManager` for the
built-in policies (``"lru"``, ``"arc"``) when the compiled core
(``kvtier.manager._native``, built from ``_native.c`` at install) imports; a
:class:`~kvtier.manager.CachePolicy` instance, ``native=False`` or the
environment variable ``KVTIER_MANAGER=python`` give the pure-Python manager.
This module makes that choice and registers it with
:func:`kvtier.manager.residency.register_variant` when imported (``kvtier.manager``
imports it): the Python manager, which this one subclasses, never imports it.
Both behave alike call for call: the same plans, slots, victims, errors and
events; the conformance suite, the Hypothesis state machine and the policy
scenarios run against both.

Why a compiled core: the pure-Python manager costs 1.7-3.8 us per requested key
at 1M slots, mostly interpreter work per key and cold dict probes, and no
change in Python brought that under the 1 us target (``docs/manager.md``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal

from kvtier.errors import BlockNotFoundError, BusyError, InvalidArgumentError, ProtocolError
from kvtier.manager._arguments import check_construction
from kvtier.manager.events import BlockRemoved, BlockStored, ManagerEvent
from kvtier.manager.plans import LoadPlan, ManagerStatistics, StorePlan
from kvtier.manager.residency import ResidencyManager, register_variant

__all__ = ["NativePolicy", "NativeResidencyManager", "native_available", "native_wanted"]

_log = logging.getLogger(__name__)

_Core: type[_native.Core] | None
try:
    # The compiled module whole, never a name from it: grimp reads .py files
    # only, and would take a name from a module it cannot see for an import of
    # the root package (tests/test_architecture.py says more).
    from kvtier.manager import _native
except ImportError as exc:  # not built (no compiler at install): the Python manager serves
    _Core = None
    _IMPORT_ERROR: str | None = str(exc)
else:
    _Core = _native.Core
    _native.set_errors(InvalidArgumentError, ProtocolError, BlockNotFoundError, BusyError)
    _IMPORT_ERROR = None

_EMPTY_PLAN = StorePlan((), (), (), ())


def native_available() -> bool:
    """Whether the compiled core imported (it is built with the package)."""
    return _Core is not None


def native_wanted(policy: object, native: bool | None) -> bool:
    """Whether :class:`ResidencyManager` should build a :class:`NativeResidencyManager`.

    Raises
    ------
    InvalidArgumentError
        For ``native=True`` with a policy instance, or when the compiled core
        is missing.
    """
    builtin = isinstance(policy, str) and policy in ("lru", "arc")
    if native is None:
        return builtin and _Core is not None and os.environ.get("KVTIER_MANAGER") != "python"
    if native is not True and native is not False:
        raise InvalidArgumentError(f"native must be None, True or False, got {native!r}")
    if not native:
        return False
    if not builtin:
        raise InvalidArgumentError(
            f"native=True runs the built-in policies 'lru' and 'arc' only, got {policy!r}"
        )
    if _Core is None:
        raise InvalidArgumentError(f"native=True but the compiled core is missing: {_IMPORT_ERROR}")
    return True


def _as_list(keys: Sequence[bytes], what: str) -> list[bytes]:
    """Keys of a sequence other than list or tuple, as a list (the core takes those two)."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
        raise InvalidArgumentError(f"{what}: keys must be a sequence of bytes, got {keys!r}")
    return list(keys)


class NativePolicy:
    """Read-only view of the policy a :class:`NativeResidencyManager` runs in C.

    It offers the introspection of :class:`~kvtier.manager.LRUPolicy`
    (:attr:`size`) and :class:`~kvtier.manager.ARCPolicy` (:attr:`target`,
    the list sizes, :meth:`in_t2`); it is not a
    :class:`~kvtier.manager.CachePolicy` and plugs into no manager.
    """

    __slots__ = ("_core", "name")

    def __init__(self, core: _native.Core, name: Literal["lru", "arc"]) -> None:
        self._core = core
        self.name = name
        """``"lru"`` or ``"arc"``."""

    @property
    def size(self) -> int:
        """Blocks held (the ready ones)."""
        _, t1, t2, _, _ = self._core.policy_state()
        return t1 + t2

    @property
    def target(self) -> float:
        """ARC's ``p``: how many ready blocks T1 should hold (0 under LRU)."""
        return self._core.policy_state()[0]

    @property
    def t1_size(self) -> int:
        """ARC: blocks used once since they entered (LRU: every held block)."""
        return self._core.policy_state()[1]

    @property
    def t2_size(self) -> int:
        """ARC: blocks used at least twice (0 under LRU)."""
        return self._core.policy_state()[2]

    @property
    def b1_size(self) -> int:
        """ARC: ghosts of blocks evicted from T1."""
        return self._core.policy_state()[3]

    @property
    def b2_size(self) -> int:
        """ARC: ghosts of blocks evicted from T2."""
        return self._core.policy_state()[4]

    def in_t2(self, slot: int) -> bool:
        """Whether ``slot`` is in T2 (used again since it entered)."""
        return self._core.in_t2(slot)

    def order(self, which: Literal[1, 2] = 1) -> list[int]:
        """Slots of T1 (LRU: the one list) or T2, most recently used first."""
        return self._core.order(which)

    def __repr__(self) -> str:
        return f"<NativePolicy {self.name}>"


class NativeResidencyManager(ResidencyManager):
    """:class:`ResidencyManager` with its state and policy in C (see the module docstring).

    Build it through :class:`ResidencyManager`, which picks it for ``"lru"``
    and ``"arc"``; the parameters, the protocol and the errors are the same.
    :attr:`policy` is a :class:`NativePolicy` view.
    """

    __slots__ = ("_core", "_view")

    def __init__(
        self,
        capacity_slots: int,
        policy: Any = "lru",
        *,
        enable_events: bool = False,
        tier: str = "cpu",
        native: bool | None = None,
    ) -> None:
        check_construction(capacity_slots, tier)
        if policy not in ("lru", "arc") or _Core is None:
            raise InvalidArgumentError(f"the native manager runs 'lru' or 'arc', got {policy!r}")
        self._capacity = capacity_slots
        self._tier = tier
        self._events: list[ManagerEvent] | None = [] if enable_events else None
        self._core = _Core(capacity_slots, policy == "arc")
        self._view = NativePolicy(self._core, policy)

    # -- read-only views -----------------------------------------------------------------

    @property
    def policy(self) -> NativePolicy:  # type: ignore[override]
        """A read-only view of the policy the core runs."""
        return self._view

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, key: object) -> bool:
        return key in self._core

    def is_ready(self, key: bytes) -> bool:
        return self._core.is_ready(key)

    def slot_of(self, key: bytes) -> int | None:
        return self._core.slot_of(key)

    def pins(self, key: bytes) -> int:
        return self._core.pins(key)

    # -- the protocol (docstrings: ResidencyContract) ------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> int:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "lookup")
        return self._core.lookup(keys)

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "prepare_store")
        r = self._core.prepare_store(keys)
        if not r:
            return None if r is None else _EMPTY_PLAN
        if r[2] and self._events is not None:
            self._events.append(BlockRemoved(r[2], self._tier))
        return StorePlan(*r)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "complete_store")
        stored = self._core.complete_store(keys, success)
        if stored and self._events is not None:
            self._events.append(BlockStored(stored, self._tier))

    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "prepare_load")
        return LoadPlan(tuple(keys), self._core.prepare_load(keys))

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "complete_load")
        self._core.complete_load(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "touch")
        self._core.touch(keys)

    def remove(self, keys: Sequence[bytes]) -> list[bytes]:
        if type(keys) is not list and type(keys) is not tuple:
            keys = _as_list(keys, "remove")
        gone, announced = self._core.remove(keys)
        if announced and self._events is not None:
            self._events.append(BlockRemoved(announced, self._tier))
        return gone

    def reset(self) -> None:
        ready = self._core.reset()
        if ready and self._events is not None:
            self._events.append(BlockRemoved(ready, self._tier))

    def statistics(self) -> ManagerStatistics:
        return ManagerStatistics(*self._core.statistics())

    def __repr__(self) -> str:
        return (
            f"<ResidencyManager tier={self._tier!r} policy={self._view.name} (native) "
            f"{len(self)}/{self._capacity} slots>"
        )


def _choose(policy: object, native: bool | None) -> type[ResidencyManager] | None:
    """The class ``ResidencyManager(policy=..., native=...)`` builds, if not itself."""
    return NativeResidencyManager if native_wanted(policy, native) else None


register_variant(_choose)
