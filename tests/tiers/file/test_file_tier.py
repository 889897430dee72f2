"""The file tier's slot file (``blocks.dat``) on real O_DIRECT files, with both I/O engines.

Nothing is mocked: what the tier left on disk is checked by reading the slots
of ``blocks.dat`` back with ordinary ``pread`` (slot ``i`` starts at byte
``i * FILE``, see :meth:`FileTier.slot_of`), and corruption, torn writes and
crash leftovers are made by writing into the slots with ``pwrite`` before a
load or a reopen. Faults the kernel cannot be made to give on demand (EIO, a
short transfer) come from :class:`~kvtier.testing.io_engine.FaultyEngine`,
which wraps a real engine.
"""

from __future__ import annotations

import asyncio
import errno
import json
import mmap
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import pytest_asyncio
from support.filesystems import refusing_direct_io_dir

from kvtier.config import FileTierConfig
from kvtier.errors import (
    AlignmentError,
    BlockNotFoundError,
    CapacityError,
    ClosedError,
    DirectIOUnsupportedError,
    IntegrityError,
    InvalidArgumentError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import FaultyEngine, aligned_buffer, cancel_one_awaiter
from kvtier.tiers.block_format import (
    HEADER_BYTES,
    BlockHeader,
    checksum,
    decode_header,
    encode_header,
)
from kvtier.tiers.file import TIER_FORMAT_VERSION, FileTier
from kvtier.transfer import _ring
from kvtier.transfer.io_engine import EngineKind, IOEngine, open_io_engine, probe_io_uring

BLOCK = 8192
FILE = HEADER_BYTES + BLOCK
ENGINES = ["threads"] if probe_io_uring() else ["io_uring", "threads"]
ZERO_HEADER = bytes(HEADER_BYTES)


def make_layout(model: str = "m") -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


NAMESPACE = make_layout().namespace


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


class Rows:
    """Page-aligned rows in one anonymous mapping, like a CPU region."""

    def __init__(self, n: int) -> None:
        self.map = aligned_buffer(n * BLOCK)
        self.n = n

    def row(self, i: int) -> memoryview:
        return memoryview(self.map)[i * BLOCK : (i + 1) * BLOCK]

    def rows(self) -> list[memoryview]:
        return [self.row(i) for i in range(self.n)]

    def fill(self, seed: int) -> Rows:
        for i in range(self.n):
            self.map[i * BLOCK : (i + 1) * BLOCK] = bytes([(seed + i) & 0xFF]) * BLOCK
        return self


def pattern(key: bytes) -> bytes:
    """A payload that is a function of its key, so any load or slot can be checked."""
    return key * (BLOCK // len(key))


def pattern_rows(ks: list[bytes]) -> Rows:
    rows = Rows(len(ks))
    for i, k in enumerate(ks):
        rows.map[i * BLOCK : (i + 1) * BLOCK] = pattern(k)
    return rows


OpenTier = Callable[..., Any]


@pytest.fixture(params=ENGINES)
def engine_kind(request: pytest.FixtureRequest) -> EngineKind:
    kind: EngineKind = request.param
    return kind


@pytest_asyncio.fixture
async def open_tier(tmp_path: Path, engine_kind: EngineKind) -> AsyncIterator[OpenTier]:
    opened: list[FileTier] = []

    async def _open(
        *,
        root: Path | None = None,
        blocks: int = 16,
        budget: int | None = None,
        layout: KVLayout | None = None,
        io_engine: IOEngine | None = None,
        **cfg: Any,
    ) -> FileTier:
        config = FileTierConfig(
            root=root or tmp_path / "tier",
            bytes_to_use=budget or FileTier.budget_for(blocks, BLOCK),
            io_engine=engine_kind,
            queue_depth=4,
            **cfg,
        )
        tier = await FileTier.open(
            config, layout or make_layout(), block_bytes=BLOCK, io_engine=io_engine
        )
        opened.append(tier)
        return tier

    yield _open
    for tier in opened:
        await tier.aclose()


# -- reading and writing the slot file behind the tier's back ----------------------------


def data_file(tier: FileTier) -> Path:
    return tier.path / "blocks.dat"


def read_at(path: Path, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
    finally:
        os.close(fd)


def header_page(path: Path, slot: int) -> bytes:
    page = read_at(path, slot * FILE, HEADER_BYTES)
    assert len(page) == HEADER_BYTES
    return page


def slot_header(path: Path, slot: int) -> BlockHeader | None:
    """The decoded header of ``slot``, or None for a free (zero) one; raises if invalid."""
    page = header_page(path, slot)
    return None if page == ZERO_HEADER else decode_header(memoryview(page))


def slot_of(tier: FileTier, key: bytes) -> int:
    slot = tier.slot_of(key)
    assert slot is not None, f"{key.hex()} has no slot"
    return slot


async def store_blocks(tier: FileTier, ks: list[bytes]) -> dict[bytes, int]:
    """Store the pattern of each key; the file slot each block landed in."""
    await tier.store(ks, pattern_rows(ks).rows())
    return {k: slot_of(tier, k) for k in ks}


def slot_payload(path: Path, slot: int, key: bytes, namespace: bytes = NAMESPACE) -> bytes:
    """The payload of ``slot``, after checking that its header describes it as ``key``'s."""
    header = slot_header(path, slot)
    assert header is not None, f"slot {slot} is free"
    assert header.key == key
    assert header.namespace == namespace
    assert header.payload_bytes == BLOCK
    payload = read_at(path, slot * FILE + HEADER_BYTES, BLOCK)
    assert header.payload_checksum == checksum(memoryview(payload))
    return payload


def make_slot(
    key: bytes,
    payload: bytes,
    *,
    stored_at: int,
    namespace: bytes = NAMESPACE,
    payload_bytes: int | None = None,
) -> bytes:
    """Header page + payload of a block, as the tier writes one into a slot."""
    page = bytearray(HEADER_BYTES)
    header = BlockHeader(
        key,
        namespace,
        len(payload) if payload_bytes is None else payload_bytes,
        checksum(memoryview(payload)),
        stored_at=stored_at,
    )
    encode_header(memoryview(page), header)
    return bytes(page) + payload


async def eventually(check: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``check()`` holds (slot zeroing and quarantine copies
    finish in the background, after the call that caused them has returned)."""
    deadline = time.monotonic() + 5.0
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def assert_disk_matches(tier: FileTier, space: list[bytes]) -> None:
    """At rest: every resident block of ``space`` in its own slot, verified, usage exact."""
    path = data_file(tier)
    stats = tier.statistics()
    assert path.stat().st_size == stats.capacity_bytes
    resident = [k for k in space if k in tier]
    slots = {k: slot_of(tier, k) for k in resident}
    assert len(set(slots.values())) == len(resident)
    for k, s in slots.items():
        assert 0 <= s < stats.capacity_bytes // FILE
        assert slot_payload(path, s, k) == pattern(k)
    assert not list((tier.path / "tmp").iterdir())
    assert stats.blocks == len(resident)
    assert stats.used_bytes == len(resident) * FILE <= stats.capacity_bytes


# -- round trips ------------------------------------------------------------------------


async def test_store_load_round_trip(open_tier: OpenTier, engine_kind: EngineKind) -> None:
    before = int(time.time())
    tier = await open_tier()
    ks = keys(5)
    src = Rows(5).fill(1)
    result = await tier.store(ks, src.rows())
    assert result.stored == tuple(ks)
    assert not result.failed
    assert not result.skipped
    assert tier.lookup(ks) == 5
    assert all(k in tier and tier.is_ready(k) for k in ks)
    dst = Rows(5)
    loaded = await tier.load(ks, dst.rows())
    assert loaded.loaded == tuple(ks)
    assert not loaded.missing
    assert dst.map[:] == src.map[:]
    again = await tier.store(ks[:2], src.rows()[:2])
    assert again.skipped == tuple(ks[:2])
    assert again.stored == ()
    stats = tier.statistics()
    assert stats.io_engine == engine_kind
    assert stats.direct_io
    assert stats.direct_io_fallback is None
    assert stats.blocks == 5
    assert stats.used_bytes == 5 * FILE
    assert stats.hits == 5
    assert stats.bytes_read == stats.bytes_written == 5 * BLOCK
    assert stats.write_gbps > 0
    assert stats.read_gbps > 0
    # One slot file of the whole budget; each block in its own slot, header and
    # payload written together, stamped with its store time.
    path = data_file(tier)
    assert stats.capacity_bytes == 16 * FILE == path.stat().st_size
    assert stats.file_bytes == FILE
    slots = [slot_of(tier, k) for k in ks]
    assert len(set(slots)) == 5
    for i, (k, s) in enumerate(zip(ks, slots, strict=True)):
        assert slot_payload(path, s, k) == src.row(i)
        header = slot_header(path, s)
        assert header is not None
        assert before <= header.stored_at <= int(time.time())
    assert sorted(p.name for p in tier.path.iterdir()) == [
        "blocks.dat",
        "index",
        "lock",
        "namespace.json",
        "quarantine",
        "tmp",
    ]


async def test_missing_keys_are_misses(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(3)
    await tier.store(ks[:1], Rows(1).fill(2).rows())
    result = await tier.load(ks, Rows(3).rows())
    assert result.loaded == (ks[0],)
    assert set(result.missing) == set(ks[1:])
    assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
    assert tier.lookup(ks) == 1
    assert tier.statistics().misses == 2


async def test_fsync_durability_round_trip(open_tier: OpenTier) -> None:
    tier = await open_tier(durability="fsync")
    ks = keys(3)
    src = Rows(3).fill(9)
    assert (await tier.store(ks, src.rows())).stored == tuple(ks)
    dst = Rows(3)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == src.map[:]
    assert tier.statistics().durability == "fsync"


async def test_cancelled_awaiter_does_not_cancel_store(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(4)
    done = tier.store(ks, pattern_rows(ks).rows())
    await cancel_one_awaiter(done)
    assert (await done).stored == tuple(ks)
    assert tier.lookup(ks) == 4
    assert_disk_matches(tier, ks)


async def test_unaligned_buffer_refused_before_io(open_tier: OpenTier) -> None:
    tier = await open_tier()
    buf = mmap.mmap(-1, 2 * BLOCK)
    with pytest.raises(AlignmentError) as info:
        tier.store(keys(1), [memoryview(buf)[512 : 512 + BLOCK]])
    assert info.value.alignment == 4096
    assert tier.lookup(keys(1)) == 0
    assert keys(1)[0] not in tier
    await tier.aclose()
    # Nothing reached the slot file.
    path = data_file(tier)
    assert all(header_page(path, s) == ZERO_HEADER for s in range(16))
    assert not list((tier.path / "tmp").iterdir())


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
async def test_bad_buffers_refused_by_either_check(
    open_tier: OpenTier, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """The compiled check of a call's buffers and the Python one refuse the same
    buffers with the same typed errors, and accept the same ones (viewed as bytes)."""
    from kvtier.tiers.file import _buffers

    if not compiled:
        monkeypatch.setattr(_buffers, "_check_views_c", None)
    elif _buffers._check_views_c is None:
        pytest.skip("the compiled helper kvtier.transfer._address is not built")
    tier = await open_tier()
    ks = keys(3)
    src = pattern_rows(ks)
    assert (await tier.store(ks, src.rows())).stored == tuple(ks)
    good = Rows(3)
    cases: list[tuple[list[memoryview], type[Exception], str | None]] = [
        ([*good.rows()[:2], good.row(2).toreadonly()], InvalidArgumentError, "writable"),
        ([*good.rows()[:2], good.row(2)[: BLOCK // 2]], InvalidArgumentError, "has"),
        ([*good.rows()[:2], memoryview(good.map)[512 : 512 + BLOCK]], AlignmentError, None),
        ([*good.rows()[:2], memoryview(good.map)[::2][:BLOCK]], InvalidArgumentError, "contig"),
    ]
    for bufs, err, text in cases:
        with pytest.raises(err, match=text):
            tier.load(ks, bufs)
    # Accepted: a tuple of rows (the Python checks), one of them viewed as 2-D int32s.
    shaped = [good.row(0).cast("i", (BLOCK // 64, 16)), good.row(1), good.row(2)]
    assert (await tier.load(ks, tuple(shaped))).loaded == tuple(ks)
    assert good.map[:] == src.map[:]
    # The refused calls read nothing and left no block pinned.
    assert tier.statistics().hits == 3
    assert [tier._manager.pins(k) for k in ks] == [0, 0, 0]
    await tier.aclose()


async def test_load_with_a_missing_key_among_present_ones(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(5)
    src = pattern_rows(ks)
    await tier.store([ks[0], ks[1], ks[3], ks[4]], [src.row(i) for i in (0, 1, 3, 4)])
    dst = Rows(5)
    result = await tier.load(ks, dst.rows())
    assert result.loaded == (ks[0], ks[1], ks[3], ks[4])
    assert list(result.missing) == [ks[2]]
    for i in (0, 1, 3, 4):
        assert dst.row(i) == pattern(ks[i])
    assert dst.row(2) == bytes(BLOCK)
    # The blocks were unpinned once read, the missing one never pinned.
    assert [tier._manager.pins(k) for k in (ks[0], ks[1], ks[3], ks[4])] == [0, 0, 0, 0]
    tier.remove(ks)
    assert tier.lookup(ks) == 0
    assert (await tier.load([], [])).loaded == ()


# -- integrity --------------------------------------------------------------------------


async def test_bad_blocks_inside_long_runs_fail_alone(open_tier: OpenTier) -> None:
    """A load run spans several reaps (queue depth 4, runs of 8) and its sound
    blocks settle together with its last read: blocks that fail verification
    in the middle of runs are misses on their own, every other block of their
    runs loads, and nothing stays pinned."""
    n = 20
    tier = await open_tier(blocks=n)
    ks = keys(n)
    await tier.store(ks, pattern_rows(ks).rows())
    path = data_file(tier)
    bad = (2, 13)
    for i in bad:
        offset = slot_of(tier, ks[i]) * FILE + HEADER_BYTES + 7
        write_at(path, offset, bytes([read_at(path, offset, 1)[0] ^ 0x01]))
    dst = Rows(n)
    result = await tier.load(ks, dst.rows())
    sound = [k for i, k in enumerate(ks) if i not in bad]
    assert result.loaded == tuple(sound)
    assert set(result.missing) == {ks[i] for i in bad}
    assert all(isinstance(e, IntegrityError) for e in result.missing.values())
    for i in range(n):
        if i not in bad:
            assert dst.row(i) == pattern(ks[i])
    assert all(tier._manager.pins(k) == 0 for k in ks if k in tier)
    assert tier.statistics().hits == n - len(bad)
    assert tier.statistics().misses == len(bad)
    assert tier.lookup(sound) == len(sound)


@pytest.mark.parametrize("where", [HEADER_BYTES + 100, 30], ids=["payload", "header"])
async def test_flipped_byte_is_quarantined_miss(open_tier: OpenTier, where: int) -> None:
    tier = await open_tier()
    ks = keys(2)
    await tier.store(ks, pattern_rows(ks).rows())
    path = data_file(tier)
    slot = slot_of(tier, ks[0])
    offset = slot * FILE + where
    write_at(path, offset, bytes([read_at(path, offset, 1)[0] ^ 0x01]))
    corrupted = read_at(path, slot * FILE, FILE)
    dst = Rows(2)
    result = await tier.load(ks, dst.rows())
    assert result.loaded == (ks[1],)
    assert dst.row(1) == pattern(ks[1])
    err = result.missing[ks[0]]
    assert isinstance(err, IntegrityError)
    assert ("payload checksum" if where > HEADER_BYTES else "bad block header") in str(err)
    assert ks[0] not in tier
    assert tier.slot_of(ks[0]) is None
    assert tier.lookup(ks) == 0
    assert tier.statistics().quarantined == 1
    # The bytes as read are kept in quarantine/, and the slot is cleared.
    qdir = tier.path / "quarantine"
    await eventually(lambda: len(list(qdir.iterdir())) == 1, "the quarantine copy")
    await eventually(lambda: header_page(path, slot) == ZERO_HEADER, "the slot to be zeroed")
    (copy,) = qdir.iterdir()
    name = copy.name.split(".")
    assert name[0] == ks[0].hex()
    assert name[-1] == "IntegrityError"
    assert len(name) == 4
    assert copy.read_bytes() == corrupted
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    # Never served again, and its slot is free for a fresh copy.
    assert isinstance((await tier.load(ks[:1], Rows(1).rows())).missing[ks[0]], BlockNotFoundError)
    assert (await tier.store(ks[:1], pattern_rows(ks[:1]).rows())).stored == (ks[0],)
    assert_disk_matches(tier, ks)


async def test_small_blocks_register_nothing_and_still_verify(
    open_tier: OpenTier, engine_kind: EngineKind
) -> None:
    """Under SPLIT_MIN a block's header would need an entry of its own, which costs
    more than the pinning it saves: the tier registers nothing, and moves and
    verifies blocks as before (tests/transfer/test_registered_memory.py has the
    large blocks)."""
    assert BLOCK < _ring.SPLIT_MIN
    tier = await open_tier()
    ks = keys(6)
    src, dst = pattern_rows(ks), Rows(6)
    assert tier.register_memory([src.map, dst.map]) == 0
    assert tier.statistics().registered_bytes == 0
    dst.map.close()  # nothing holds it
    assert (await tier.store(ks, src.rows())).stored == tuple(ks)
    path = data_file(tier)
    # One payload byte flipped on disk: that block fails, the others load.
    offset = slot_of(tier, ks[2]) * FILE + HEADER_BYTES + 7
    write_at(path, offset, bytes([read_at(path, offset, 1)[0] ^ 0x20]))
    back = Rows(6)
    result = await tier.load(ks, back.rows())
    assert result.loaded == tuple(k for k in ks if k != ks[2])
    assert isinstance(result.missing[ks[2]], IntegrityError)
    for i, k in enumerate(ks):
        if k != ks[2]:
            assert back.row(i) == pattern(k)
    strided = memoryview(bytearray(4 * BLOCK))[::2]
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        tier.register_memory([strided])


async def test_truncated_slot_file_is_integrity_error(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(3)
    await tier.store(ks, pattern_rows(ks).rows())
    last = max(ks, key=lambda k: slot_of(tier, k))
    slot = slot_of(tier, last)
    # The slot file loses the second half of the last block's payload.
    os.truncate(data_file(tier), slot * FILE + HEADER_BYTES + 4096)
    result = await tier.load([last], Rows(1).rows())
    err = result.missing[last]
    assert isinstance(err, IntegrityError)
    assert f"short read of slot {slot}" in str(err)
    assert last not in tier
    assert tier.statistics().quarantined == 1
    # The blocks before it are intact.
    rest = [k for k in ks if k != last]
    dst = Rows(2)
    assert (await tier.load(rest, dst.rows())).loaded == tuple(rest)
    assert dst.map[:] == pattern_rows(rest).map[:]


async def test_block_from_another_namespace_never_hits(open_tier: OpenTier) -> None:
    # Two namespaces open on one root share its budget: a takes its 16 slots,
    # b a budget that leaves it 16 more.
    a = await open_tier(layout=make_layout("model-a"))
    b = await open_tier(layout=make_layout("model-b"), budget=2 * FileTier.budget_for(16, BLOCK))
    assert a.path != b.path
    ns_a, ns_b = make_layout("model-a").namespace, make_layout("model-b").namespace
    ks = keys(2)
    await a.store(ks, pattern_rows(ks).rows())
    assert b.lookup(ks) == 0
    assert isinstance((await b.load(ks, Rows(2).rows())).missing[ks[0]], BlockNotFoundError)
    a_slot = read_at(data_file(a), slot_of(a, ks[0]) * FILE, FILE)
    assert slot_payload(data_file(a), slot_of(a, ks[0]), ks[0], ns_a) == pattern(ks[0])
    # A block of a's copied into a slot of b's file is refused at open, and cleared.
    await b.aclose()
    write_at(data_file(b), 5 * FILE, a_slot)
    b2 = await open_tier(layout=make_layout("model-b"), budget=2 * FileTier.budget_for(16, BLOCK))
    assert b2.lookup(ks[:1]) == 0
    assert b2.statistics().quarantined == 1
    assert b2.statistics().recovered_blocks == 0
    assert header_page(data_file(b2), 5) == ZERO_HEADER
    # Written over one of b's own blocks while open, it is refused at load.
    await b2.store(ks[:1], pattern_rows(ks[:1]).rows())
    slot = slot_of(b2, ks[0])
    assert slot_payload(data_file(b2), slot, ks[0], ns_b) == pattern(ks[0])
    write_at(data_file(b2), slot * FILE, a_slot)
    result = await b2.load(ks[:1], Rows(1).rows())
    assert isinstance(result.missing[ks[0]], NamespaceMismatchError)
    assert b2.lookup(ks[:1]) == 0
    assert b2.statistics().quarantined == 2
    qdir = b2.path / "quarantine"
    await eventually(lambda: len(list(qdir.iterdir())) == 1, "the quarantine copy")
    assert next(qdir.iterdir()).name.endswith(".NamespaceMismatchError")
    # a never noticed.
    assert a.lookup(ks) == 2
    dst = Rows(2)
    assert (await a.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == pattern_rows(ks).map[:]


@pytest.mark.parametrize(
    ("n", "kept"), [(8, 0), (48, 3), (160, 8)], ids=["tiny-none", "one-per-16-slots", "at-most-8"]
)
async def test_quarantine_keeps_at_most_its_allowance(
    open_tier: OpenTier, n: int, kept: int
) -> None:
    # Copies count in the root's budget: min(8, slots // 16) of them. They are
    # written on the tier's thread; several rounds of many at a time, each
    # checked once the tier has closed.
    for rnd in range(3):
        tier = await open_tier(blocks=n)
        ks = keys(n, salt=rnd)
        assert (await tier.store(ks, pattern_rows(ks).rows())).stored == tuple(ks)
        path = data_file(tier)
        for k in ks:
            write_at(path, slot_of(tier, k) * FILE + HEADER_BYTES, b"\xff" * 16)
        result = await tier.load(ks, Rows(n).rows())
        assert result.loaded == ()
        assert all(isinstance(e, IntegrityError) for e in result.missing.values())
        assert tier.statistics().quarantined == n
        await tier.aclose()
        copies = list((tier.path / "quarantine").iterdir())
        assert len(copies) == kept, f"round {rnd}: {len(copies)} copies kept"
        assert {c.name.split(".")[-1] for c in copies} <= {"IntegrityError"}
        assert all(header_page(path, s) == ZERO_HEADER for s in range(n))


# -- budget and eviction ----------------------------------------------------------------


async def test_eviction_keeps_the_budget(open_tier: OpenTier) -> None:
    tier = await open_tier(blocks=3)
    ks = keys(5)
    first = await tier.store(ks[:3], pattern_rows(ks[:3]).rows())
    assert first.stored == tuple(ks[:3])
    old_slots = {k: slot_of(tier, k) for k in ks[:3]}
    assert sorted(old_slots.values()) == [0, 1, 2]
    await tier.load(ks[:1], Rows(1).rows())  # most recently used now
    second = await tier.store(ks[3:], pattern_rows(ks[3:]).rows())
    assert second.stored == tuple(ks[3:])
    assert set(second.evicted) == {ks[1], ks[2]}
    # The new blocks were written over the evicted ones; the file did not grow.
    assert {slot_of(tier, k) for k in ks[3:]} == {old_slots[ks[1]], old_slots[ks[2]]}
    assert slot_of(tier, ks[0]) == old_slots[ks[0]]
    assert data_file(tier).stat().st_size == 3 * FILE
    assert_disk_matches(tier, ks)
    stats = tier.statistics()
    assert stats.evictions == 2
    assert stats.used_bytes == stats.capacity_bytes == 3 * FILE
    assert tier.lookup([ks[0]]) == 1
    assert ks[1] not in tier


async def test_more_blocks_than_capacity_fail_as_capacity(open_tier: OpenTier) -> None:
    tier = await open_tier(blocks=2)
    ks = keys(3)
    result = await tier.store(ks, Rows(3).fill(1).rows())
    assert result.stored == ()
    assert all(isinstance(e, CapacityError) for e in result.failed.values())
    assert tier.statistics().blocks == 0
    assert tier.statistics().store_failures == 3
    assert all(header_page(data_file(tier), s) == ZERO_HEADER for s in range(2))


# -- failures per block -----------------------------------------------------------------


async def test_a_long_load_starts_in_runs_of_two_queues(
    open_tier: OpenTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load call longer than fits in flight goes to the engine in runs of two
    queues' worth of blocks (each batch is one report and one verification per
    reap, and settles once), not one run per reap of whatever room it freed;
    only the call's last run is shorter. Every block arrives sound."""
    n = 100
    tier = await open_tier(blocks=n)
    ks = keys(n)
    src = pattern_rows(ks)
    assert (await tier.store(ks, src.rows())).stored == tuple(ks)
    engine = tier._pipeline._engine
    real, runs = engine.submit_many, []

    def record(read: bool, fd: int, requests: list[Any], *args: Any, **kw: Any) -> None:
        if read:
            runs.append(len(requests))
        real(read, fd, requests, *args, **kw)

    monkeypatch.setattr(engine, "submit_many", record)
    dst = Rows(n)
    result = await tier.load(ks, dst.rows())
    assert result.loaded == tuple(ks)
    assert dst.map[:] == src.map[:]
    assert runs == [8] * 12 + [4]  # queue depth 4


async def test_reads_refused_at_submission_fail_every_run_and_pin_nothing(
    open_tier: OpenTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of more blocks than fit in flight starts a run at a time; when the
    engine refuses each run's batch, the failure of one run starts the next
    (inside the pump that started it), every block ends exactly once, and the
    blocks stay: nothing was read, so nothing says they are bad."""
    tier = await open_tier(blocks=40)
    ks = keys(40)  # queue depth 4: runs of 8
    assert (await tier.store(ks, pattern_rows(ks).rows())).stored == tuple(ks)
    engine = tier._pipeline._engine
    real, refused = engine.submit_many, [0]

    def refuse_reads(read: bool, *args: Any, **kw: Any) -> None:
        if read:
            refused[0] += 1
            raise RuntimeError("simulated bug")
        real(read, *args, **kw)

    monkeypatch.setattr(engine, "submit_many", refuse_reads)
    result = await tier.load(ks, Rows(40).rows())
    assert refused[0] == 5
    assert result.loaded == ()
    assert set(result.missing) == set(ks)
    assert all("internal error" in str(e) for e in result.missing.values())
    assert all(tier._manager.pins(k) == 0 for k in ks)
    assert tier.statistics().misses == 40
    assert all(k in tier for k in ks)
    monkeypatch.setattr(engine, "submit_many", real)
    # Nothing stored was lost: the same blocks load, sound.
    dst = Rows(40)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == pattern_rows(ks).map[:]


async def test_a_bug_in_a_worker_call_fails_its_blocks_and_the_tier_goes_on(
    open_tier: OpenTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-OSError on the checksum thread must not kill it (later calls would hang).

    Payloads are checksummed a few MiB per call: the blocks of that call fail.
    """
    from kvtier.tiers import block_format as ft

    real, calls = ft.checksums, [0]

    def flaky(views: list[memoryview]) -> list[int]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("simulated bug")
        return real(views)

    monkeypatch.setattr(ft, "checksums", flaky)
    tier = await open_tier()
    ks = keys(3)
    result = await tier.store(ks, pattern_rows(ks).rows())
    assert result.stored == ()
    assert set(result.failed) == set(ks)
    for err in result.failed.values():
        assert isinstance(err, TierIOError)
        assert "internal error" in str(err)
    assert not any(k in tier for k in ks)
    # The same thread serves the retry, and the tier closes.
    assert (await tier.store(ks, pattern_rows(ks).rows())).stored == tuple(ks)
    assert_disk_matches(tier, ks)
    dst = Rows(3)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == pattern_rows(ks).map[:]
    await tier.aclose()


async def test_write_error_fails_that_block_only(
    open_tier: OpenTier, engine_kind: EngineKind
) -> None:
    faulty = FaultyEngine(await open_io_engine(engine_kind, queue_depth=4))
    tier = await open_tier(io_engine=faulty)
    path = str(data_file(tier))
    failed: dict[bytes, TierIOError] = {}
    # One fault per call: a failed block's slot is zeroed by a write of its
    # own, which would meet a second fault queued behind the first.
    for n, fault in enumerate([{"err": errno.ENOSPC}, {"short_by": 4096}]):
        ks = keys(3, salt=n)
        faulty.inject("write", **fault)
        result = await tier.store(ks, pattern_rows(ks).rows())
        # Checksums are computed on a thread, so which block reaches the
        # engine first (and meets the fault) varies; that it fails alone does not.
        assert len(result.stored) == 2
        assert len(result.failed) == 1
        ((key, exc),) = result.failed.items()
        assert isinstance(exc, TierIOError)
        assert exc.path == path
        failed[key] = exc
    enospc, short = failed.values()
    assert enospc.errno == errno.ENOSPC
    assert "writing slot" in str(enospc)
    assert "short write of slot" in str(short)
    stats = tier.statistics()
    assert stats.blocks == 4
    assert stats.store_failures == 2
    await eventually(
        lambda: all(
            header_page(data_file(tier), s) == ZERO_HEADER
            for s in set(range(16)) - {slot_of(tier, k) for k in keys(3) + keys(3, 1) if k in tier}
        ),
        "the failed slots to be zeroed",
    )
    # The tier keeps working, and the failed keys can be stored again.
    everything = keys(3) + keys(3, salt=1)
    retried = tuple(k for k in everything if k in failed)
    assert (await tier.store(everything, pattern_rows(everything).rows())).stored == retried
    assert_disk_matches(tier, everything)
    faulty.inject("read", err=errno.EIO)
    result2 = await tier.load(everything, Rows(6).rows())
    eio = result2.missing[everything[0]]
    assert isinstance(eio, TierIOError)
    assert eio.errno == errno.EIO
    assert eio.path == path
    assert "reading slot" in str(eio)
    assert result2.loaded == tuple(everything[1:])
    await faulty.aclose()


async def one_block_tier(
    open_tier: OpenTier, engine_kind: EngineKind
) -> tuple[FaultyEngine, FileTier, Path]:
    """A one-slot tier on a fault-injecting engine, holding ``keys(2)[0]``."""
    faulty = FaultyEngine(await open_io_engine(engine_kind, queue_depth=4))
    tier = await open_tier(io_engine=faulty, blocks=1)
    old = keys(2)[0]
    await tier.store([old], pattern_rows([old]).rows())
    return faulty, tier, data_file(tier)


@pytest.mark.parametrize("fault", ["EIO", "short"])
async def test_failed_store_leaves_a_zero_header(
    open_tier: OpenTier, engine_kind: EngineKind, fault: str
) -> None:
    faulty, tier, path = await one_block_tier(open_tier, engine_kind)
    old, new = keys(2)
    assert slot_payload(path, 0, old) == pattern(old)
    if fault == "EIO":
        faulty.inject("write", err=errno.EIO)  # nothing of the new block is written
    else:
        faulty.inject("write", short_by=4096)  # its header and half its payload are
    result = await tier.store([new], pattern_rows([new]).rows())
    assert result.evicted == (old,)
    assert isinstance(result.failed[new], TierIOError)
    assert old not in tier
    assert new not in tier
    # Neither the evicted block nor the half-written one may be found at restart.
    await tier.aclose()
    assert header_page(path, 0) == ZERO_HEADER
    again = await open_tier(blocks=1)
    stats = again.statistics()
    assert stats.recovered_blocks == 0
    assert stats.torn_slots == 0
    assert old not in again
    assert new not in again
    assert (await again.store([new], pattern_rows([new]).rows())).stored == (new,)
    assert slot_payload(path, 0, new) == pattern(new)
    await faulty.aclose()


# -- removal ----------------------------------------------------------------------------


async def test_remove_zeroes_the_slot_and_the_block_stays_gone(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(4)
    slots = await store_blocks(tier, ks)
    path = data_file(tier)
    tier.remove([ks[1], keys(1, salt=5)[0]])  # an absent key is ignored
    assert ks[1] not in tier
    assert tier.lookup(ks) == 1
    await eventually(lambda: header_page(path, slots[ks[1]]) == ZERO_HEADER, "zeroing")
    missing = (await tier.load(ks[1:2], Rows(1).rows())).missing[ks[1]]
    assert isinstance(missing, BlockNotFoundError)
    # A block removed while a load reads it is served to that load, then cleared.
    dst = Rows(1)
    loading = tier.load(ks[2:3], dst.rows())
    tier.remove([ks[2]])
    assert (await loading).loaded == (ks[2],)
    assert dst.map[:] == pattern(ks[2])
    assert ks[2] not in tier
    await eventually(lambda: header_page(path, slots[ks[2]]) == ZERO_HEADER, "deferred zeroing")
    await tier.aclose()
    again = await open_tier()
    stats = again.statistics()
    assert stats.recovered_blocks == 2
    assert stats.torn_slots == 0
    assert ks[1] not in again
    assert ks[2] not in again
    assert {slot_of(again, k) for k in (ks[0], ks[3])} == {slots[ks[0]], slots[ks[3]]}
    assert_disk_matches(again, ks)


# -- restart ----------------------------------------------------------------------------


async def test_restart_recovers_residency_and_usage(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(6)
    slots = await store_blocks(tier, ks)
    path = data_file(tier)
    free = sorted(set(range(16)) - set(slots.values()))
    await tier.aclose()
    # Leftovers of a crash: files in tmp/ (a probe, a half-written
    # description), three torn headers (a valid header with a flipped byte,
    # the first bytes of a write and nothing else, a header for another block
    # size) and a valid block of another namespace.
    (tier.path / "tmp" / "direct-probe.1").write_bytes(b"p" * 4096)
    (tier.path / "tmp" / "namespace.json.1").write_bytes(b'{"form')
    now = int(time.time())
    stray = keys(1, salt=9)[0]
    flipped = bytearray(make_slot(stray, pattern(stray), stored_at=now))
    flipped[20] ^= 0x01
    write_at(path, free[0] * FILE, bytes(flipped))
    write_at(path, free[1] * FILE, b"x" * 100)
    write_at(
        path,
        free[2] * FILE,
        make_slot(stray, pattern(stray), stored_at=now, payload_bytes=2 * BLOCK),
    )
    other = make_layout("other").namespace
    write_at(path, free[3] * FILE, make_slot(stray, pattern(stray), stored_at=now, namespace=other))
    again = await open_tier()
    stats = again.statistics()
    assert stats.blocks == 6
    assert stats.used_bytes == 6 * FILE
    assert stats.capacity_bytes == 16 * FILE == path.stat().st_size
    assert stats.recovered_blocks == 6
    assert stats.torn_slots == 3
    assert stats.quarantined == 1
    assert stats.recovery == "complete"
    assert stats.recovery_seconds > 0
    assert stray not in again
    assert not list((again.path / "tmp").iterdir())
    # Every bad slot was cleared on disk before the tier took writes.
    assert all(header_page(path, s) == ZERO_HEADER for s in free)
    assert {k: slot_of(again, k) for k in ks} == slots
    assert again.lookup(ks) == 6
    dst = Rows(6)
    assert (await again.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == pattern_rows(ks).map[:]
    await again.aclose()
    # Cleared for good: the next open finds nothing to repair.
    third = await open_tier()
    assert third.statistics().recovered_blocks == 6
    assert third.statistics().torn_slots == 0
    assert third.statistics().quarantined == 0


async def reopen_with_slots(
    open_tier: OpenTier, blocks: int, slots: list[tuple[bytes, bytes, int]]
) -> tuple[FileTier, Path]:
    """Write ``(key, payload, seconds ago)`` into slots 0, 1, ... of a closed tier; reopen it.

    A crash-like state made by hand (several copies of a key, any store order).
    """
    tier = await open_tier(blocks=blocks)
    path = data_file(tier)
    await tier.aclose()
    now = int(time.time())
    for slot, (key, payload, ago) in enumerate(slots):
        write_at(path, slot * FILE, make_slot(key, payload, stored_at=now - ago))
    return await open_tier(blocks=blocks), path


async def test_restart_keeps_the_newer_of_two_copies(open_tier: OpenTier) -> None:
    # b in two slots (evicted, stored again elsewhere, then a crash before its
    # old slot was overwritten), the older copy with other bytes and in the
    # later slot.
    a, b, c = keys(3)
    old_b = bytes([0xAB]) * BLOCK
    again, path = await reopen_with_slots(
        open_tier, 4, [(a, pattern(a), 990), (b, pattern(b), 980), (b, old_b, 995)]
    )
    stats = again.statistics()
    assert stats.recovered_blocks == 2
    assert stats.blocks == 2
    assert stats.torn_slots == 0
    assert stats.quarantined == 0
    assert slot_of(again, b) == 1
    dst = Rows(2)
    assert (await again.load([a, b], dst.rows())).loaded == (a, b)
    assert dst.map[:] == pattern(a) + pattern(b)  # the newer copy, not old_b
    # The older copy's slot is free: two more blocks fit without an eviction.
    stored = await again.store([c, keys(1, salt=4)[0]], Rows(2).fill(3).rows())
    assert len(stored.stored) == 2
    assert stored.evicted == ()
    assert {slot_of(again, k) for k in stored.stored} == {2, 3}
    assert slot_payload(path, 1, b) == pattern(b)


async def test_restart_orders_blocks_by_store_time(open_tier: OpenTier) -> None:
    # Slots in reverse order of age: the scan meets the newest block first.
    a, b, c = keys(3)
    again, _ = await reopen_with_slots(
        open_tier, 3, [(c, pattern(c), 970), (b, pattern(b), 980), (a, pattern(a), 990)]
    )
    assert again.statistics().recovered_blocks == 3
    assert [slot_of(again, k) for k in (a, b, c)] == [2, 1, 0]
    # Under LRU the oldest store goes first: a, then b, then c.
    evicted: list[bytes] = []
    for k in keys(3, salt=1):
        result = await again.store([k], pattern_rows([k]).rows())
        assert result.stored == (k,)
        evicted.extend(result.evicted)
    assert evicted == [a, b, c]


async def test_removed_block_stays_gone_when_an_older_copy_was_on_disk(
    open_tier: OpenTier,
) -> None:
    # b in two slots, as a crash can leave it (see the tests above).
    a, b = keys(2)
    again, path = await reopen_with_slots(
        open_tier, 4, [(a, pattern(a), 990), (b, pattern(b), 980), (b, pattern(b), 995)]
    )
    assert slot_of(again, b) == 1
    again.remove([b])
    await again.aclose()
    assert header_page(path, 1) == ZERO_HEADER
    # remove() forgot b: no copy of it may come back at the next open.
    third = await open_tier(blocks=4)
    assert b not in third
    assert third.statistics().recovered_blocks == 1


async def test_smaller_budget_truncates_the_slot_file(open_tier: OpenTier) -> None:
    tier = await open_tier(blocks=6)
    ks = keys(6)
    slots = await store_blocks(tier, ks)
    path = data_file(tier)
    await tier.aclose()
    small = await open_tier(blocks=3)
    stats = small.statistics()
    assert path.stat().st_size == stats.capacity_bytes == 3 * FILE
    kept = [k for k in ks if slots[k] < 3]
    assert len(kept) == 3
    assert stats.recovered_blocks == stats.blocks == 3
    assert [k for k in ks if k in small] == kept
    assert all(slot_of(small, k) == slots[k] for k in kept)
    dst = Rows(3)
    assert (await small.load(kept, dst.rows())).loaded == tuple(kept)
    assert dst.map[:] == pattern_rows(kept).map[:]
    await small.aclose()
    # Growing again extends the file; the blocks cut off do not come back.
    big = await open_tier(blocks=6)
    assert path.stat().st_size == big.statistics().capacity_bytes == 6 * FILE
    assert big.statistics().recovered_blocks == 3
    assert [k for k in ks if k in big] == kept
    assert all(header_page(path, s) == ZERO_HEADER for s in range(3, 6))
    assert_disk_matches(big, ks)


async def test_evicted_slot_not_reused_comes_back_after_restart(
    open_tier: OpenTier, engine_kind: EngineKind
) -> None:
    faulty, tier, path = await one_block_tier(open_tier, engine_kind)
    old, new = keys(2)
    # The new block's write fails and so does the zeroing of its slot: the
    # evicted block's header and payload stay in the slot, intact.
    faulty.inject("write", err=errno.EIO)
    faulty.inject("write", err=errno.EIO)
    result = await tier.store([new], pattern_rows([new]).rows())
    assert result.evicted == (old,)
    assert isinstance(result.failed[new], TierIOError)
    assert old not in tier
    await tier.aclose()
    assert slot_payload(path, 0, old) == pattern(old)
    # It is found again at restart and served, verified.
    again = await open_tier(blocks=1)
    assert again.statistics().recovered_blocks == 1
    assert again.statistics().torn_slots == 0
    assert old in again
    dst = Rows(1)
    assert (await again.load([old], dst.rows())).loaded == (old,)
    assert dst.map[:] == pattern(old)
    assert again.statistics().quarantined == 0
    await faulty.aclose()


async def test_second_open_without_room_is_refused(open_tier: OpenTier) -> None:
    # A second live tier opens a partition of its own (tests/tiers/file/test_shared_root.py);
    # with the whole budget held by the first (instances=1), none fits.
    tier = await open_tier()
    with pytest.raises(CapacityError, match="instances"):
        await open_tier()
    # The refused open touched nothing: the first tier still works.
    assert sorted(p.name for p in tier.path.parent.iterdir()) == sorted(
        ["kvtier.lock", tier.path.name]
    )
    ks = keys(1)
    assert (await tier.store(ks, pattern_rows(ks).rows())).stored == tuple(ks)
    assert data_file(tier).stat().st_size == 16 * FILE


async def test_other_block_size_refused(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    ks = keys(2)
    await tier.store(ks, pattern_rows(ks).rows())
    await tier.aclose()
    config = FileTierConfig(root=tmp_path / "tier", bytes_to_use=16 * FILE)
    with pytest.raises(NamespaceMismatchError):
        await FileTier.open(config, make_layout(), block_bytes=2 * BLOCK)
    # The slot file was not touched by the refused open.
    again = await open_tier()
    assert again.statistics().recovered_blocks == 2
    assert_disk_matches(again, ks)


async def test_aclose_waits_and_is_idempotent(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(4)
    done = tier.store(ks, Rows(4).fill(1).rows())
    await tier.aclose()
    assert done.done()
    assert (await done).stored == tuple(ks)
    await tier.aclose()
    with pytest.raises(ClosedError):
        tier.store(ks, Rows(4).rows())


# -- filesystem hygiene -----------------------------------------------------------------


async def test_permissions(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    await tier.store(keys(1), Rows(1).fill(1).rows())

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(tmp_path / "tier") == 0o700
    assert mode(tier.path) == 0o700
    for sub in ("tmp", "quarantine"):
        assert mode(tier.path / sub) == 0o700
    assert not (tier.path / "blocks").exists()
    assert mode(tier.path / "namespace.json") == 0o600
    assert mode(tier.path / "lock") == 0o600
    assert mode(data_file(tier)) == 0o600
    desc = json.loads((tier.path / "namespace.json").read_text())
    assert desc["namespace"] == make_layout().namespace.hex() == tier.path.name
    assert desc["block_bytes"] == BLOCK
    assert desc["format_version"] == TIER_FORMAT_VERSION
    # Directories widened behind the tier's back are made private again at open.
    await tier.aclose()
    os.chmod(tier.path, 0o755)
    os.chmod(tier.path / "tmp", 0o777)
    os.chmod(tier.path / "quarantine", 0o755)
    again = await open_tier()
    assert mode(again.path) == 0o700
    assert mode(again.path / "tmp") == 0o700
    assert mode(again.path / "quarantine") == 0o700


async def test_planted_symlink_is_not_followed(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    ks = keys(1)
    await tier.store(ks, pattern_rows(ks).rows())
    path = data_file(tier)
    await tier.aclose()
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    before = outside.read_bytes()
    path.unlink()
    path.symlink_to(outside)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"keep me")
    (tier.path / "tmp" / "link").symlink_to(decoy)
    with pytest.raises(TierIOError) as info:
        await open_tier()
    assert info.value.errno == errno.ELOOP
    assert info.value.path == str(path)
    assert path.is_symlink()
    assert outside.read_bytes() == before
    # The link planted in tmp/ was removed, not the file it pointed to.
    assert not (tier.path / "tmp" / "link").is_symlink()
    assert decoy.read_bytes() == b"keep me"


@pytest.mark.parametrize("sub", ["tmp", "quarantine"])
async def test_symlinked_subdirectory_refused(
    open_tier: OpenTier, tmp_path: Path, sub: str
) -> None:
    tier = await open_tier()
    await tier.aclose()
    (tier.path / sub).rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"k")
    (tier.path / sub).symlink_to(elsewhere)
    with pytest.raises(TierIOError, match="symlink"):
        await open_tier()
    assert [p.name for p in elsewhere.iterdir()] == ["keep"]


# -- O_DIRECT refusal -------------------------------------------------------------------


@pytest.fixture
def refusing_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that refuses O_DIRECT (see support.filesystems)."""
    with refusing_direct_io_dir(tmp_path) as root:
        yield root


async def test_direct_io_refused(open_tier: OpenTier, refusing_dir: Path) -> None:
    with pytest.raises(DirectIOUnsupportedError) as info:
        await open_tier(root=refusing_dir, direct_io="require")
    assert info.value.errno == errno.EINVAL
    assert info.value.path is not None
    assert info.value.path.startswith(str(refusing_dir))
    tier = await open_tier(root=refusing_dir, direct_io="auto")
    stats = tier.statistics()
    assert not stats.direct_io
    assert "O_DIRECT" in (stats.direct_io_fallback or "")
    ks = keys(2)
    src = pattern_rows(ks)
    await tier.store(ks, src.rows())
    dst = Rows(2)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == src.map[:]
    assert_disk_matches(tier, ks)
    # Buffered I/O does not need aligned buffers.
    odd = bytearray(BLOCK + 1)
    assert (await tier.store(keys(1, salt=3), [memoryview(odd)[1:]])).stored
    await tier.aclose()


# -- evicted slots overwritten by new blocks ----------------------------------------------


@pytest.mark.parametrize("durability", ["none", "fsync"])
async def test_evicted_key_stored_again_at_once(open_tier: OpenTier, durability: str) -> None:
    tier = await open_tier(blocks=3, durability=durability)
    ks = keys(5)
    await tier.store(ks[:3], pattern_rows(ks[:3]).rows())
    slot0 = slot_of(tier, ks[0])
    # Least recent first: k0, k1, k2 (fsync completes them in any order).
    tier.touch([ks[1]])
    tier.touch([ks[2]])
    # k0 is evicted (its slot taken by k3 or k4) and stored again before that
    # write has finished: it must land in another slot, and neither write may
    # clobber the other.
    first = tier.store(ks[3:5], pattern_rows(ks[3:5]).rows())
    again = tier.store(ks[:1], pattern_rows(ks[:1]).rows())
    r1, r2 = await first, await again
    assert set(r1.evicted) == {ks[0], ks[1]}
    assert r2.stored == (ks[0],)
    assert r2.evicted == (ks[2],)
    assert slot_of(tier, ks[0]) != slot0
    dst = Rows(3)
    loaded = await tier.load([ks[0], ks[3], ks[4]], dst.rows())
    assert loaded.loaded == (ks[0], ks[3], ks[4])
    assert dst.map[:] == pattern_rows([ks[0], ks[3], ks[4]]).map[:]
    assert_disk_matches(tier, ks)
    # Every evicted slot was overwritten: a restart finds exactly the resident blocks.
    await tier.aclose()
    reopened = await open_tier(blocks=3, durability=durability)
    assert {k for k in ks if k in reopened} == {ks[0], ks[3], ks[4]}
    assert_disk_matches(reopened, ks)


@pytest.mark.parametrize("durability", ["none", "fsync"])
async def test_concurrent_calls_keep_slots_and_budget_consistent(
    open_tier: OpenTier, durability: str
) -> None:
    import random

    rng = random.Random(5)
    space = keys(14, salt=7)
    tier = await open_tier(blocks=5, durability=durability)
    removed = 0
    for _ in range(25):
        calls: list[Any] = []
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            picked = rng.sample(space, rng.randint(1, 4))
            if op < 0.55:
                calls.append(("store", picked, tier.store(picked, pattern_rows(picked).rows())))
            elif op < 0.9:
                dst = Rows(len(picked))
                calls.append(("load", picked, dst, tier.load(picked, dst.rows())))
            else:
                removed += sum(1 for k in picked if tier.is_ready(k))
                tier.remove(picked)
        for call in calls:
            if call[0] == "store":
                result = await call[2]
                assert all(isinstance(e, CapacityError) for e in result.failed.values())
            else:
                _, picked, dst, done = call
                result = await done
                # Only "not here" misses: a ready block's slot is never lost or swapped.
                assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
                for k in result.loaded:
                    i = picked.index(k)
                    assert dst.map[i * BLOCK : (i + 1) * BLOCK] == pattern(k)
        assert_disk_matches(tier, space)
    stats = tier.statistics()
    assert stats.evictions > 5
    assert removed > 0
    assert stats.quarantined == 0
    # Evicted slots were overwritten and removed ones zeroed: a restart finds
    # exactly the blocks resident at close, in the same slots.
    resident = {k: slot_of(tier, k) for k in space if k in tier}
    await tier.aclose()
    again = await open_tier(blocks=5, durability=durability)
    assert {k: slot_of(again, k) for k in space if k in again} == resident
    assert again.statistics().torn_slots == 0
    assert_disk_matches(again, space)


async def test_aclose_while_evicting_stores_run(open_tier: OpenTier) -> None:
    tier = await open_tier(blocks=3)
    ks = keys(6)
    await tier.store(ks[:3], pattern_rows(ks[:3]).rows())
    done = tier.store(ks[3:], pattern_rows(ks[3:]).rows())
    await tier.aclose()
    assert done.done()
    assert (await done).stored == tuple(ks[3:])
    assert set((await done).evicted) == set(ks[:3])
    assert not list((tier.path / "tmp").iterdir())
    path = data_file(tier)
    assert {slot_header(path, s).key for s in range(3)} == set(ks[3:])  # type: ignore[union-attr]
    again = await open_tier(blocks=3)
    stats = again.statistics()
    assert stats.torn_slots == 0
    assert stats.recovered_blocks == 3
    assert again.lookup(ks[3:]) == 3
    assert_disk_matches(again, ks)


# -- errors from the kernel, typed ------------------------------------------------------


@pytest.mark.parametrize("kind", ["write", "read"])
@pytest.mark.parametrize(
    "err", [errno.ENOSPC, errno.EIO, errno.EACCES], ids=["ENOSPC", "EIO", "EACCES"]
)
async def test_engine_errors_are_typed_per_block(
    open_tier: OpenTier, engine_kind: EngineKind, kind: Literal["write", "read"], err: int
) -> None:
    faulty = FaultyEngine(await open_io_engine(engine_kind, queue_depth=4))
    tier = await open_tier(io_engine=faulty)
    path = data_file(tier)
    ks = keys(2)
    if kind == "read":
        slots = await store_blocks(tier, ks)
    faulty.inject(kind, err=err)
    if kind == "write":
        failed = (await tier.store(ks, pattern_rows(ks).rows())).failed
    else:
        failed = dict((await tier.load(ks, Rows(2).rows())).missing)
    # Loads start in order; stores start as their checksums come back from a
    # thread, so the fault meets either key.
    assert len(failed) == 1
    if kind == "read":
        assert list(failed) == [ks[0]]
    (exc,) = failed.values()
    assert isinstance(exc, TierIOError)
    assert exc.errno == err
    assert exc.path == str(path)
    assert f"{'writing' if kind == 'write' else 'reading'} slot " in str(exc)
    (bad,) = failed
    (good,) = (k for k in ks if k != bad)
    assert good in tier
    assert bad not in tier
    if kind == "read":
        # An I/O error is not corruption: the block is forgotten and its slot
        # cleared, without a quarantine copy.
        await eventually(lambda: header_page(path, slots[bad]) == ZERO_HEADER, "zeroing")
        assert tier.statistics().quarantined == 0
        assert not list((tier.path / "quarantine").iterdir())
    # The tier keeps working for the failed one.
    assert (await tier.store([bad], pattern_rows([bad]).rows())).stored == (bad,)
    dst = Rows(2)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == pattern_rows(ks).map[:]
    await faulty.aclose()


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses permission bits (no EACCES)")
async def test_read_only_slot_file_is_eacces_at_open(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(2)
    await tier.store(ks, pattern_rows(ks).rows())
    await tier.aclose()
    path = data_file(tier)
    os.chmod(path, 0o400)
    try:
        with pytest.raises(TierIOError) as info:
            await open_tier()
    finally:
        os.chmod(path, 0o600)
    assert info.value.errno == errno.EACCES
    assert info.value.path == str(path)
    # Nothing was lost: with its mode back, the file opens with its blocks.
    again = await open_tier()
    assert again.statistics().recovered_blocks == 2
    assert_disk_matches(again, ks)


async def test_full_filesystem_fails_at_open_never_mid_store(
    open_tier: OpenTier, small_fs: Path, fill_filesystem: Callable[[Path], int]
) -> None:
    # A budget the filesystem cannot hold fails at open, before anything is
    # written (tests/tiers/file/test_root_budget.py checks that closely).
    with pytest.raises(CapacityError, match="KiB free; the file tier needs"):
        await open_tier(root=small_fs / "tier", blocks=64, direct_io="auto")
    # One that fits is reserved whole: once the rest of the disk is filled by
    # someone else, the tier still stores its whole budget, and more with evictions.
    tier = await open_tier(root=small_fs / "tier", blocks=16, direct_io="auto")
    assert data_file(tier).stat().st_size == 16 * FILE
    filled = fill_filesystem(small_fs / "filler")
    assert filled < 16 * FILE
    ks = keys(24)
    first = await tier.store(ks[:16], pattern_rows(ks[:16]).rows())
    assert first.stored == tuple(ks[:16])
    assert not first.failed
    second = await tier.store(ks[16:], pattern_rows(ks[16:]).rows())
    assert second.stored == tuple(ks[16:])
    assert not second.failed
    assert len(second.evicted) == 8
    stats = tier.statistics()
    assert stats.store_failures == 0
    assert stats.blocks == 16
    assert_disk_matches(tier, ks)
    resident = [k for k in ks if k in tier]
    dst = Rows(16)
    assert (await tier.load(resident, dst.rows())).loaded == tuple(resident)
    assert dst.map[:] == pattern_rows(resident).map[:]
