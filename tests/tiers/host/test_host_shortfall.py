"""Loads of blocks the tiers hold are never cut short (issue 48, item 6).

One Engine over a host tier smaller than what it stores and a file tier that
keeps everything: a block the host tier cannot deliver (its row reused by the
engine's own queued store, or damaged) is read from the file tier instead, and
the host tier's own evictions do not race a promotion the chain chose from it.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from kvtier import Engine, KVLayout, KVTierConfig, chain_keys
from kvtier.config import FileTierConfig, HostTierConfig
from kvtier.layout import TensorSpec
from kvtier.tiers.host import ChainedHostTier, Geometry, HostTier, segment_path

DEVICE_BLOCKS = 64
CHAIN = 12
"""Blocks per stored chain (and per load)."""
CPU_ROWS = 6
HOST_ROWS = 32


def _kv() -> list[torch.Tensor]:
    return [torch.zeros(2, DEVICE_BLOCKS, 4, 2, 64, dtype=torch.float16) for _ in range(2)]


@asynccontextmanager
async def _engine(tmp_path: Path) -> AsyncIterator[tuple[Engine, list[torch.Tensor]]]:
    """An Engine: 6 CPU rows, 32 host rows (one instance), a write-through file tier
    with room for everything a test stores (it evicts nothing)."""
    kv = _kv()
    layout = KVLayout.from_tensors(
        kv, model_id=uuid.uuid4().hex, block_tokens=4, num_blocks=DEVICE_BLOCKS
    )
    row = -(-layout.bytes_per_chunk // 4096) * 4096
    shm = tmp_path / "shm"
    shm.mkdir()
    config = KVTierConfig(
        cpu_bytes_to_use=CPU_ROWS * row,
        host_tier=HostTierConfig(
            bytes_to_use=Geometry.budget_for(row, HOST_ROWS, 1),
            instances=1,
            directory=shm,
            orphan_grace_s=None,
        ),
        file_tier=FileTierConfig(root=tmp_path / "file", bytes_to_use=2048 * (row + 4096)),
    )
    engine = await Engine.open(config, layout, kv)
    try:
        yield engine, kv
    finally:
        await engine.aclose()
    assert _gone(segment_path(layout.namespace, str(shm))), "segment left behind"


def _gone(path: str) -> bool:
    """The segment at ``path`` was removed (its last instance closed it)."""
    return not os.path.exists(path)


def _chain(engine: Engine, salt: int) -> list[bytes]:
    tokens = [salt * 100_000 + i for i in range(CHAIN * engine.block_tokens)]
    return chain_keys(tokens, engine.block_tokens, engine.namespace)


def _bytes(salt: int, i: int) -> torch.Tensor:
    """What block ``i`` of chain ``salt`` holds (K and V of one tensor, as uint8)."""
    g = torch.Generator().manual_seed(salt * 1000 + i)
    return torch.randint(0, 256, (2, 4, 2, 128), dtype=torch.uint8, generator=g)


def _put(kv: list[torch.Tensor], salt: int, ids: Sequence[int]) -> None:
    for t, tensor in enumerate(kv):
        v = tensor.view(torch.uint8)
        for i, b in enumerate(ids):
            v[:, b] = _bytes(salt + 7919 * t, i)


def _wrong(kv: list[torch.Tensor], salt: int, ids: Sequence[int], n: int) -> list[int]:
    """Blocks of the first ``n`` of chain ``salt`` loaded into ``ids`` that hold other bytes."""
    bad = []
    for i, b in enumerate(ids[:n]):
        for t, tensor in enumerate(kv):
            if not torch.equal(tensor.view(torch.uint8)[:, b], _bytes(salt + 7919 * t, i)):
                bad.append(i)
                break
    return bad


async def test_concurrent_loads_of_stored_chains_are_never_cut_short(tmp_path: Path) -> None:
    """The issue's scenario: 40 rounds of 12-block stores and loads at once, seeded."""
    rng = random.Random(48)
    async with _engine(tmp_path) as (engine, kv):
        stored: list[int] = []
        short: list[tuple[int, int, int]] = []
        wrong: list[tuple[int, int, list[int]]] = []
        salt = 0

        async def store(ids: list[int]) -> int:
            nonlocal salt
            salt += 1
            mine = salt
            _put(kv, mine, ids)
            await engine.store(_chain(engine, mine), ids)
            return mine

        async def load(round_: int, chain: int, ids: list[int]) -> None:
            got = await engine.load(_chain(engine, chain), ids)
            if got != CHAIN:
                short.append((round_, chain, got))
            if bad := _wrong(kv, chain, ids, got):
                wrong.append((round_, chain, bad))

        # Four device windows of 12 blocks: two stores and two loads at once.
        windows = [list(range(w * CHAIN, (w + 1) * CHAIN)) for w in range(4)]
        for round_ in range(40):
            chains = rng.sample(stored, min(2, len(stored)))
            stores = asyncio.gather(store(windows[0]), store(windows[1]))
            loads = asyncio.gather(*(load(round_, c, windows[2 + i]) for i, c in enumerate(chains)))
            new, _ = await asyncio.gather(stores, loads)
            stored += new
            await engine.flush()  # every chain stored so far is on file now

        st = engine.statistics()
        assert not wrong, f"wrong bytes served: {wrong}"
        assert not short, (
            f"loads cut short (round, chain, blocks): {short}; load_shortfalls "
            f"{st.front.load_shortfalls}, host read_failures {st.tiers['host'].read_failures}"
        )
        assert st.front.load_shortfalls == 0
        assert st.tiers["file"].read_failures == 0
        assert st.tiers["file"].statistics.evictions == 0  # it kept everything
        assert st.tiers["host"].read_blocks > 0  # the host tier served some


