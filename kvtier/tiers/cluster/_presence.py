"""What this instance knows the cluster holds: the presence set, and how it learns more.

:meth:`ClusterTier.lookup <kvtier.tiers.cluster.ClusterTier.lookup>` answers
from this set without I/O (about 0.1 µs a key, where an ``EXISTS`` costs a
round trip), so the set is a hint: the keys this instance stored, loaded or
refreshed, least recently used dropped past ``presence_capacity``.
:meth:`Presence.refresh` adds the keys peers stored (one pipelined ``EXISTS``
per node). The keys being written sit in ``writing`` meanwhile, so a second
store of them is skipped rather than sent twice.

The store and load paths read and change ``known`` and ``writing`` directly,
not through a method per key: these are the per-block hot loops.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtier.errors import KVTierError
from kvtier.tiers.cluster._statistics import Counters
from kvtier.tiers.cluster._values import ValueFormat

if TYPE_CHECKING:
    # The client imports redis (the optional ``cluster`` extra): a type here only.
    from kvtier.tiers.cluster._client import ClusterClient

__all__ = ["Presence"]


class Presence:
    """The keys this instance knows present (LRU order) and those it is writing."""

    __slots__ = ("_capacity", "_client", "_counts", "_format", "known", "writing")

    def __init__(
        self, capacity: int, client: ClusterClient, fmt: ValueFormat, counts: Counters
    ) -> None:
        # Least recently used first: capacity drops from the front.
        self.known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        # Keys whose store is in flight: a second store of them is skipped.
        self.writing: set[bytes] = set()
        self._capacity = capacity
        self._client = client
        self._format = fmt
        self._counts = counts

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` known present; no I/O."""
        present = self.known
        n = 0
        for k in keys:
            if k not in present:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` known longest; absent keys are ignored."""
        present = self.known
        for k in keys:
            if k in present:
                present.move_to_end(k)

    def remember_all(self, keys: Iterable[bytes]) -> None:
        """Know ``keys`` present, the last most recent; drop the least recent past capacity.

        One call for a batch: the paths that learn keys learn them many at once.
        """
        present, capacity = self.known, self._capacity
        for key in keys:
            present[key] = None
            present.move_to_end(key)
            if len(present) > capacity:
                present.popitem(last=False)

    async def refresh(self, keys: Sequence[bytes]) -> int:
        """Ask the cluster which of ``keys`` it holds; remember them; the new lookup.

        The keys are checked by the caller. A node that fails leaves its keys
        unknown (a hint is not worth failing a request for); cancelling the
        caller abandons the answer, never a transfer.
        """
        unknown = [k for k in keys if k not in self.known]
        if not unknown:
            return len(keys)
        rkeys = [self._format.key_of(k) for k in unknown]
        plans, _failed = self._client.plan(rkeys, 64)
        self._counts.exists += len(unknown)

        async def one(node: str, idx: list[int]) -> None:
            try:
                res = await self._client.run(node, [("EXISTS", rkeys[i]) for i in idx])
            except KVTierError:
                return
            self.remember_all(unknown[i] for i, r in zip(idx, res, strict=True) if r == 1)

        await asyncio.gather(*(one(node, idx) for node, idx in plans))
        return self.lookup(keys)
