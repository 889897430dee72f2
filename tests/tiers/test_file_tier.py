"""The file tier on real O_DIRECT files, with both I/O engines."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import stat
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import pytest_asyncio

from kvtier.config import FileTierConfig
from kvtier.errors import (
    AlignmentError,
    BlockNotFoundError,
    BusyError,
    CapacityError,
    ClosedError,
    DirectIOUnsupportedError,
    IntegrityError,
    NamespaceMismatchError,
    TierIOError,
)
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.filesystems import refusing_direct_io_dir
from kvtier.testing.io_engine import FaultyEngine, aligned_buffer, cancel_one_awaiter
from kvtier.tiers._format import HEADER_BYTES
from kvtier.tiers.file_tier import FileTier
from kvtier.transfer.io_engine import EngineKind, IOEngine, open_io_engine, probe_io_uring

BLOCK = 8192
FILE = HEADER_BYTES + BLOCK
ENGINES = ["threads"] if probe_io_uring() else ["io_uring", "threads"]


def make_layout(model: str = "m") -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


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
        layout: KVLayout | None = None,
        io_engine: IOEngine | None = None,
        **cfg: Any,
    ) -> FileTier:
        config = FileTierConfig(
            root=root or tmp_path / "tier",
            bytes_to_use=blocks * FILE,
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


def block_files(tier: FileTier) -> list[Path]:
    return sorted(p for p in (tier.path / "blocks").rglob("*") if not p.is_dir())


# -- round trips ------------------------------------------------------------------------


async def test_store_load_round_trip(open_tier: OpenTier, engine_kind: EngineKind) -> None:
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
    assert len(block_files(tier)) == 5


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
    done = tier.store(ks, Rows(4).fill(3).rows())
    await cancel_one_awaiter(done)
    assert (await done).stored == tuple(ks)
    assert tier.lookup(ks) == 4


async def test_unaligned_buffer_refused_before_io(open_tier: OpenTier) -> None:
    tier = await open_tier()
    buf = mmap.mmap(-1, 2 * BLOCK)
    with pytest.raises(AlignmentError) as info:
        tier.store(keys(1), [memoryview(buf)[512 : 512 + BLOCK]])
    assert info.value.alignment == 4096
    assert tier.lookup(keys(1)) == 0
    assert keys(1)[0] not in tier
    assert not list((tier.path / "tmp").iterdir())


# -- integrity --------------------------------------------------------------------------


@pytest.mark.parametrize("where", [HEADER_BYTES + 100, 30], ids=["payload", "header"])
async def test_flipped_byte_is_quarantined_miss(open_tier: OpenTier, where: int) -> None:
    tier = await open_tier()
    ks = keys(2)
    await tier.store(ks, Rows(2).fill(4).rows())
    path = tier.path / "blocks" / ks[0].hex()[:2] / ks[0].hex()
    data = bytearray(path.read_bytes())
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    result = await tier.load(ks, Rows(2).rows())
    assert result.loaded == (ks[1],)
    assert isinstance(result.missing[ks[0]], IntegrityError)
    assert not path.exists()
    assert len(list((tier.path / "quarantine").iterdir())) == 1
    assert ks[0] not in tier
    assert tier.lookup(ks) == 0
    assert tier.statistics().quarantined == 1
    # Never served again, and its slot is free for a fresh copy.
    assert isinstance((await tier.load(ks[:1], Rows(1).rows())).missing[ks[0]], BlockNotFoundError)
    assert (await tier.store(ks[:1], Rows(1).fill(4).rows())).stored == (ks[0],)


async def test_truncated_file_is_integrity_error(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(1)
    await tier.store(ks, Rows(1).fill(5).rows())
    path = tier.path / "blocks" / ks[0].hex()[:2] / ks[0].hex()
    os.truncate(path, HEADER_BYTES + 4096)
    result = await tier.load(ks, Rows(1).rows())
    assert isinstance(result.missing[ks[0]], IntegrityError)
    assert "short block file" in str(result.missing[ks[0]])
    assert ks[0] not in tier


async def test_file_from_another_namespace_never_hits(open_tier: OpenTier, tmp_path: Path) -> None:
    a = await open_tier(layout=make_layout("model-a"))
    b = await open_tier(layout=make_layout("model-b"))
    assert a.path != b.path
    ks = keys(2)
    await a.store(ks, Rows(2).fill(6).rows())
    assert b.lookup(ks) == 0
    assert isinstance((await b.load(ks, Rows(2).rows())).missing[ks[0]], BlockNotFoundError)
    # A file copied into b's directory is recovered by size but refused by its header.
    await b.aclose()
    name = ks[0].hex()
    src = a.path / "blocks" / name[:2] / name
    (b.path / "blocks" / name[:2] / name).write_bytes(src.read_bytes())
    b2 = await open_tier(layout=make_layout("model-b"))
    assert b2.lookup(ks[:1]) == 1
    result = await b2.load(ks[:1], Rows(1).rows())
    assert isinstance(result.missing[ks[0]], NamespaceMismatchError)
    assert b2.lookup(ks[:1]) == 0
    assert a.lookup(ks) == 2


# -- budget and eviction ----------------------------------------------------------------


async def test_eviction_keeps_the_budget(open_tier: OpenTier) -> None:
    tier = await open_tier(blocks=3)
    ks = keys(5)
    first = await tier.store(ks[:3], Rows(3).fill(7).rows())
    assert first.stored == tuple(ks[:3])
    await tier.load(ks[:1], Rows(1).rows())  # most recently used now
    second = await tier.store(ks[3:], Rows(2).fill(8).rows())
    assert second.stored == tuple(ks[3:])
    assert set(second.evicted) == {ks[1], ks[2]}
    files = block_files(tier)
    assert len(files) == 3
    assert not list((tier.path / "tmp").iterdir())  # evicted files were reused, none left
    assert sum(p.stat().st_size for p in files) <= 3 * FILE
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


# -- failures per block -----------------------------------------------------------------


async def test_a_bug_in_a_metadata_call_fails_its_block_and_the_tier_goes_on(
    open_tier: OpenTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-OSError on a metadata thread must not kill it (later calls would hang)."""
    import kvtier.tiers.file_tier as ft

    real, calls = ft.checksum, [0]  # type: ignore[attr-defined]

    def flaky(view: memoryview) -> int:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("simulated bug")
        return real(view)

    monkeypatch.setattr(ft, "checksum", flaky)
    tier = await open_tier()
    ks = keys(3)
    result = await tier.store(ks, Rows(3).fill(3).rows())
    assert len(result.stored) == 2
    (err,) = result.failed.values()
    assert isinstance(err, TierIOError)
    assert "internal error" in str(err)
    assert not list((tier.path / "tmp").iterdir())
    # The same threads serve the retry, and the tier closes.
    (bad,) = result.failed
    assert (await tier.store([bad], Rows(1).fill(3).rows())).stored == (bad,)
    assert (await tier.load(ks, Rows(3).rows())).loaded == tuple(ks)
    await tier.aclose()