async def test_a_block_the_host_tier_fails_to_deliver_is_read_from_the_file_tier(
    tmp_path: Path,
) -> None:
    async with _engine(tmp_path) as (engine, kv):
        keys = _chain(engine, 1)
        _put(kv, 1, range(CHAIN))
        await engine.store(keys, list(range(CHAIN)))
        await engine.flush()  # on the host tier and on file; the CPU tier kept the last 6
        host = engine._links[0].tier
        assert isinstance(host, ChainedHostTier)
        at = host.host.payload_offset(keys[2])
        assert at is not None
        fd = os.open(host.host.path, os.O_RDWR)
        try:  # a bit flipped in the host row's payload: its verification fails
            byte = os.pread(fd, 1, at + 9)
            os.pwrite(fd, bytes([byte[0] ^ 0xFF]), at + 9)
        finally:
            os.close(fd)
        ids = list(range(CHAIN, 2 * CHAIN))
        assert engine.lookup(keys) == CHAIN
        assert await engine.load(keys, ids) == CHAIN
        assert _wrong(kv, 1, ids, CHAIN) == []
        st = engine.statistics()
        assert st.front.load_shortfalls == 0
        assert st.tiers["host"].read_failures == 1
        assert st.tiers["host"].statistics.integrity_failures == 1
        assert st.tiers["file"].read_blocks >= 1  # the damaged block came from file


# -- the host tier's own evictions and the reads asked of it --------------------------------

ROW = 8192


def _key(n: int) -> bytes:
    return (1000 + n).to_bytes(16, "big")  # never the all-zero key (an empty row's)


def _row(n: int) -> bytes:
    return n.to_bytes(8, "big") * (ROW // 8)


def test_a_store_never_evicts_a_block_it_is_told_to_keep(tmp_path: Path) -> None:
    ns = uuid.uuid4().bytes
    with HostTier.open(ns, ROW, Geometry.budget_for(ROW, 4), 1, directory=str(tmp_path)) as host:
        assert (
            host.store_many([_key(n) for n in (1, 2, 3, 4)], [memoryview(_row(1))] * 4)
            == [True] * 4
        )
        host.take_evicted()
        new = [_key(5), _key(6)]
        assert host.store_many(new, [memoryview(_row(5))] * 2, keep={_key(1)}) == [True, True]
        assert host.take_evicted() == [_key(2), _key(3)]  # the least recent but 1
        # Every row holds a block to keep: nothing stored, nothing evicted.
        kept = {_key(n) for n in (1, 4, 5, 6)}
        assert host.store_many([_key(7)], [memoryview(_row(7))], keep=kept) == [False]
        assert host.take_evicted() == []
        assert host.statistics().stores_without_room == 1
    assert _gone(segment_path(ns, str(tmp_path)))


async def test_a_load_asked_for_is_not_evicted_by_a_store_queued_before_it(tmp_path: Path) -> None:
    spec = TensorSpec(name="kv", shape=(8, 4096), dtype="float16", itemsize=2, kv_first=False)
    layout = KVLayout(tensors=(spec,), model_id=uuid.uuid4().hex, block_tokens=16)
    config = HostTierConfig(
        bytes_to_use=Geometry.budget_for(ROW, 8, 1),
        instances=1,
        directory=tmp_path,
        orphan_grace_s=None,
    )
    tier = await ChainedHostTier.open(config, layout, block_bytes=ROW)
    try:
        first = [_key(n) for n in range(8)]
        res = await tier.store(first, [memoryview(_row(n)) for n in range(8)])
        assert len(res.stored) == 8  # every row of the instance, 0 least recently used
        # The worker is held inside a store (evicting block 0) while a store of
        # four more blocks and a load of block 1 are queued behind it, in that
        # order: block 1 is among the four rows that store would reuse.
        gate = threading.Event()

        def hold(stage: str) -> None:
            if stage == "store" and not gate.is_set():
                gate.wait(10)

        tier.host.hook = hold
        busy = tier.store([_key(100)], [memoryview(_row(100))])
        queued = tier.store(
            [_key(n) for n in range(101, 105)], [memoryview(_row(n)) for n in range(101, 105)]
        )
        into = bytearray(ROW)
        load = tier.load([_key(1)], [memoryview(into)])
        gate.set()
        assert (await busy).evicted == (_key(0),)
        assert (await queued).evicted == tuple(_key(n) for n in (2, 3, 4, 5))
        assert (await load).loaded == (_key(1),)
        assert bytes(into) == _row(1)
        # Read: its row is the next store's to reuse like any other.
        res = await tier.store([_key(200)], [memoryview(_row(200))])
        assert res.evicted == (_key(6),)
    finally:
        await tier.aclose()
    assert _gone(segment_path(layout.namespace, str(tmp_path)))
