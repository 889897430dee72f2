"""Bad input, table-driven: each row gets its typed error and loses nothing stored.

One engine holds reference blocks (in the CPU tier and on file). Every row runs
against it (or opens an engine of its own, for bad configurations), must raise
exactly the typed error of the table, and afterwards every reference block must
still load with its own bytes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.filesystems import refusing_direct_io_dir
from support.slots import find_block

from kvtier import (
    BlockNotFoundError,
    CapacityError,
    ClosedError,
    ConfigurationError,
    DirectIOUnsupportedError,
    FileTierConfig,
    InvalidArgumentError,
    KVLayout,
    KVTierConfig,
    KVTierError,
    LayoutError,
    TierIOError,
    chain_keys,
)
from kvtier.engine import Engine
from kvtier.tiers.block_format import HEADER_BYTES, BlockHeader, decode_header, encode_header

sys.path.insert(0, str(Path(__file__).parent))
from workload import (
    BPC,
    NUM_BLOCKS,
    ROW,
    make_kv,
    make_layout,
    open_engine,
    verify_everything,
    write_blocks,
)


@dataclass
class Ctx:
    engine: Engine
    kv: list[torch.Tensor]
    tmp: Path
    stored: list[bytes]
    """Reference blocks, ready in the CPU tier (which they fill) and on file."""
    file_only: list[bytes]
    """Reference blocks evicted from the CPU tier: only on file."""


Row = tuple[str, Callable[[Ctx], Awaitable[Any]], type[BaseException]]


def keys(ctx: Ctx, n: int, salt: int = 7) -> list[bytes]:
    tokens = [salt * 1_000_000 + i for i in range(n * ctx.engine.block_tokens)]
    return chain_keys(tokens, ctx.engine.block_tokens, ctx.engine.namespace)


async def store(ctx: Ctx, k: Any, ids: Any) -> Any:
    return await ctx.engine.store(k, ids)


async def load(ctx: Ctx, k: Any, ids: Any, skip: Any = 0) -> Any:
    return await ctx.engine.load(k, ids, skip=skip)


async def lookup(ctx: Ctx, k: Any) -> Any:
    return ctx.engine.lookup(k)


async def open_with(ctx: Ctx, config: KVTierConfig, kv: Any = None, layout: Any = None) -> None:
    kv = make_kv() if kv is None else kv
    engine = await Engine.open(config, make_layout(make_kv()) if layout is None else layout, kv)
    await engine.aclose()


def config(**kw: Any) -> KVTierConfig:
    kw.setdefault("cpu_bytes_to_use", 8 * ROW)
    kw.setdefault("blocks_per_chunk", BPC)
    return KVTierConfig(**kw)


async def make_config(**kw: Any) -> KVTierConfig:
    return config(**kw)


def file_config(root: Path, **kw: Any) -> KVTierConfig:
    return config(file_tier=FileTierConfig(root=root, bytes_to_use=64 * (ROW + 4096), **kw))


async def bad_aclose(ctx: Ctx, seconds: Any) -> None:
    """A bad timeout is refused before the close starts: the engine stays usable."""
    kv = make_kv()
    engine = await Engine.open(config(), make_layout(kv), kv)
    try:
        await engine.aclose(seconds)
    finally:
        assert not engine.closed
        assert engine.lookup(keys(ctx, 1)) == 0
        await engine.aclose()


async def open_tp_rank(ctx: Ctx) -> None:
    kv = make_kv()
    layout = KVLayout.from_tensors(
        kv,
        model_id="m",
        block_tokens=4,
        blocks_per_chunk=BPC,
        num_blocks=NUM_BLOCKS,
        tp_rank=1,
        tp_size=2,
    )
    root = ctx.tmp / "ranked"
    # The open's refusal, not the layout's own checks (it is a valid layout).
    assert layout.tp_size == 2
    try:
        await open_with(ctx, file_config(root), kv=kv, layout=layout)
    finally:
        assert not root.exists(), "refused before anything was created"


async def namespace_json_of_the_wrong_shape(ctx: Ctx) -> None:
    kv = make_kv()
    layout = make_layout(kv)
    root = ctx.tmp / "described"
    ns_dir = root / layout.namespace.hex()
    ns_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    (ns_dir / "namespace.json").write_text("[1, 2]")
    await open_with(ctx, file_config(root), kv=kv, layout=layout)


async def closed_engine_call(ctx: Ctx, what: str) -> None:
    kv = make_kv()
    engine = await Engine.open(config(), make_layout(kv), kv)
    k = keys(ctx, 1, salt=99)
    await engine.aclose()
    if what == "store":
        await engine.store(k, [0, 1])
    elif what == "load":
        await engine.load(k, [0, 1])
    else:
        engine.lookup(k)


async def corrupt_header_then_load(ctx: Ctx) -> None:
    """A block whose header was overwritten is a miss, never served, and quarantined."""
    k = keys(ctx, 1, salt=55)
    write_blocks(ctx.kv, k, [0, 1])
    await ctx.engine.store(k, [0, 1])
    await ctx.engine.flush()
    path, offset = find_block(ctx.tmp / "tier", k[0])
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff\xff", offset + 30)  # inside the header's key field
    finally:
        os.close(fd)
    # Make the CPU copy go away so that the load must come from the file.
    await evict_cpu(ctx)
    st = ctx.engine.statistics()
    assert ctx.engine.lookup(k) == 1  # the tier does not read files on lookup
    assert await ctx.engine.load(k, [0, 1]) == 0
    quarantined = st.tiers["file"].statistics.quarantined
    assert ctx.engine.statistics().tiers["file"].statistics.quarantined == quarantined + 1
    assert ctx.engine.lookup(k) == 0
    await ctx.engine.load(k, [0, 1])  # asked again: it is in no tier


async def foreign_namespace_file(ctx: Ctx) -> None:
    """A block planted from another layout's namespace is never loaded."""
    k = keys(ctx, 1, salt=66)
    write_blocks(ctx.kv, k, [0, 1])
    await ctx.engine.store(k, [0, 1])
    await ctx.engine.flush()
    path, offset = find_block(ctx.tmp / "tier", k[0])
    other_kv = make_kv()
    other = make_layout(other_kv, model="other-model")
    # Beside the open reference tier (160 slots), on the same root: a budget of
    # the root that leaves this namespace room for its own slots.
    other_cfg = config(
        file_tier=FileTierConfig(root=ctx.tmp / "tier", bytes_to_use=400 * (ROW + 4096))
    )
    engine = await Engine.open(other_cfg, other, other_kv)
    try:
        ok = chain_keys(list(range(engine.block_tokens)), engine.block_tokens, engine.namespace)
    finally:
        await engine.aclose()
    # The same bytes in the first slot of the other namespace's slot file, with
    # the key field rewritten to a key of that namespace (header checksum and
    # all, so only the namespace field tells them apart).
    with path.open("rb") as f:
        f.seek(offset)
        header = decode_header(memoryview(f.read(HEADER_BYTES)))
    forged = bytearray(HEADER_BYTES)
    encode_header(
        memoryview(forged),
        BlockHeader(ok[0], header.namespace, header.payload_bytes, header.payload_checksum),
    )
    other_file = ctx.tmp / "tier" / other.namespace.hex() / "blocks.dat"
    fd = os.open(other_file, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(forged), 0)
    finally:
        os.close(fd)
    engine = await Engine.open(other_cfg, other, other_kv)
    try:
        st = engine.statistics().tiers["file"].statistics
        assert st is not None
        assert st.quarantined == 1, "the foreign header is found and cleared at open"
        assert engine.lookup(ok) == 0
        await engine.load(ok, [0, 1])  # a miss: in no tier
    finally:
        await engine.aclose()


