"""Fixtures of the host tier tests: a fresh namespace per test, its segment checked gone after."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator

import pytest
from support.processes import Children

from kvtier.tiers.host import Geometry, segment_path

ROW_BYTES = 8192
STRIDE = 4096 + ROW_BYTES


def pattern(key: bytes, n: int = ROW_BYTES) -> bytes:
    """The payload every test stores under ``key``: a reader knows what it must get."""
    return hashlib.shake_128(key).digest(n)


def budget(rows: int, instances: int = 1) -> int:
    """The host budget of exactly ``rows`` rows of :data:`ROW_BYTES` for ``instances`` slots."""
    return Geometry.budget_for(ROW_BYTES, rows, instances)


@pytest.fixture
def namespace() -> Iterator[bytes]:
    """A namespace of this test alone; the test fails if its segment is left behind."""
    ns = uuid.uuid4().bytes
    yield ns
    path = segment_path(ns)
    left = os.path.exists(path)
    if left:
        os.unlink(path)
    assert not left, f"the test left {path}"


@pytest.fixture
def children() -> Iterator[Children]:
    """Child processes of the test, all killed and reaped at its end."""
    kids = Children()
    yield kids
    kids.kill_all()
