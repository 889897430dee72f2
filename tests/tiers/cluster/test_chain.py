"""The scheduler-side chain (:mod:`kvtier.chain`) driven over real tiers.

A chain decides, a :class:`~kvtier.chain._driver.TierDriver` carries its
intents out on a real file tier (O_DIRECT files under tmp) and a real Valkey
cluster, and the outcomes go back to the chain: the loop every front runs
(the vLLM manager runs it across two threads). Two chains with regions of
their own on one cluster are two instances of a fleet. Every block served is
checked byte for byte against what was stored under its key.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvtier.chain import Answer, Chain, LowerTier, Outcome, Write
from kvtier.chain._driver import TierDriver
from kvtier.config import ClusterTierConfig, FileTierConfig
from kvtier.layout import KVLayout, TensorSpec
from kvtier.region import CPURegion
from kvtier.testing.valkey import ValkeyCluster
from kvtier.tiers.base import Tier
from kvtier.tiers.factory import open_tier

ROW = 4096
ROWS = 4


def layout() -> KVLayout:
    page = TensorSpec("page", (1, ROW), "int8", 1, False)
    return KVLayout(tensors=(page,), model_id="chain-test", block_tokens=16)


def content(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(ROW)


def keys(n: int, salt: str) -> list[bytes]:
    return [hashlib.blake2b(f"{salt}-{i}".encode(), digest_size=16).digest() for i in range(n)]


@dataclass
class Instance:
    """One instance: its CPU region, its chain, its tiers, and the driver between."""

    region: CPURegion
    chain: Chain
    driver: TierDriver
    tiers: list[Tier]
    now: list[float]
    outcomes: list[Outcome] = field(default_factory=list)

    async def step(self) -> None:
        """Carry out what the chain wants now; hand every outcome back once it is in."""
        intents = self.chain.take_intents()
        for intent in intents:
            self.driver.carry_out(intent)
        await self.settle(len(intents))

    async def settle(self, count: int) -> None:
        """Wait for ``count`` outcomes (10 s at most) and hand them to the chain."""
        for _ in range(2000):
            if len(self.outcomes) >= count:
                break
            await asyncio.sleep(0.005)
        assert len(self.outcomes) == count, "an intent got no outcome"
        for outcome in self.outcomes:
            self.chain.settle(outcome)
        self.outcomes.clear()

    async def store(self, ks: list[bytes]) -> None:
        """Store blocks as a device copy would: into rows, then written through."""
        plan = self.chain.place(ks)
        assert plan is not None
        for k, s in zip(plan.keys, plan.slots, strict=True):
            self.region.row(s)[:] = content(k)
        self.chain.stored(plan.keys, True)
        await self.step()

    def serves(self, key: bytes) -> bool:
        """A HIT, with the stored bytes in its row (pinned and released as a load would)."""
        if self.chain.lookup(key) is not Answer.HIT:
            return False
        (slot,) = self.chain.pin_for_device_load([key])
        try:
            assert bytes(self.region.row(slot)) == content(key)
        finally:
            self.chain.unpin_device_load([key])
        return True


@asynccontextmanager
async def instance(
    tmp_path: Path | None,
    cluster: ValkeyCluster | None,
    *,
    deadline: float = 5.0,
    write_back: bool = False,
) -> AsyncIterator[Instance]:
    lay = layout()
    region = CPURegion.create(lay, ROWS * ROW, alignment=4096)
    tiers: list[Tier] = []
    specs: list[LowerTier] = []
    if tmp_path is not None:
        cfg = FileTierConfig(root=tmp_path, bytes_to_use="4MiB", queue_depth=4)
        tiers.append(await open_tier(cfg, lay, region))
        specs.append(LowerTier("file", write_back=write_back))
    if cluster is not None:
        ccfg = ClusterTierConfig(
            nodes=tuple(f"{h}:{p}" for h, p in cluster.startup), tenant_prefix="chain"
        )
        tiers.append(await open_tier(ccfg, lay, region))
        specs.append(LowerTier("cluster", shared=True, promote_up=bool(specs)))
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731 - the test moves time
    chain = Chain(region.rows, specs, lookup_deadline_s=deadline, clock=clock)
    outcomes: list[Outcome] = []
    driver = TierDriver(tiers, [s.name for s in specs], region, outcomes.append)
    inst = Instance(region, chain, driver, tiers, now, outcomes)
    try:
        yield inst
    finally:
        for tier in reversed(tiers):
            await tier.aclose()
        region.close()


async def test_write_through_then_promotion_from_the_file_tier(tmp_path: Path) -> None:
    async with instance(tmp_path, None) as a:
        ks = keys(10, "file")
        for i in range(0, 10, 2):  # 10 blocks through 4 rows: the first ones are evicted
            await a.store(ks[i : i + 2])
        st = a.chain.statistics()
        assert st.tiers["file"].written_blocks == 10
        assert st.rows_held_by_writes == 0  # every write ended: its pin is gone
        assert not a.serves(ks[0])
        assert a.chain.lookup(ks[0]) is Answer.RETRY  # a read was queued before
        await a.step()  # the read into a CPU row
        assert a.serves(ks[0])
        assert a.chain.statistics().tiers["file"].lookup_hits == 1


async def test_a_block_gone_from_the_file_tier_is_a_miss(tmp_path: Path) -> None:
    async with instance(tmp_path, None) as a:
        ks = keys(8, "gone")
        await a.store(ks[:4])
        await a.store(ks[4:])  # all 4 rows: the first four are on file only
        a.tiers[0].remove([ks[0]])  # behind the chain's back
        assert a.chain.lookup(ks[0]) is Answer.RETRY
        await a.step()
        assert a.chain.lookup(ks[0]) is Answer.MISS  # never an error, never wrong bytes
        assert a.chain.statistics().tiers["file"].read_failures == 1


async def test_a_lookup_past_its_deadline_is_a_miss_then_the_read_serves(tmp_path: Path) -> None:
    async with instance(tmp_path, None, deadline=0.5) as a:
        ks = keys(8, "late")
        await a.store(ks[:4])
        await a.store(ks[4:])
        assert a.chain.lookup(ks[0]) is Answer.RETRY
        (read,) = a.chain.take_intents()
        a.driver.carry_out(read)  # issued; its outcome is not handed back yet
        a.now[0] += 0.4
        assert a.chain.lookup(ks[0]) is Answer.RETRY
        a.now[0] += 0.2  # the tier has not answered in time: the request recomputes
        assert a.chain.lookup(ks[0]) is Answer.MISS
        assert a.chain.statistics().lookup_deadline_misses == 1
        await a.settle(1)  # the read went on; a later request gets the block
        assert a.serves(ks[0])


async def test_a_fleet_shares_blocks_through_the_cluster(
    valkey_cluster: ValkeyCluster, tmp_path: Path
) -> None:
    async with (
        instance(tmp_path / "a", valkey_cluster) as a,
        instance(tmp_path / "b", valkey_cluster) as b,
    ):
        ks = keys(3, "fleet")
        await a.store(ks)
        assert a.chain.statistics().tiers["cluster"].written_blocks == 3
        # B never saw these keys: it asks the cluster, then reads, then serves.
        assert b.chain.lookup(ks[0]) is Answer.RETRY
        assert b.chain.lookup(ks[1]) is Answer.RETRY
        await b.step()  # the probe
        assert b.chain.lookup(ks[0]) is Answer.RETRY
        assert b.chain.lookup(ks[1]) is Answer.RETRY
        await b.step()  # the reads
        assert b.serves(ks[0])
        assert b.serves(ks[1])
        st = b.chain.statistics()
        assert st.tiers["cluster"].lookup_hits == 2
        # promote_up: what came from the cluster is on B's file tier too.
        await b.step()
        assert st.tiers["cluster"].probes == 2
        assert b.chain.statistics().tiers["file"].written_blocks == 2
        # A key nobody stored: one probe, then a miss until the answer is stale.
        (other,) = keys(1, "nobody")
        assert b.chain.lookup(other) is Answer.RETRY
        await b.step()
        assert b.chain.lookup(other) is Answer.MISS
        b.now[0] += 2.0  # past probe_ttl_s: another instance may have stored it
        assert b.chain.lookup(other) is Answer.RETRY
        await b.step()


@pytest.mark.parametrize("rows_free", [0, 2])
async def test_place_takes_the_leading_blocks_that_fit(tmp_path: Path, rows_free: int) -> None:
    async with instance(tmp_path, None) as a:
        held = keys(ROWS - rows_free, "held")
        if held:
            plan = a.chain.place(held)  # being written: not evictable
            assert plan is not None
        ks = keys(5, "many")
        plan = a.chain.place(ks)
        if rows_free == 0:
            assert plan is None
            assert a.chain.statistics().store_refusals == 5
        else:
            assert plan is not None
            assert list(plan.keys) == ks[:rows_free]
            assert a.chain.statistics().store_refusals == 5 - rows_free
        assert np.all(np.asarray([a.chain.lookup(k) is not Answer.HIT for k in ks]))


async def test_a_read_that_never_gets_a_row_ends_as_a_miss(tmp_path: Path) -> None:
    async with instance(tmp_path, None, deadline=0.5) as a:
        ks = keys(8, "norow")
        await a.store(ks[:4])
        await a.store(ks[4:])  # ks[:4] are on file only
        held = a.chain.place(keys(4, "held"))  # every row being written: none to read into
        assert held is not None
        assert a.chain.lookup(ks[0]) is Answer.RETRY
        await a.step()  # no row: the read is not started
        assert a.chain.lookup(ks[0]) is Answer.RETRY
        a.now[0] += 1.0
        assert a.chain.lookup(ks[0]) is Answer.MISS
        await a.step()
        assert not a.chain.is_waiting(ks[0])  # nothing left for the front to step for
        a.chain.stored(held.keys, False)
        assert a.chain.lookup(ks[0]) is Answer.RETRY  # rows again: a fresh try
        await a.step()
        assert a.serves(ks[0])


async def test_write_back_on_eviction_holds_the_rows_until_written(tmp_path: Path) -> None:
    async with instance(tmp_path, None, write_back=True) as a:
        ks = keys(8, "back")
        await a.store(ks[:4])  # all 4 rows, written nowhere yet
        assert a.chain.lower_of(ks[0]) is None
        assert a.chain.statistics().tiers["file"].written_blocks == 0
        # Two new blocks evict the two least recently used: their rows are
        # their only copy, so each goes to the file tier before reuse.
        plan = a.chain.place(ks[4:6])
        assert plan is not None
        victims = list(plan.evicted)
        assert len(victims) == 2
        assert set(victims) <= set(ks[:4])
        (write,) = a.chain.evicting_writes(plan)
        assert write.evicting
        assert set(write.keys) == set(plan.evicted)
        assert set(write.rows) <= set(plan.slots)
        # A promotion into one of those rows waits for the write-back too.
        await a.step()
        assert a.chain.evicting_writes(plan) == ()
        assert all(a.chain.lower_of(k) == 0 for k in victims)
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            a.region.row(slot)[:] = content(k)
        a.chain.stored(plan.keys, True)
        # At close, the rest goes down; then every block is served, from file or CPU.
        assert a.chain.write_back() == 4
        await a.step()
        assert a.chain.write_back() == 0
        st = a.chain.statistics()
        assert st.tiers["file"].written_blocks == 6
        assert st.tiers["file"].write_backs == 6
        assert st.rows_held_by_writes == 0
        reads = a.chain.promote(victims)  # evicts two rows, already written: no hold
        assert [set(r.keys) for r in reads] == [set(victims)]
        await a.step()
        assert all(a.serves(k) for k in victims)


async def test_a_read_into_a_row_being_written_back_waits_for_it(tmp_path: Path) -> None:
    async with instance(tmp_path, None, write_back=True) as a:
        ks = keys(5, "held")
        x = keys(1, "on-file")[0]
        await a.store([x])
        assert a.chain.write_back() == 1  # x on file, and in a CPU row
        await a.step()
        await a.store(ks[:3])  # the CPU tier full: x (oldest), then three dirty blocks
        await a.store(ks[3:4])  # evicts x, which the file tier holds: nothing to write
        assert x not in a.chain
        assert a.chain.lower_of(x) == 0
        # Promoting x evicts the least recently used dirty block: its row is
        # written back first, and the read into that row is held until then.
        (read,) = a.chain.promote([x])
        intents = a.chain.take_intents()
        (write,) = intents
        assert isinstance(write, Write)
        assert write.evicting
        (victim,) = write.keys
        assert victim in ks[:4]
        assert write.rows == read.rows
        for intent in intents:
            a.driver.carry_out(intent)
        await a.settle(1)  # the write-back's outcome releases the read
        assert a.chain.take_intents() == [read]
        a.driver.carry_out(read)
        await a.settle(1)
        assert a.serves(x)
        assert a.chain.lower_of(victim) == 0  # written back, and served from there
