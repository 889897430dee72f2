"""Scheduler and workers in separate processes: real spawned workers, CPU tensors per rank."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from support.processes import Children

from kvtier import (
    BusyError,
    InvalidArgumentError,
    KVTierConfig,
    LayoutError,
    ProtocolError,
    SharedRegionError,
    TransferError,
    WorkerError,
    WorkerLostError,
    chain_keys,
)
from kvtier.engine import Engine
from kvtier.region import CPURegion
from kvtier.transfer.device import DeviceTransfer
from kvtier.workers import Worker, WorkerGroup, WorkerThread
from kvtier.workers.jobs import (
    PIPE_BUF,
    Hello,
    JobDone,
    JobSpec,
    Notice,
    decode,
    pack_record,
    unpack_records,
)

sys.path.insert(0, str(Path(__file__).parent))
from _worker import NUM_BLOCKS, Held, layout_of, make_kv

SCRIPT = Path(__file__).with_name("_worker.py")


def shm_files(group: WorkerGroup) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if group.instance.hex() in n]


class Procs(Children):
    """Worker processes of one test; every one still running at the end is killed."""

    def spawn(  # type: ignore[override]
        self, address: str, rank: int, world: int, mode: str = "serve"
    ) -> subprocess.Popen[str]:
        return super().spawn(str(SCRIPT), address, rank, world, mode)

    @staticmethod
    async def line(proc: subprocess.Popen[str]) -> dict[str, Any]:  # type: ignore[override]
        return await asyncio.wait_for(asyncio.to_thread(Children.line, proc), 30)


@pytest.fixture
def procs() -> Iterator[Procs]:
    group = Procs()
    yield group
    group.kill_all()


def config(world: int) -> KVTierConfig:
    return KVTierConfig(cpu_bytes_to_use=1 << 20, world_size=world)


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"world{w}")
async def test_every_rank_loads_back_its_own_bytes(procs: Procs, world: int) -> None:
    group = WorkerGroup.bind(world)
    workers = [procs.spawn(group.address, r, world) for r in range(world)]
    engine = await Engine.open(
        config(world), layout_of(make_kv(0), 0, world), workers=group, worker_timeout=60
    )
    try:
        assert [(await Procs.line(p))["attached"] for p in workers] == [True] * world
        assert shm_files(group) == []  # every party attached: the name is gone
        keys = chain_keys(list(range(32)), engine.block_tokens, engine.namespace)[:4]
        summary = await engine.store(keys, [0, 1, 2, 3])
        assert summary.stored == 4
        assert engine.lookup(keys) == 4
        assert await engine.load(keys, [8, 9, 10, 11]) == 4
        for p in workers:
            assert p.stdin is not None
            p.stdin.write("check 0 8 4\n")
            p.stdin.flush()
        assert [(await Procs.line(p))["same"] for p in workers] == [True] * world
        stats = engine.statistics()
        assert stats.tiers["cpu"].written_bytes == 4 * world * engine.layout.bytes_per_chunk
    finally:
        await engine.aclose()
    assert [(await Procs.line(p))["ending"] for p in workers] == ["stopped"] * world
    assert [p.wait(timeout=20) for p in workers] == [0] * world
    assert shm_files(group) == []
    assert not Path(group.address.removeprefix("ipc://")).parent.exists()


async def test_a_worker_killed_in_a_job_fails_it_and_breaks_the_group(procs: Procs) -> None:
    world = 2
    group = WorkerGroup.bind(world)
    workers = [procs.spawn(group.address, 0, world), procs.spawn(group.address, 1, world, "slow")]
    engine = await Engine.open(
        config(world), layout_of(make_kv(0), 0, world), workers=group, worker_timeout=60
    )
    try:
        for p in workers:
            await Procs.line(p)
        keys = chain_keys(list(range(32)), engine.block_tokens, engine.namespace)[:4]
        store = asyncio.ensure_future(engine.store(keys, [0, 1, 2, 3]))
        await asyncio.sleep(0.3)  # rank 0 has reported; rank 1 sits on its report
        assert not store.done()
        os.kill(workers[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            await asyncio.wait_for(store, 5)
        assert time.monotonic() - t0 < 2
        assert info.value.rank == 1
        assert engine.lookup(keys) == 0  # nothing half-copied is served
        with pytest.raises(TransferError, match="broken"):
            await engine.store(keys, [0, 1, 2, 3])
    finally:
        await engine.aclose()
    assert (await Procs.line(workers[0]))["ending"] == "stopped"
    assert shm_files(group) == []


# -- bad input: workers in this process (fast), real sockets and a real shared region ----


@pytest.fixture
async def split() -> AsyncIterator[tuple[Engine, WorkerGroup, list[asyncio.Task[str]]]]:
    """A world-size-2 instance whose workers run as tasks of this event loop."""
    group = WorkerGroup.bind(2)
    kvs = [make_kv(r) for r in range(2)]

    async def serve(r: int) -> str:
        worker = await Worker.open(group.address, layout_of(kvs[r], r, 2), kvs[r])
        return await worker.serve()

    tasks = [asyncio.create_task(serve(r)) for r in range(2)]
    engine = await Engine.open(config(2), layout_of(kvs[0], 0, 2), workers=group)
    keys = chain_keys(list(range(32)), engine.block_tokens, engine.namespace)[:2]
    await engine.store(keys, [0, 1])
    yield engine, group, tasks
    # Nothing stored was lost to the bad input.
    assert await engine.load(keys, [8, 9]) == 2
    assert all(torch.equal(kvs[r][0][:, 8:10], kvs[r][0][:, 0:2]) for r in range(2))
    await engine.aclose()
    assert await asyncio.gather(*tasks) == ["stopped", "stopped"]


Split = tuple[Engine, WorkerGroup, list["asyncio.Task[str]"]]


async def test_a_worker_with_another_layout_is_refused(split: Split) -> None:
    _, group, _ = split
    kv = [torch.zeros(2, NUM_BLOCKS, 4, 64, dtype=torch.float16)]
    with pytest.raises(LayoutError, match="tensors"):
        await Worker.open(group.address, layout_of(kv, 1, 2), kv, timeout=10)


async def test_a_second_worker_for_a_rank_is_refused(split: Split) -> None:
    _, group, _ = split
    kv = make_kv(1)
    with pytest.raises(BusyError, match="rank 1 is already held"):
        await Worker.open(group.address, layout_of(kv, 1, 2), kv, timeout=10)


async def test_a_rank_outside_the_world_is_refused(split: Split) -> None:
    engine, group, _ = split
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(group.address)
        desc = engine.layout.describe(include_rank=True)
        await sock.send_multipart(Hello(7, os.getpid(), engine.namespace.hex(), desc).encode())
        answer = decode(await asyncio.wait_for(sock.recv_multipart(), 10))
    finally:
        sock.close(linger=0)
        ctx.term()
    assert answer == Notice("refused", "InvalidArgumentError", "rank 7 is outside [0, 2)")


async def test_another_instance_cannot_join_the_region() -> None:
    group = WorkerGroup.bind(2)
    kvs = [make_kv(r) for r in range(2)]
    layout = layout_of(kvs[0], 0, 2)
    opening = asyncio.ensure_future(Engine.open(config(2), layout, workers=group))
    name = f"i{group.instance.hex()}"
    while not shm_files(group):  # noqa: ASYNC110 - the region file appears from a thread
        await asyncio.sleep(0.01)
    # The name is live until every rank attached: a rank of another instance
    # (another token), or a second scheduler, is refused.
    with pytest.raises(SharedRegionError, match="instance"):
        CPURegion.create(layout, 1 << 20, world_size=2, rank=1, shared_name=name, pin="off")
    with pytest.raises(SharedRegionError, match="in use by another instance"):
        CPURegion.create(layout, 1 << 20, world_size=2, rank=None, shared_name=name, pin="off")
    workers = [
        asyncio.ensure_future(
            (await Worker.open(group.address, layout_of(kvs[r], r, 2), kvs[r])).serve()
        )
        for r in range(2)
    ]
    engine = await opening
    keys = chain_keys(list(range(8)), engine.block_tokens, engine.namespace)[:1]
    assert (await engine.store(keys, [0])).stored == 1
    await engine.aclose()
    assert await asyncio.gather(*workers) == ["stopped", "stopped"]
    assert shm_files(group) == []


async def test_engine_open_checks_the_split() -> None:
    kv = make_kv(0)
    group = WorkerGroup.bind(2)
    with pytest.raises(InvalidArgumentError, match="no kv_caches"):
        await Engine.open(config(2), layout_of(kv, 0, 2), kv, workers=group)
    assert not Path(group.address.removeprefix("ipc://")).parent.exists()


async def test_cancelled_tasks_under_load_leave_nothing_pinned_or_wrong(procs: Procs) -> None:
    world = 2
    group = WorkerGroup.bind(world)
    workers = [procs.spawn(group.address, r, world) for r in range(world)]
    engine = await Engine.open(
        config(world), layout_of(make_kv(0), 0, world), workers=group, worker_timeout=60
    )
    rng = random.Random(1616)
    try:
        for p in workers:
            await Procs.line(p)

        def chain(t: int) -> list[bytes]:
            return chain_keys(list(range(16 * t, 16 * t + 16)), 4, engine.namespace)

        async def one(t: int) -> None:
            # Chain t always comes from device blocks t % 5 ..: its bytes are known.
            keys = chain(t)
            if rng.random() < 0.5 and (hits := engine.lookup(keys)):
                start = 8 + 4 * rng.randrange(2)
                await engine.load(keys[:hits], list(range(start, start + hits)))
            else:
                await engine.store(keys, list(range(t % 5, t % 5 + 4)))

        tasks = [asyncio.ensure_future(one(rng.randrange(24))) for _ in range(300)]
        cancelled = 0
        for task in tasks:
            if rng.random() < 0.3:
                await asyncio.sleep(rng.uniform(0, 0.002))
                cancelled += task.cancel()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
        assert [r for r in results if not isinstance(r, (asyncio.CancelledError, type(None)))] == []
        assert cancelled > 0
        await engine.flush()
        stats = engine.statistics()
        cpu = stats.tiers["cpu"].statistics
        assert (cpu.pinned, cpu.being_written, stats.front.in_flight) == (0, 0, 0)
        # Every chain still found loads each rank's own bytes.
        checked = 0
        for t in range(24):
            hits = engine.lookup(chain(t))
            if hits:
                n = await engine.load(chain(t)[:hits], list(range(8, 8 + hits)))
                for p in workers:
                    Children.tell(p, f"check {t % 5} 8 {n}")
                assert [(await Procs.line(p))["same"] for p in workers] == [True] * world
                checked += 1
        assert checked > 0
    finally:
        await engine.aclose()
    assert [(await Procs.line(p))["ending"] for p in workers] == ["stopped"] * world
    assert shm_files(group) == []


async def test_a_worker_refuses_a_job_for_rows_another_job_uses() -> None:
    group = WorkerGroup.bind(1)
    kv = make_kv(0)
    held: list[Held] = []

    def wrap(inner: DeviceTransfer) -> DeviceTransfer:
        held.append(Held(inner))
        return held[0]

    async def serve() -> str:
        worker = await Worker.open(group.address, layout_of(kv, 0, 1), kv, wrap_transfer=wrap)
        return await worker.serve()

    serving = asyncio.create_task(serve())
    engine = await Engine.open(config(1), layout_of(kv, 0, 1), workers=group)
    try:
        first = group.store([0], [3])  # row 3 is being written on the worker
        with pytest.raises(WorkerError, match="not pinned for it") as info:
            await group.load([3], [8])
        assert info.value.rank == 0
        with pytest.raises(WorkerError, match="InvalidArgumentError"):
            await group.store([1, 2], [3, 4])
        assert not first.done()
        held[0].release.set()
        await first
        await group.load([3], [8])  # the row is free again once its store is over
        assert torch.equal(kv[0][:, 8], kv[0][:, 0])
    finally:
        held[0].release.set()
        await engine.aclose()
    assert await serving == "stopped"


async def store_until_refused(engine: Engine) -> None:
    """Store fresh blocks until a job is refused (a worker of this process has no pidfd
    of its own to watch: the scheduler learns of its exit when the socket cannot reach it)."""
    for i in range(100):
        keys = chain_keys(list(range(100 + 8 * i, 108 + 8 * i)), 4, engine.namespace)
        await engine.store(keys, [2, 3])
        await asyncio.sleep(0.05)


async def test_a_worker_serves_from_a_thread_of_its_own() -> None:
    kv = make_kv(0)
    layout = layout_of(kv, 0, 1)
    for how in ("scheduler closes", "worker stops"):
        group = WorkerGroup.bind(1)
        opening = asyncio.ensure_future(Engine.open(config(1), layout, workers=group))
        # The calling thread (a model's main thread) gets control back once attached.
        handle = await asyncio.to_thread(WorkerThread.start, group.address, layout, kv)
        engine = await opening
        try:
            keys = chain_keys(list(range(8)), engine.block_tokens, engine.namespace)
            assert (await engine.store(keys, [0, 1])).stored == 2
            assert await engine.load(keys, [8, 9]) == 2
            assert torch.equal(kv[0][:, 8:10], kv[0][:, 0:2])
            if how == "worker stops":
                assert await asyncio.to_thread(handle.stop, 10) == "stopped"
                with pytest.raises(WorkerLostError):
                    await store_until_refused(engine)
        finally:
            await engine.aclose()
        assert await asyncio.to_thread(handle.join, 10) == "stopped"
        assert not handle.alive


def test_pipe_records_come_back_whole_and_in_order() -> None:
    jobs = [JobSpec(i, "load", np.arange(i, dtype=np.int64), {0: np.arange(i)}, 0) for i in (1, 5)]
    stream = bytearray(b"".join(pack_record(j.encode(), rank=3) for j in jobs))
    stream += pack_record(JobDone(9, "TransferError", "boom").encode(), rank=1)[:-2]
    records = unpack_records(stream)
    assert [r for r, _ in records] == [3, 3]
    got = [decode(frames) for _, frames in records]
    assert [(g.job, g.rows.tolist()) for g in got if isinstance(g, JobSpec)] == [
        (1, [0]),
        (5, [0, 1, 2, 3, 4]),
    ]
    assert len(stream) > 0  # the record cut short stays for the next read
    with pytest.raises(ProtocolError):
        # One frame of 100 bytes declared inside a record of 4.
        unpack_records(bytearray(struct.pack("<IIII", 4, 0, 1, 100)))


async def test_a_job_too_large_for_a_pipe_record_takes_the_socket() -> None:
    kv = make_kv(0)
    layout = layout_of(kv, 0, 1)
    group = WorkerGroup.bind(1)
    opening = asyncio.ensure_future(Engine.open(config(1), layout, workers=group))
    handle = await asyncio.to_thread(WorkerThread.start, group.address, layout, kv)
    engine = await opening
    try:
        rows = list(range(group._rows))
        record = pack_record(JobSpec(0, "store", np.array(rows), {0: np.zeros(len(rows))}).encode())
        assert len(record) > PIPE_BUF
        await group.store([5] * len(rows), rows)  # every row gets device block 5
        await group.load([len(rows) - 1], [12])
        assert torch.equal(kv[0][:, 12], kv[0][:, 5])
    finally:
        await engine.aclose()
    assert await asyncio.to_thread(handle.join, 10) == "stopped"