async def test_write_error_fails_that_block_only(
    open_tier: OpenTier, engine_kind: EngineKind
) -> None:
    faulty = FaultyEngine(await open_io_engine(engine_kind, queue_depth=4))
    tier = await open_tier(io_engine=faulty)
    ks = keys(3)
    faulty.inject("write", err=errno.ENOSPC)
    faulty.inject("write", short_by=4096)
    result = await tier.store(ks, Rows(3).fill(2).rows())
    # Files are created on several threads, so which blocks reach the engine
    # first (and meet the faults) varies; that each fails alone does not.
    assert len(result.stored) == 1
    assert len(result.failed) == 2
    errors = list(result.failed.values())
    enospc = next(e for e in errors if getattr(e, "errno", None) == errno.ENOSPC)
    short = next(e for e in errors if e is not enospc)
    assert isinstance(enospc, TierIOError)
    assert enospc.errno == errno.ENOSPC
    assert isinstance(short, TierIOError)
    assert "short write" in str(short)
    assert enospc.path is not None
    assert enospc.path.startswith(str(tier.path / "tmp"))
    assert not list((tier.path / "tmp").iterdir())
    assert tier.statistics().blocks == 1
    assert tier.statistics().store_failures == 2
    # The tier keeps working, and the failed keys can be stored again.
    retried = tuple(k for k in ks if k not in result.stored)
    assert (await tier.store(ks, Rows(3).fill(2).rows())).stored == retried
    faulty.inject("read", err=errno.EIO)
    result2 = await tier.load(ks, Rows(3).rows())
    eio = result2.missing[ks[0]]
    assert isinstance(eio, TierIOError)
    assert eio.errno == errno.EIO
    assert result2.loaded == tuple(ks[1:])
    await faulty.aclose()


