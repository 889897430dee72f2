"""The chain's scenarios, written once and run against every front that drives it.

:class:`~kvtier.chain.Chain` decides the cascade; a front carries it out: the
:class:`~kvtier.engine.Engine` with awaitables on one loop, the vLLM front
from vLLM's scheduler thread with the tiers on a loop thread. A front's test
module subclasses :class:`ChainSuite` and implements :meth:`ChainSuite.open_front`
with a :class:`Front` adapter; pytest collects the scenarios below for it::

    class TestEngineFront(ChainSuite):
        async def open_front(self, root, cpu_rows):
            return EngineFront(await Engine.open(...))

Every scenario runs over a real file tier (O_DIRECT files under the test's
``tmp_path``) and checks every block served byte for byte against
:func:`payload`. Blocks are named by small ints; each front maps a name to
its own key type and device or row ids.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import INDEX_FILE, IndexReader, split_dir_name

__all__ = ["ChainSuite", "Front", "damage_on_disk", "payload", "store_in_steps"]

BLOCK_BYTES = 4096
"""Payload bytes of every block the scenarios store (one CPU row)."""


def payload(name: int, size: int = BLOCK_BYTES) -> bytes:
    """The bytes block ``name`` holds: a function of the name alone."""
    return hashlib.shake_128(name.to_bytes(8, "little")).digest(size)


class Front(abc.ABC):
    """One front over a chain whose lower tier is a file tier: what the scenarios drive."""

    @abc.abstractmethod
    def key(self, name: int) -> bytes:
        """kvtier's block key of block ``name`` (the one in the file tier's headers)."""

    @abc.abstractmethod
    async def store(self, names: Sequence[int]) -> None:
        """Store :func:`payload` of each, and return once written through to the file tier."""

    @abc.abstractmethod
    async def serve(self, names: Sequence[int]) -> list[bytes]:
        """The bytes of the leading blocks of ``names`` that it serves (a prefix)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close it (its tiers, its region)."""


def damage_on_disk(root: Path, key: bytes) -> bool:
    """Flip bytes of the payload of ``key``'s slot, found through the partitions' indexes.

    What a bad sector or a stray writer does behind kvtier's back; False when
    no index names the key.
    """
    for part in sorted(root.iterdir()):
        if split_dir_name(part.name) is None or not (part / INDEX_FILE).exists():
            continue
        index = IndexReader(part / INDEX_FILE)
        try:
            slots = [slot for slot, k in index.changes() if k == key]
        finally:
            index.close()
        if not slots:
            continue
        fd = os.open(part / "blocks.dat", os.O_RDWR)
        try:
            slot_bytes = os.fstat(fd).st_size // index.slots
            at = slots[0] * slot_bytes + HEADER_BYTES + 100
            os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 16, at)), at)
        finally:
            os.close(fd)
        return True
    return False


async def store_in_steps(front: Front, names: Sequence[int], per_step: int = 2) -> None:
    """Store ``names`` a few at a time, as serving steps do (vLLM stores no more
    than its CPU tier takes in one step)."""
    for i in range(0, len(names), per_step):
        await front.store(names[i : i + per_step])


class ChainSuite(abc.ABC):
    """The chain's scenarios; a subclass names the front (see the module docstring)."""

    @abc.abstractmethod
    async def open_front(self, root: Path, cpu_rows: int) -> Front:
        """A front with ``cpu_rows`` CPU rows of :data:`BLOCK_BYTES` over a file tier at
        ``root`` (room for at least 32 blocks)."""

    async def test_blocks_evicted_from_the_cpu_tier_are_served_from_file(
        self, tmp_path: Path
    ) -> None:
        front = await self.open_front(tmp_path / "kv", 4)
        try:
            names = list(range(10))
            await store_in_steps(front, names)  # through 4 rows: the first are on file only
            got = await front.serve(names[:4])
            assert got == [payload(n) for n in names[:4]]
            assert await front.serve(names) == [payload(n) for n in names]
        finally:
            await front.aclose()

    async def test_a_damaged_block_on_file_is_a_miss_never_wrong_bytes(
        self, tmp_path: Path
    ) -> None:
        root = tmp_path / "kv"
        front = await self.open_front(root, 4)
        try:
            await store_in_steps(front, list(range(8)))  # 0-3 on file only
            assert damage_on_disk(root, front.key(1))
            assert await front.serve([0, 1, 2]) == [payload(0)]  # the prefix ends at 1
            assert await front.serve([1]) == []  # and 1 stays a miss
            assert await front.serve([2, 3]) == [payload(2), payload(3)]
        finally:
            await front.aclose()

    async def test_a_new_front_serves_what_the_last_one_wrote_through(self, tmp_path: Path) -> None:
        root = tmp_path / "kv"
        front = await self.open_front(root, 4)
        try:
            await store_in_steps(front, list(range(6)))
        finally:
            await front.aclose()
        again = await self.open_front(root, 4)
        try:
            assert await again.serve(list(range(6))) == [payload(n) for n in range(6)]
        finally:
            await again.aclose()
