"""A shared CPU region joins only this user's own private file (issue 48, item 1).

We run as root here: "another user" is uid 65534 (``os.chown``).
"""

from __future__ import annotations

import os

import pytest

from kvtier.errors import SharedRegionError, UnsafeSharedFileError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion

NOBODY = 65534


def test_a_shared_cpu_region_refuses_a_loose_file(layout: KVLayout, shm_name: str) -> None:
    with CPURegion.create(layout, 1 << 20, world_size=2, rank=0, shared_name=shm_name, pin="off"):
        path = f"/dev/shm/kvtier-{shm_name}"
        os.chmod(path, 0o666)
        with pytest.raises(UnsafeSharedFileError, match=r"0666"):
            CPURegion.create(layout, 1 << 20, world_size=2, rank=1, shared_name=shm_name, pin="off")
        os.chmod(path, 0o600)
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(SharedRegionError, match="another user"):
            CPURegion.create(layout, 1 << 20, world_size=2, rank=1, shared_name=shm_name, pin="off")
        os.chown(path, 0, 0)
