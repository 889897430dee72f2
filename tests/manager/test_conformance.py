"""Both built-in policies, in C and in Python, and a custom one, run the conformance suite."""

from __future__ import annotations

from kvtier.manager import CachePolicy, LRUPolicy, ResidencyManager
from kvtier.manager.native import NativeResidencyManager
from kvtier.testing.manager import ResidencyManagerSuite


class TestLRU(ResidencyManagerSuite):
    """The default build: the compiled core."""

    policy = "lru"

    def test_is_the_compiled_core(self) -> None:
        assert type(self.make()) is NativeResidencyManager


class TestARC(ResidencyManagerSuite):
    policy = "arc"

    def test_is_the_compiled_core(self) -> None:
        assert type(self.make()) is NativeResidencyManager


class TestLRUPython(ResidencyManagerSuite):
    policy = "lru"
    native = False

    def test_is_the_python_manager(self) -> None:
        assert type(self.make()) is ResidencyManager


class TestARCPython(ResidencyManagerSuite):
    policy = "arc"
    native = False


class TestCustomPolicyInstance(ResidencyManagerSuite):
    """A policy passed as an instance (here a plain LRU subclass) plugs in the same way."""

    policy = "custom"

    def make_policy(self) -> CachePolicy:
        class Custom(LRUPolicy):
            __slots__ = ()

        return Custom()
