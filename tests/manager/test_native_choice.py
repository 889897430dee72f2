"""Which manager ResidencyManager builds: the compiled core, or Python when told or without it."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.manager import LRUPolicy, ResidencyManager
from kvtier.manager import native as native_module
from kvtier.manager.native import NativeResidencyManager, native_available


def test_the_core_is_built_in_this_checkout() -> None:
    # make and pip build it; a failed build would silently fall back without this.
    assert native_available()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_builtin_policies_get_the_core(policy: str) -> None:
    m = ResidencyManager(8, policy)
    assert type(m) is NativeResidencyManager
    assert isinstance(m, ResidencyManager)
    assert m.policy.name == policy


def test_a_policy_instance_runs_in_python() -> None:
    assert type(ResidencyManager(8, LRUPolicy())) is ResidencyManager


def test_native_false_and_the_environment_choose_python(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(ResidencyManager(8, "arc", native=False)) is ResidencyManager
    monkeypatch.setenv("KVTIER_MANAGER", "python")
    assert type(ResidencyManager(8, "arc")) is ResidencyManager
    assert type(ResidencyManager(8, "arc", native=True)) is NativeResidencyManager


def test_native_true_refuses_a_policy_instance() -> None:
    with pytest.raises(InvalidArgumentError, match="built-in policies"):
        ResidencyManager(8, LRUPolicy(), native=True)


@pytest.mark.parametrize("native", [1, "yes"])
def test_native_must_be_a_bool_or_none(native: object) -> None:
    with pytest.raises(InvalidArgumentError, match="native must be"):
        ResidencyManager(8, "lru", native=native)  # type: ignore[arg-type]


def test_without_the_core_python_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_module, "_Core", None)
    monkeypatch.setattr(native_module, "_IMPORT_ERROR", "no module named _native")
    assert not native_available()
    m = ResidencyManager(8, "lru")
    assert type(m) is ResidencyManager
    plan = m.prepare_store([b"k"])
    assert plan is not None
    assert plan.slots == (0,)
    with pytest.raises(InvalidArgumentError, match="compiled core is missing"):
        ResidencyManager(8, "lru", native=True)


def test_a_subclass_is_never_swapped() -> None:
    class Mine(ResidencyManager):
        __slots__ = ()

    assert type(Mine(8, "lru")) is Mine


def test_an_uninitialized_core_raises_instead_of_crashing() -> None:
    from kvtier.manager._native import Core

    core = Core.__new__(Core)
    for call in (
        lambda: core.lookup([b"k"]),
        lambda: core.prepare_store([b"k"]),
        lambda: core.slot_of(b"k"),
        lambda: b"k" in core,
        lambda: core.reset(),
        lambda: core.statistics(),
        lambda: core.policy_state(),
        lambda: core.in_t2(0),
        lambda: core.order(1),
    ):
        with pytest.raises(RuntimeError, match="not initialized"):
            call()
    assert len(core) == 0
