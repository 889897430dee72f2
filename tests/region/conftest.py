"""Fixtures of the CPU region tests: layouts, unique shared names, /dev/shm hygiene."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.layout import KVLayout, TensorSpec

SHM = "/dev/shm"


def make_layout(
    *,
    block_bytes: tuple[int, ...] = (1024, 3072),
    blocks_per_chunk: int = 2,
    kv_first: tuple[bool, ...] | None = None,
) -> KVLayout:
    """A layout of float16 tensors with the given bytes per block (each a multiple of 4)."""
    kinds = kv_first or tuple(i % 2 == 1 for i in range(len(block_bytes)))
    specs = []
    for i, (nbytes, kv) in enumerate(zip(block_bytes, kinds, strict=True)):
        shape = (2, 8, nbytes // 4) if kv else (8, nbytes // 2)
        specs.append(TensorSpec(f"t{i}", shape, "float16", 2, kv))
    return KVLayout(
        tensors=tuple(specs), model_id="m", block_tokens=16, blocks_per_chunk=blocks_per_chunk
    )


def shm_files(name: str) -> list[str]:
    """Files in /dev/shm that belong to region ``name``."""
    return [f for f in os.listdir(SHM) if f == f"kvtier-{name}"]


@pytest.fixture
def layout() -> KVLayout:
    return make_layout()


@pytest.fixture
def layout_factory() -> Callable[..., KVLayout]:
    """:func:`make_layout`, for tests that need several layouts."""
    return make_layout


@pytest.fixture
def leftovers() -> Callable[[str], list[Any]]:
    """:func:`shm_files`: the /dev/shm files a region name still has."""
    return shm_files


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A unique region name; the test fails if it leaves a file behind (which is removed)."""
    name = f"test-{uuid.uuid4().hex}"
    yield name
    left = shm_files(name)
    for f in left:
        os.unlink(os.path.join(SHM, f))
    assert not left, f"the test left {left} in /dev/shm"