async def evict_cpu(ctx: Ctx) -> None:
    """Fill the CPU tier with other blocks so that earlier ones live on file only."""
    st = ctx.engine.statistics()
    for salt in range(200, 200 + st.tiers["cpu"].statistics.capacity):
        k = keys(ctx, 1, salt=salt)
        write_blocks(ctx.kv, k, [2, 3])
        await ctx.engine.store(k, [2, 3])
    await ctx.engine.flush()


async def root_without_direct_io(ctx: Ctx) -> None:
    with refusing_direct_io_dir(ctx.tmp) as root:
        await open_with(ctx, file_config(root, direct_io="require"))


async def concurrent_aclose(ctx: Ctx) -> None:
    kv = make_kv()
    engine = await Engine.open(file_config(ctx.tmp / "other"), make_layout(kv), kv)
    await asyncio.gather(engine.aclose(), engine.aclose(), engine.aclose())
    assert engine.closed
    engine.lookup([])  # closed now


def tensor_rows() -> list[Row]:
    def kv_with(change: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
        return lambda ctx: open_with(ctx, config(), kv=change(make_kv()))

    return [
        ("tensor-wrong-dtype", kv_with(lambda kv: [t.float() for t in kv]), LayoutError),
        (
            "tensor-wrong-shape",
            kv_with(lambda kv: [t[:, :, :2].contiguous() for t in kv]),
            LayoutError,
        ),
        ("tensor-non-contiguous", kv_with(lambda kv: [t.transpose(2, 3) for t in kv]), LayoutError),
        ("tensor-missing", kv_with(lambda kv: kv[:1]), LayoutError),
        (
            "tensor-fewer-blocks",
            kv_with(lambda kv: [t[:, :10].contiguous() for t in kv]),
            LayoutError,
        ),
        (
            "layout-mixed-devices",
            lambda ctx: asyncio.sleep(
                0,
                KVLayout.from_tensors(
                    [make_kv()[0], torch.empty(2, NUM_BLOCKS, 4, 128, device="meta")],
                    model_id="m",
                    block_tokens=4,
                ),
            ),
            LayoutError,
        ),
    ]


ROWS: list[Row] = [
    *tensor_rows(),
    ("key-not-bytes", lambda c: store(c, ["a" * 16], [0, 1]), InvalidArgumentError),
    ("key-short", lambda c: store(c, [b"x" * 15], [0, 1]), InvalidArgumentError),
    ("key-long", lambda c: lookup(c, [b"x" * 17]), InvalidArgumentError),
    ("keys-duplicated", lambda c: store(c, keys(c, 1) * 2, [0, 1, 2, 3]), InvalidArgumentError),
    ("keys-a-bytes-object", lambda c: lookup(c, b"x" * 16), InvalidArgumentError),
    ("ids-too-few", lambda c: store(c, keys(c, 2), [0, 1, 2]), InvalidArgumentError),
    ("ids-too-many", lambda c: store(c, keys(c, 1), [0, 1, 2]), InvalidArgumentError),
    ("ids-out-of-range", lambda c: store(c, keys(c, 1), [0, NUM_BLOCKS]), InvalidArgumentError),
    ("ids-negative", lambda c: store(c, keys(c, 1), [-1, 0]), InvalidArgumentError),
    ("ids-duplicated", lambda c: store(c, keys(c, 1), [3, 3]), InvalidArgumentError),
    ("ids-float", lambda c: store(c, keys(c, 1), np.array([0.0, 1.0])), InvalidArgumentError),
    ("ids-2d", lambda c: store(c, keys(c, 1), np.array([[0, 1]])), InvalidArgumentError),
    ("ids-unknown-group", lambda c: store(c, keys(c, 1), {5: [0, 1]}), InvalidArgumentError),
    (
        "ids-missing-a-group",
        lambda c: store(c, keys(c, 2), {0: [60, 61, 62, 63]}),
        InvalidArgumentError,
    ),
    (
        "ids-group-named-by-a-string",
        lambda c: store(c, keys(c, 1), {"0": [60, 61], 1: [62, 63]}),
        InvalidArgumentError,
    ),
    (
        "load-file-only-missing-a-group",
        lambda c: load(c, c.file_only[:2], {1: [60, 61, 62, 63]}),
        InvalidArgumentError,
    ),
    (
        "load-file-only-ids-out-of-range",
        lambda c: load(c, c.file_only[:1], [60, NUM_BLOCKS]),
        InvalidArgumentError,
    ),
    ("load-never-stored", lambda c: load(c, keys(c, 1, salt=12345), [0, 1]), BlockNotFoundError),
    ("load-skip-too-big", lambda c: load(c, c.stored[:1], [0, 1], skip=BPC), InvalidArgumentError),
    ("load-skip-negative", lambda c: load(c, c.stored[:1], [0, 1], skip=-1), InvalidArgumentError),
    ("load-skip-bool", lambda c: load(c, c.stored[:1], [0], skip=True), InvalidArgumentError),
    ("load-ids-mismatch", lambda c: load(c, c.stored[:2], [0, 1]), InvalidArgumentError),
    ("budget-zero", lambda c: make_config(cpu_bytes_to_use=0), ConfigurationError),
    ("budget-negative", lambda c: make_config(cpu_bytes_to_use=-5), ConfigurationError),
    ("budget-below-a-row", lambda c: open_with(c, config(cpu_bytes_to_use=ROW - 1)), CapacityError),
    ("budget-absurd", lambda c: open_with(c, config(cpu_bytes_to_use="1000PiB")), CapacityError),
    ("budget-bool", lambda c: make_config(cpu_bytes_to_use=True), ConfigurationError),
    (
        "budget-past-64-bits",
        lambda c: make_config(cpu_bytes_to_use=2**64 + 8192),
        ConfigurationError,
    ),
    ("budget-fraction", lambda c: make_config(cpu_bytes_to_use=8192.5), ConfigurationError),
    (
        "budget-beyond-memory",
        lambda c: open_with(c, config(cpu_bytes_to_use="64TiB")),
        CapacityError,
    ),
    (
        "file-budget-bool",
        lambda c: make_config(file_tier={"root": str(c.tmp / "z"), "bytes_to_use": True}),
        ConfigurationError,
    ),
    ("layout-tp-rank-of-two", open_tp_rank, LayoutError),
    ("aclose-negative-timeout", lambda c: bad_aclose(c, -1), InvalidArgumentError),
    ("aclose-nan-timeout", lambda c: bad_aclose(c, float("nan")), InvalidArgumentError),
    ("aclose-str-timeout", lambda c: bad_aclose(c, "30"), InvalidArgumentError),
    (
        "blocks-per-chunk-mismatch",
        lambda c: open_with(c, config(blocks_per_chunk=3)),
        ConfigurationError,
    ),
    (
        "file-budget-zero",
        lambda c: make_config(file_tier={"root": str(c.tmp / "z"), "bytes_to_use": 0}),
        ConfigurationError,
    ),
    (
        "queue-depth-zero",
        lambda c: make_config(
            file_tier={"root": str(c.tmp / "z"), "bytes_to_use": "1GiB", "queue_depth": 0}
        ),
        ConfigurationError,
    ),
    (
        "root-is-a-file",
        lambda c: open_with(c, file_config(Path("/etc/hostname"))),
        ConfigurationError,
    ),
    (
        "root-unwritable",
        lambda c: open_with(c, file_config(Path("/proc/kvtier-root"))),
        TierIOError,
    ),
    ("root-without-o-direct", root_without_direct_io, DirectIOUnsupportedError),
    ("namespace-json-a-list", namespace_json_of_the_wrong_shape, TierIOError),
    ("corrupted-header", corrupt_header_then_load, BlockNotFoundError),
    ("foreign-namespace-file", foreign_namespace_file, BlockNotFoundError),
    ("store-after-aclose", lambda c: closed_engine_call(c, "store"), ClosedError),
    ("load-after-aclose", lambda c: closed_engine_call(c, "load"), ClosedError),
    ("lookup-after-aclose", lambda c: closed_engine_call(c, "lookup"), ClosedError),
    ("concurrent-aclose", concurrent_aclose, ClosedError),
]


def test_table_is_big_enough(report: dict[str, object]) -> None:
    assert len(ROWS) >= 25
    assert len({r[0] for r in ROWS}) == len(ROWS)
    report.update(bad_inputs_tried=len(ROWS), errors=sorted({r[2].__name__ for r in ROWS}))


CHANGES_STATE = {"corrupted-header", "foreign-namespace-file"}
"""Rows that store blocks of their own before the bad step (and so may evict)."""


@pytest.mark.parametrize(("name", "call", "error"), ROWS, ids=[r[0] for r in ROWS])
async def test_bad_input_is_typed_and_loses_nothing(
    tmp_path: Path, name: str, call: Callable[[Ctx], Awaitable[Any]], error: type[BaseException]
) -> None:
    async with open_engine(tmp_path / "tier", cpu_rows=12, groups=(0, 1)) as (engine, kv):
        # Fill the CPU tier, so that a store or promotion that got as far as
        # placing blocks would evict (the bad call must fail before that).
        rows = engine.statistics().tiers["cpu"].statistics.capacity
        everything = chain_keys(
            list(range((rows + 4) * engine.block_tokens)), engine.block_tokens, engine.namespace
        )
        file_only, stored = everything[:4], everything[4:]
        for part, ids in ((file_only, range(4 * BPC)), (stored, range(rows * BPC))):
            write_blocks(kv, part, list(ids))
            await engine.store(part, list(ids))
            await engine.flush()
        assert engine.lookup(stored) == rows
        assert engine.statistics().tiers["cpu"].statistics.ready == rows
        ctx = Ctx(engine, kv, tmp_path, stored, file_only)
        before = _state(engine)
        with pytest.raises(error) as info:
            await call(ctx)
        assert isinstance(info.value, KVTierError)
        assert str(info.value)  # a message that says something
        if name not in CHANGES_STATE:
            assert _state(engine) == before, "a bad call changed what the engine holds"
        # Nothing already stored was lost, and the engine still works.
        assert engine.lookup(stored) == len(stored)
        assert await verify_everything(engine, kv, set(everything)) == 0
        st = engine.statistics()
        assert st.tiers["cpu"].statistics.pinned == 0
        assert st.front.in_flight == 0


FAILED_OPENS = [
    "budget-beyond-memory",
    "namespace-json-a-list",
    "root-is-a-file",
    "layout-tp-rank-of-two",
    "tensor-wrong-shape",
]


OPENS = 20


@pytest.mark.parametrize("name", FAILED_OPENS)
async def test_a_failed_open_releases_everything(tmp_path: Path, name: str) -> None:
    call = next(row[1] for row in ROWS if row[0] == name)
    ctx = Ctx(None, [], tmp_path, [], [])  # type: ignore[arg-type]  # opens need no engine
    # The loop's default thread pool starts threads (each a stack mapping) as
    # load demands: give it all its threads now, so that any mapping counted
    # later was left by an open.
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=4)
    loop.set_default_executor(pool)
    started = threading.Barrier(4)
    await asyncio.gather(*(asyncio.to_thread(started.wait, 10) for _ in range(4)))
    try:
        with pytest.raises(KVTierError):
            await call(ctx)  # once first: caches settle
        gc.collect()
        maps, fds = _mappings(), _descriptors()
        for _ in range(OPENS):
            with pytest.raises(KVTierError):
                await call(ctx)
        gc.collect()
        # A leak grows with every open; threads of other parts of the process
        # (a stack mapping each) come and go by one or two whatever the opens do.
        assert _mappings() - maps < OPENS // 4
        assert _descriptors() <= fds
    finally:
        pool.shutdown(wait=False)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return len(f.readlines())


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def _state(engine: Engine) -> tuple[int, ...]:
    tiers = engine.statistics().tiers
    cpu, file = tiers["cpu"].statistics, tiers["file"].statistics
    return (cpu.ready, cpu.evictions, cpu.used, file.blocks, file.evictions)
