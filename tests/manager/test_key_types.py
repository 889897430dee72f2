"""Keys are exactly ``bytes``: a ``memoryview`` hashes and compares equal to its bytes,
so without a type check it would pass every dict lookup and end up in the index
or in a plan."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.manager import ResidencyManager
from kvtier.testing.manager import _CALLS as CALLS
from kvtier.testing.manager import key


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("which", [1, 2], ids=["ready-and-pinned", "being-written"])
def test_memoryview_of_a_known_key_is_refused(
    policy: str, call: str, which: int, native: bool
) -> None:
    m = ResidencyManager(4, policy, enable_events=True, native=native)
    plan = m.prepare_store([key(1)])
    assert plan is not None
    m.complete_store([key(1)])
    m.prepare_load([key(1)])
    assert m.prepare_store([key(2)]) is not None
    m.take_events()
    before = m.statistics()
    with pytest.raises(InvalidArgumentError, match="must be bytes"):
        getattr(m, call)([memoryview(key(which))])
    assert m.statistics() == before
    assert m.take_events() == []
    m.complete_load([key(1)])
    m.complete_store([key(2)])
    assert m.prepare_load([key(1), key(2)]).keys == (key(1), key(2))
    if not native:
        assert all(type(k) is bytes for k in m._index)
