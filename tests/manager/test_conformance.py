"""Both built-in policies, and a custom one, run the residency conformance suite."""

from __future__ import annotations

from kvtier.manager import CachePolicy, LRUPolicy
from kvtier.testing.manager import ResidencyManagerSuite


class TestLRU(ResidencyManagerSuite):
    policy = "lru"


class TestARC(ResidencyManagerSuite):
    policy = "arc"


class TestCustomPolicyInstance(ResidencyManagerSuite):
    """A policy passed as an instance (here a plain LRU subclass) plugs in the same way."""

    policy = "custom"

    def make_policy(self) -> CachePolicy:
        class Custom(LRUPolicy):
            __slots__ = ()

        return Custom()
