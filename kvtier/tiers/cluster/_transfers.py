"""The cluster tier's two transfer paths: storing blocks, and loading and verifying them.

Both group their blocks per node in pipelines of bounded bytes
(:meth:`~kvtier.tiers.cluster._client.ClusterClient.plan`), add to the tier's
one tally, and tell its presence set what they learnt. The tier runs their
coroutines in tasks of its own; nothing here holds a task.

**Store.** :meth:`StorePath.begin` decides at once, in the caller's call,
which keys are skipped (known present, or being written) and marks the others
as being written, so that two stores of one key before either finished send
it once. The coroutine it returns does the writing: one pipeline of SETs per
node and batch, each value's header sealed just before its pipeline goes.

**Load.** Every key asked for is read, known here or not (a block a peer
stored loads without a refresh). With ``direct_reads`` the payload arrives
straight in its row and the header is checked there; a key answered with
MOVED or ASK goes again through redis-py, which follows redirections.
Otherwise redis-py's reply is verified and its payload copied once. Each key
ends loaded or missing; a refused or vanished value is forgotten here.

The two are separate objects over the same parts (:class:`_Path`): the tier
owns one of each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.errors import BlockNotFoundError, KVTierError
from kvtier.tiers.base import LoadResult, StoreResult
from kvtier.tiers.cluster._presence import Presence
from kvtier.tiers.cluster._reader import BulkError
from kvtier.tiers.cluster._statistics import Counters
from kvtier.tiers.cluster._values import ValueFormat

if TYPE_CHECKING:
    # The client imports redis (the optional ``cluster`` extra): a type here only.
    from kvtier.tiers.cluster._client import ClusterClient, Value

__all__ = ["LoadPath", "StorePath"]


class _Path:
    """What both paths work with: the client, the value format, the presence set, the tally."""

    __slots__ = ("_client", "_counts", "_format", "_presence")

    def __init__(
        self, client: ClusterClient, fmt: ValueFormat, presence: Presence, counts: Counters
    ) -> None:
        self._client = client
        self._format = fmt
        self._presence = presence
        self._counts = counts


class StorePath(_Path):
    """Writes blocks to the cluster and counts them; the tier owns one."""

    __slots__ = ()

    def begin(
        self, keys: Sequence[bytes], views: list[memoryview]
    ) -> Coroutine[Any, Any, StoreResult]:
        """Skip the keys known or being written, mark the others; the coroutine that writes them.

        The marks are made now, not when the coroutine starts: a store asked
        for next, before this one runs, skips these keys. The coroutine must
        be run (it unmarks them when it ends).
        """
        present, busy = self._presence.known, self._presence.writing
        todo = [i for i, k in enumerate(keys) if k not in present and k not in busy]
        skipped = tuple(k for k in keys if k in present or k in busy)
        self._counts.skipped += len(skipped)
        for i in todo:
            busy.add(keys[i])
        return self._store([keys[i] for i in todo], [views[i] for i in todo], skipped)

    async def _store(
        self, keys: list[bytes], views: list[memoryview], skipped: tuple[bytes, ...]
    ) -> StoreResult:
        c = self._counts
        fmt = self._format
        failed: dict[bytes, KVTierError] = {}
        stored: list[bytes] = []
        try:
            rkeys = [fmt.key_of(k) for k in keys]
            plans, early = self._client.plan(rkeys, fmt.value_bytes)
            for i, exc in early.items():
                failed[keys[i]] = exc
            stamp = int(time.time())

            async def one(node: str, idx: list[int]) -> None:
                def values() -> list[Value]:
                    # Made when the pipeline may go: the headers (the payloads'
                    # checksums) are computed just before they are sent.
                    payloads = [views[i] for i in idx]
                    heads = fmt.headers([keys[i] for i in idx], payloads, stamp)
                    return [(rkeys[i], h, v) for i, h, v in zip(idx, heads, payloads, strict=True)]

                try:
                    res = await self._client.set_values(node, values)
                except KVTierError as exc:
                    for i in idx:
                        failed[keys[i]] = exc
                    return
                for i, r in zip(idx, res, strict=True):
                    if isinstance(r, BaseException):
                        failed[keys[i]] = self._client.error(r, node)
                    else:
                        stored.append(keys[i])

            t0 = time.perf_counter()
            await asyncio.gather(*(one(node, idx) for node, idx in plans))
            c.write_busy += time.perf_counter() - t0
        finally:
            busy = self._presence.writing
            for k in keys:
                busy.discard(k)
        order = {k: i for i, k in enumerate(keys)}
        stored.sort(key=order.__getitem__)
        self._presence.remember_all(stored)
        c.stores += len(stored)
        c.store_failures += len(failed)
        c.bytes_written += len(stored) * fmt.block_bytes
        return StoreResult(stored=tuple(stored), skipped=skipped, failed=failed)


class LoadPath(_Path):
    """Reads and verifies blocks from the cluster and counts them; the tier owns one."""

    __slots__ = ()

    async def load(self, keys: list[bytes], views: list[memoryview]) -> LoadResult:
        """Read ``keys`` into ``views`` (checked by the caller); what loaded, what is missing."""
        c = self._counts
        fmt = self._format
        present = self._presence.known
        missing: dict[bytes, KVTierError] = {}
        loaded: set[bytes] = set()
        rkeys = [fmt.key_of(k) for k in keys]
        plans, early = self._client.plan(rkeys, fmt.value_bytes)
        for i, exc in early.items():
            missing[keys[i]] = exc
        faults = len(early)

        def settle(key: bytes, problem: KVTierError | None) -> None:
            if problem is None:
                loaded.add(key)
                return
            missing[key] = problem
            if isinstance(problem, BlockNotFoundError):
                if key in present:
                    c.vanished += 1
            else:
                c.verify_failed += 1
            present.pop(key, None)

        async def via_redis(node: str, idx: list[int]) -> None:
            nonlocal faults
            try:
                res = await self._client.run(node, [("GET", rkeys[i]) for i in idx])
            except KVTierError as exc:
                faults += len(idx)
                for i in idx:
                    missing[keys[i]] = exc
                return
            for i, value in zip(idx, res, strict=True):
                if isinstance(value, BaseException):
                    faults += 1
                    missing[keys[i]] = self._client.error(value, node)
                else:
                    settle(keys[i], fmt.verify_into(keys[i], value, views[i]))

        async def one(node: str, idx: list[int]) -> None:
            nonlocal faults
            if not self._client.direct:
                await via_redis(node, idx)
                return
            try:
                res = await self._client.get_into(
                    node, [rkeys[i] for i in idx], [views[i] for i in idx]
                )
            except KVTierError as exc:
                faults += len(idx)
                for i in idx:
                    missing[keys[i]] = exc
                return
            again = []
            for i, reply in zip(idx, res, strict=True):
                if isinstance(reply, BulkError):
                    again.append(i)  # MOVED, ASK, ...: redis-py follows them
                else:
                    settle(keys[i], fmt.verify_reply(keys[i], reply, views[i]))
            if again:
                await via_redis(node, again)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(node, idx) for node, idx in plans))
        c.read_busy += time.perf_counter() - t0
        self._presence.remember_all(k for k in keys if k in loaded)
        c.hits += len(loaded)
        c.misses += len(missing)
        c.load_failures += faults
        c.bytes_read += len(loaded) * fmt.block_bytes
        return LoadResult(loaded=tuple(k for k in keys if k in loaded), missing=missing)