# -- restart ----------------------------------------------------------------------------


async def test_restart_recovers_residency_and_usage(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    ks = keys(6)
    src = Rows(6).fill(11)
    await tier.store(ks, src.rows())
    path = tier.path
    await tier.aclose()
    # Leftovers of a crash: an interrupted write, an evicted file kept as a
    # spare, a torn block file, and a name that is not a key.
    (path / "tmp" / "deadbeef.1.1.tmp").write_bytes(b"partial")
    (path / "tmp" / "spare.1.2.tmp").write_bytes(b"s" * FILE)
    torn = keys(1, salt=9)[0].hex()
    (path / "blocks" / torn[:2] / torn).write_bytes(b"x" * 100)
    (path / "blocks" / "00" / "not-a-key").write_bytes(b"y" * FILE)
    again = await open_tier()
    stats = again.statistics()
    assert stats.blocks == 6
    assert stats.used_bytes == 6 * FILE == sum(p.stat().st_size for p in block_files(again))
    assert stats.recovered_blocks == 6
    assert stats.removed_temporaries == 2
    assert stats.quarantined == 2
    assert len(list((path / "quarantine").iterdir())) == 2
    assert stats.recovery == "complete"
    assert not list((path / "tmp").iterdir())
    assert again.lookup(ks) == 6
    dst = Rows(6)
    assert (await again.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == src.map[:]
    await again.aclose()
    # A smaller budget on restart evicts down to it.
    small = await open_tier(blocks=4)
    assert small.statistics().blocks == 4
    assert len(block_files(small)) == 4


async def test_second_open_of_same_namespace_is_busy(open_tier: OpenTier) -> None:
    await open_tier()
    with pytest.raises(BusyError):
        await open_tier()


async def test_other_block_size_refused(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    await tier.aclose()
    config = FileTierConfig(root=tmp_path / "tier", bytes_to_use=16 * FILE)
    with pytest.raises(NamespaceMismatchError):
        await FileTier.open(config, make_layout(), block_bytes=2 * BLOCK)


async def test_aclose_waits_and_is_idempotent(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(4)
    done = tier.store(ks, Rows(4).fill(1).rows())
    await tier.aclose()
    assert done.done()
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
    for sub in ("blocks", "tmp", "quarantine"):
        assert mode(tier.path / sub) == 0o700
    assert all(mode(p) == 0o700 for p in (tier.path / "blocks").iterdir())
    assert mode(tier.path / "namespace.json") == 0o600
    assert mode(tier.path / "lock") == 0o600
    assert [mode(p) for p in block_files(tier)] == [0o600]
    desc = json.loads((tier.path / "namespace.json").read_text())
    assert desc["namespace"] == make_layout().namespace.hex() == tier.path.name
    assert desc["block_bytes"] == BLOCK
    # Directories widened behind the tier's back are made private again at open.
    await tier.aclose()
    os.chmod(tier.path, 0o755)
    os.chmod(tier.path / "blocks" / "00", 0o777)
    again = await open_tier()
    assert mode(again.path) == 0o700
    assert mode(again.path / "blocks" / "00") == 0o700


async def test_planted_symlink_is_not_followed(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    ks = keys(1)
    await tier.store(ks, Rows(1).fill(3).rows())
    path = tier.path / "blocks" / ks[0].hex()[:2] / ks[0].hex()
    outside = tmp_path / "outside"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    result = await tier.load(ks, Rows(1).rows())
    err = result.missing[ks[0]]
    assert isinstance(err, TierIOError)
    assert err.errno == errno.ELOOP
    assert outside.exists()
    assert not path.is_symlink()
    assert ks[0] not in tier


async def test_symlinked_fanout_directory_refused(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier()
    sub = tier.path / "blocks" / "00"
    await tier.aclose()
    sub.rmdir()
    (tmp_path / "elsewhere").mkdir()
    sub.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TierIOError, match="symlink"):
        await open_tier()


# -- O_DIRECT refusal -------------------------------------------------------------------


@pytest.fixture
def refusing_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem that refuses O_DIRECT (see kvtier.testing.filesystems)."""
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
    src = Rows(2).fill(12)
    await tier.store(ks, src.rows())
    dst = Rows(2)
    assert (await tier.load(ks, dst.rows())).loaded == tuple(ks)
    assert dst.map[:] == src.map[:]
    # Buffered I/O does not need aligned buffers.
    odd = bytearray(BLOCK + 1)
    assert (await tier.store(keys(1, salt=3), [memoryview(odd)[1:]])).stored
    await tier.aclose()


# -- recycled files (evictions move their file to tmp/ for the next store) ---------------


def pattern_rows(ks: list[bytes]) -> Rows:
    """Rows whose bytes are a function of their key, so any load can be checked."""
    rows = Rows(len(ks))
    for i, k in enumerate(ks):
        rows.map[i * BLOCK : (i + 1) * BLOCK] = k * (BLOCK // len(k))
    return rows


def assert_disk_matches(tier: FileTier, space: list[bytes]) -> None:
    """At rest: one file per resident block, nothing left in tmp/, usage exact."""
    resident = {k.hex() for k in space if k in tier}
    assert {p.name for p in block_files(tier)} == resident
    assert not list((tier.path / "tmp").iterdir())
    stats = tier.statistics()
    assert stats.blocks == len(resident)
    assert (
        stats.used_bytes == len(resident) * FILE == sum(p.stat().st_size for p in block_files(tier))
    )
    assert stats.used_bytes <= stats.capacity_bytes


@pytest.mark.parametrize("durability", ["none", "fsync"])
async def test_evicted_key_stored_again_at_once(open_tier: OpenTier, durability: str) -> None:
    tier = await open_tier(blocks=3, durability=durability)
    ks = keys(5)
    await tier.store(ks[:3], pattern_rows(ks[:3]).rows())
    # Least recent first: k0, k1, k2 (fsync completes them in any order).
    tier.touch([ks[1]])
    tier.touch([ks[2]])
    # k0 is evicted (its file is on its way to tmp/) and stored again before
    # that move has happened: the new file must not be the one moved aside.
    first = tier.store(ks[3:5], pattern_rows(ks[3:5]).rows())
    again = tier.store(ks[:1], pattern_rows(ks[:1]).rows())
    r1, r2 = await first, await again
    assert set(r1.evicted) == {ks[0], ks[1]}
    assert r2.stored == (ks[0],)
    assert r2.evicted == (ks[2],)
    dst = Rows(3)
    loaded = await tier.load([ks[0], ks[3], ks[4]], dst.rows())
    assert loaded.loaded == (ks[0], ks[3], ks[4])
    assert dst.map[:] == pattern_rows([ks[0], ks[3], ks[4]]).map[:]
    assert_disk_matches(tier, ks)


@pytest.mark.parametrize("durability", ["none", "fsync"])
async def test_concurrent_calls_keep_files_and_budget_consistent(
    open_tier: OpenTier, durability: str
) -> None:
    import random

    rng = random.Random(5)
    space = keys(14, salt=7)
    tier = await open_tier(blocks=5, durability=durability)
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
                tier.remove(picked)
        for call in calls:
            if call[0] == "store":
                result = await call[2]
                assert all(isinstance(e, CapacityError) for e in result.failed.values())
            else:
                _, picked, dst, done = call
                result = await done
                # Only "not here" misses: a ready block's file is never lost or swapped.
                assert all(isinstance(e, BlockNotFoundError) for e in result.missing.values())
                for k in result.loaded:
                    i = picked.index(k)
                    assert dst.map[i * BLOCK : (i + 1) * BLOCK] == k * (BLOCK // len(k))
        assert_disk_matches(tier, space)
    assert tier.statistics().evictions > 5


async def test_aclose_while_evicted_files_move(open_tier: OpenTier, tmp_path: Path) -> None:
    tier = await open_tier(blocks=3)
    ks = keys(6)
    await tier.store(ks[:3], pattern_rows(ks[:3]).rows())
    done = tier.store(ks[3:], pattern_rows(ks[3:]).rows())
    await tier.aclose()
    assert done.done()
    assert (await done).stored == tuple(ks[3:])
    assert not list((tier.path / "tmp").iterdir())
    assert {p.name for p in block_files(tier)} == {k.hex() for k in ks[3:]}
    again = await open_tier(blocks=3)
    assert again.statistics().removed_temporaries == 0
    assert again.lookup(ks[3:]) == 3


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
    ks = keys(2)
    if kind == "read":
        await tier.store(ks, pattern_rows(ks).rows())
    faulty.inject(kind, err=err)
    if kind == "write":
        failed = (await tier.store(ks, pattern_rows(ks).rows())).failed
        where = tier.path / "tmp"
    else:
        failed = dict((await tier.load(ks, Rows(2).rows())).missing)
        where = tier.path / "blocks"
    # Loads start in order; stores start as their files are created, on
    # several threads, so the fault meets either key.
    assert len(failed) == 1
    if kind == "read":
        assert list(failed) == [ks[0]]
    (exc,) = failed.values()
    assert isinstance(exc, TierIOError)
    assert exc.errno == err
    assert (exc.path or "").startswith(str(where))
    # The other block went through, and the tier keeps working for the failed one.
    (bad,) = failed
    (good,) = (k for k in ks if k != bad)
    assert good in tier
    assert (await tier.store([bad], pattern_rows([bad]).rows())).stored == (bad,)
    assert (await tier.load(ks, Rows(2).rows())).loaded == tuple(ks)
    await faulty.aclose()


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses permission bits (no EACCES)")
async def test_unwritable_directory_is_eacces(open_tier: OpenTier) -> None:
    tier = await open_tier()
    ks = keys(2)
    os.chmod(tier.path / "tmp", 0o500)
    try:
        result = await tier.store(ks, pattern_rows(ks).rows())
    finally:
        os.chmod(tier.path / "tmp", 0o700)
    assert result.stored == ()
    for exc in result.failed.values():
        assert isinstance(exc, TierIOError)
        assert exc.errno == errno.EACCES
        assert (exc.path or "").startswith(str(tier.path / "tmp"))
    assert tier.statistics().blocks == 0
    assert (await tier.store(ks, pattern_rows(ks).rows())).stored == tuple(ks)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, so that the disk fills before the tier's budget does."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = shutil.which("mount")
    proc = subprocess.run(
        [mount or "mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if mount is None or proc.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs CAP_SYS_ADMIN)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


async def test_full_filesystem_is_enospc_per_block(open_tier: OpenTier, small_fs: Path) -> None:
    tier = await open_tier(root=small_fs / "tier", blocks=64, direct_io="auto")
    ks = keys(30)
    result = await tier.store(ks, pattern_rows(ks).rows())
    assert result.stored
    assert result.failed
    errnos = set()
    for exc in result.failed.values():
        # A write that found some room is short; the next ones get ENOSPC.
        assert isinstance(exc, TierIOError)
        assert (exc.path or "").startswith(str(tier.path / "tmp"))
        errnos.add(exc.errno)
    assert errno.ENOSPC in errnos
    assert_disk_matches(tier, ks)
    # Room made by removing blocks is usable again: the tier kept working.
    tier.remove(list(result.stored))
    retry = await tier.store(list(result.failed)[:5], pattern_rows(list(result.failed)[:5]).rows())
    assert len(retry.stored) == 5
    dst = Rows(5)
    assert (await tier.load(list(retry.stored), dst.rows())).loaded == retry.stored
    assert dst.map[:] == pattern_rows(list(retry.stored)).map[:]
