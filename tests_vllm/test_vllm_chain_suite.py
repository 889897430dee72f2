"""The chain's scenarios (:class:`kvtier.testing.chain.ChainSuite`) through the vLLM front.

The manager is driven as vLLM's scheduler drives it (``lookup`` until it
stops answering RETRY, one ``on_schedule_end`` per step between,
``prepare_store``/``complete_store``, ``prepare_load``/``complete_load``,
``has_pending_work`` until the writes end), with the tiers on kvtier's loop thread;
the worker's copies are stood in for by reading and writing the region's
rows directly. The same scenarios run through the Engine in
``tests/engine/test_chain_suite.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.testing.chain import BLOCK_BYTES, ChainSuite, Front, payload
from kvtier.tiers.file import FileTier
from tests_vllm._harness import offloading_config

WAIT_S = 10.0


class VLLMFront(Front):
    def __init__(self, manager: Any) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        self.m = manager
        self.ctx = ReqContext(req_id="suite")

    def _offload_key(self, name: int) -> Any:
        from vllm.v1.kv_offload.base import make_offload_key

        return make_offload_key(name.to_bytes(32, "big"), 0)

    def key(self, name: int) -> bytes:
        from kvtier.integrations.vllm._common import offload_key_to_kvtier

        return offload_key_to_kvtier(bytes(self._offload_key(name)), self.m._ns)

    async def store(self, names: Sequence[int]) -> None:
        keys = [self._offload_key(n) for n in names]
        out = self.m.prepare_store(keys, self.ctx)
        assert out is not None
        assert list(out.keys_to_store) == keys
        for n, row in zip(names, out.store_spec.block_ids, strict=True):
            self.m._region.row(int(row))[:] = payload(n)  # the worker's copy
        self.m.complete_store(keys, self.ctx)
        # Written through once the manager has no pending work: vLLM asks this
        # every step, and the outcomes of the tiers' writes are taken in then.
        deadline = time.monotonic() + WAIT_S
        while self.m.has_pending_work():
            assert time.monotonic() < deadline, "write-through never ended"
            await asyncio.sleep(0.005)

    async def serve(self, names: Sequence[int]) -> list[bytes]:
        from vllm.v1.kv_offload.base import LookupResult

        got = []
        for n in names:
            key = self._offload_key(n)
            deadline = time.monotonic() + WAIT_S
            while (answer := self.m.lookup(key, self.ctx)) in (
                LookupResult.RETRY,
                LookupResult.HIT_PENDING,
            ):
                assert time.monotonic() < deadline, "a lookup never settled"
                self.m.on_schedule_end(None)  # the step ends: the reads it asked for start
                await asyncio.sleep(0.005)
            if answer is not LookupResult.HIT:
                break
            spec = self.m.prepare_load([key], self.ctx)
            (row,) = spec.block_ids
            got.append(bytes(self.m._region.row(int(row))))  # the worker's copy
            self.m.complete_load([key], self.ctx)
        return got

    async def aclose(self) -> None:
        self.m.shutdown()


class TestVLLMFront(ChainSuite):
    async def open_front(self, root: Path, cpu_rows: int) -> Front:
        from kvtier.integrations.vllm.spec import KVTierOffloadingSpec

        config = offloading_config(
            rows=cpu_rows,
            row_bytes=BLOCK_BYTES,
            engine_id="chain-suite",
            extra={
                "file_tier": {
                    "root": str(root),
                    "bytes_to_use": FileTier.budget_for(64, BLOCK_BYTES),
                    "queue_depth": 4,
                }
            },
        )
        return VLLMFront(KVTierOffloadingSpec(config).get_manager())


async def _prefix_pass(front: VLLMFront, names: Sequence[int], req: Any) -> int | None:
    """One step's lookup of a request's prefix, as vLLM's scheduler makes it
    (``_maximal_prefix_lookup``: on past RETRY, stop at MISS; None: deferred)."""
    from vllm.v1.kv_offload.base import LookupResult

    hits, deferred = 0, False
    for n in names:
        answer = front.m.lookup(front._offload_key(n), req)
        if answer is LookupResult.HIT:
            hits += 1
        elif answer is LookupResult.HIT_PENDING:
            hits, deferred = hits + 1, True
        elif answer is LookupResult.RETRY:
            deferred = True
        else:
            break
    return None if deferred else hits


async def test_a_prefix_longer_than_the_cpu_tier_is_served_in_part(tmp_path: Path) -> None:
    """Issue 41: 23 blocks on file, 4 CPU rows: the request got no answer, ever."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.testing.chain import store_in_steps

    front = await TestVLLMFront().open_front(tmp_path / "kv", 4)
    assert isinstance(front, VLLMFront)
    try:
        names = list(range(23))
        await store_in_steps(front, names)  # written through; only the last 4 in CPU rows
        for round_ in range(3):  # three requests sharing the prefix, one after another
            req = ReqContext(req_id=f"r{round_}")
            deadline = time.monotonic() + WAIT_S
            while (hits := await _prefix_pass(front, names, req)) is None:
                assert time.monotonic() < deadline, "the request never got an answer"
                front.m.on_schedule_end(None)  # the step ends: the reads it asked for start
                await asyncio.sleep(0.005)
            assert hits == 4  # the leading blocks that fit; the rest is recomputed
            keys = [front._offload_key(n) for n in names[:hits]]
            spec = front.m.prepare_load(keys, req)
            got = [bytes(front.m._region.row(int(r))) for r in spec.block_ids]
            assert got == [payload(n) for n in names[:hits]]
            front.m.complete_load(keys, req)
            front.m.on_request_finished(req)
        assert front.m.statistics().front.lookup_row_limit_misses >= 1
    finally:
        await front.aclose()


async def test_a_lower_tier_slower_than_recompute_is_declined(tmp_path: Path) -> None:
    """Issue 43: with a recompute cost below what the file tier's reads measured, a
    lookup answers the file's blocks as misses (vLLM recomputes them) and counts it."""
    from vllm.v1.kv_offload.base import ReqContext

    from kvtier.integrations.vllm.spec import KVTierOffloadingSpec
    from kvtier.testing.chain import store_in_steps

    config = offloading_config(
        rows=4,
        row_bytes=BLOCK_BYTES,
        engine_id="decline",
        extra={
            "file_tier": {
                "root": str(tmp_path / "kv"),
                "bytes_to_use": FileTier.budget_for(64, BLOCK_BYTES),
            },
            "recompute_s_per_block": 1e-9,  # recomputing costs nothing: no read is worth it
        },
    )
    front = VLLMFront(KVTierOffloadingSpec(config).get_manager())
    try:
        await store_in_steps(front, list(range(8)))  # 0-3 on file only
        # The file tier is not measured yet: its blocks are read (and measured).
        req = ReqContext(req_id="first")
        deadline = time.monotonic() + WAIT_S
        while (hits := await _prefix_pass(front, [0, 1], req)) is None:
            assert time.monotonic() < deadline
            front.m.on_schedule_end(None)
            await asyncio.sleep(0.005)
        assert hits == 2
        front.m.on_request_finished(req)
        stats = front.m.statistics()
        assert stats.tiers["file"].read_seconds_per_block is not None
        # Measured now: a read of blocks 2 and 3 would end after their recompute.
        later = ReqContext(req_id="later")
        assert await _prefix_pass(front, [2, 3], later) == 0
        record = front.m.statistics_json()
        assert record["tiers"]["file"]["loads_declined"] == 1
        assert record["metrics"]["kvtier_loads_declined_total"]["file"] == 1
    finally:
        await front.aclose()
