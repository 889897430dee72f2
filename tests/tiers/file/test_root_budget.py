"""The file tier's disk budget is the root's, and a failed open leaves the disk as it was.

Everything here runs on real filesystems: ``tmp_path``, small tmpfs and loop
ext4 mounts (see ``conftest.py``). Usage is measured independently of
kvtier, as ``st_blocks * 512`` of everything under the root, the root and
its directories included. Faults the kernel cannot be made to give on
demand come from a real limit (``RLIMIT_FSIZE``), from
:class:`~kvtier.testing.io_engine.FaultyEngine`, or, for a disk filling up
between kvtier's free-space check and its reservation, from a real writer
filling the filesystem just before ``posix_fallocate`` runs.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier._sizes import format_size
from kvtier.config import FileTierConfig
from kvtier.errors import CapacityError, ClosedError, TierIOError
from kvtier.layout import KVLayout, TensorSpec
from kvtier.testing.io_engine import FaultyEngine, aligned_buffer
from kvtier.tiers.block_format import HEADER_BYTES
from kvtier.tiers.file import FileTier, collect
from kvtier.tiers.file._root_lock import lock_root_blocking, release_root
from kvtier.transfer.completion import Completion
from kvtier.transfer.io_engine import IOEngine, open_io_engine

BLOCK = 8192
SLOT = HEADER_BYTES + BLOCK
Fill = Callable[[Path], int]
Mount = Callable[[int], Path]


def layout(model: str = "m") -> KVLayout:
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    return KVLayout(tensors=(spec,), model_id=model, block_tokens=16)


def budget(slots: int, block: int = BLOCK) -> int:
    return FileTier.budget_for(slots, block)


async def open_ns(
    root: Path,
    model: str = "m",
    nbytes: int | None = None,
    *,
    block: int = BLOCK,
    **cfg: Any,
) -> FileTier:
    config = FileTierConfig(
        root=root, bytes_to_use=nbytes or budget(16), io_engine="threads", queue_depth=4, **cfg
    )
    return await FileTier.open(config, layout(model), block_bytes=block)


def usage(root: Path) -> int:
    """``st_blocks * 512`` of ``root`` and everything under it (no symlink followed)."""
    total = os.lstat(root).st_blocks * 512
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 8 for i in range(n)]


def payload(key: bytes, block: int = BLOCK) -> bytes:
    return key * (block // len(key))


def rows(ks: list[bytes], block: int = BLOCK) -> list[memoryview]:
    buf = aligned_buffer(max(1, len(ks)) * block)
    for i, k in enumerate(ks):
        buf[i * block : (i + 1) * block] = payload(k, block)
    return [memoryview(buf)[i * block : (i + 1) * block] for i in range(len(ks))]


async def store(tier: FileTier, ks: list[bytes]) -> None:
    assert (await tier.store(ks, rows(ks))).stored == tuple(ks)


async def assert_loads(tier: FileTier, ks: list[bytes]) -> None:
    dst = rows([bytes(16)] * len(ks))
    assert (await tier.load(ks, dst)).loaded == tuple(ks)
    assert [bytes(v) for v in dst] == [payload(k) for k in ks]


async def four_blocks(root: Path) -> tuple[list[bytes], Path]:
    """A namespace of 4 slots, full: its keys and its slot file."""
    ks = keys(4)
    tier = await open_ns(root, nbytes=budget(4))
    await store(tier, ks)
    await tier.aclose()
    return ks, namespace_dir(root) / "blocks.dat"


async def reopen_with(root: Path, ks: list[bytes]) -> None:
    """Reopen the namespace at 4 slots: every block of ``ks`` is back, with its bytes."""
    tier = await open_ns(root, nbytes=budget(4))
    assert tier.statistics().recovered_blocks == len(ks)
    await assert_loads(tier, ks)
    await tier.aclose()


def free_blocks(path: Path) -> int:
    return os.statvfs(path).f_bfree


def namespace_dir(root: Path, model: str = "m") -> Path:
    return root / layout(model).namespace.hex()


# -- a failed open fills nothing -------------------------------------------------------------


async def test_budget_beyond_free_space_is_refused_before_anything_is_written(
    small_fs: Path,
) -> None:
    root = small_fs / "tier"
    st = os.statvfs(small_fs)
    free = st.f_bavail * st.f_frsize
    want = budget(64)  # about 870 KB on a 256 KiB filesystem
    with pytest.raises(CapacityError) as info:
        await open_ns(root, nbytes=want)
    message = str(info.value)
    assert f"{format_size(free)} free" in message
    assert f"bytes_to_use ({format_size(want)})" in message
    assert free_blocks(small_fs) == st.f_bfree
    assert not root.exists()  # made by the open, and removed with its lock


async def test_budget_beyond_the_free_space_of_tmp_is_refused(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    want = free + (1 << 40)
    root = tmp_path / "tier"
    with pytest.raises(CapacityError, match=rf" free;.*bytes_to_use \({format_size(want)}\)"):
        await open_ns(root, nbytes=want)
    assert not root.exists()
    root.mkdir()  # a root that exists stays, emptied of what the open wrote
    with pytest.raises(CapacityError):
        await open_ns(root, nbytes=want)
    assert os.listdir(root) == []


async def test_a_refused_open_states_sizes_in_units_and_leaves_no_lock(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    config = FileTierConfig(root=root, bytes_to_use="1PiB", io_engine="threads")
    with pytest.raises(CapacityError) as info:
        await FileTier.open(config, layout(), block_bytes=BLOCK)
    message = str(info.value).replace(str(root), "<root>")
    assert "bytes_to_use (1.00 PiB)" in message
    assert not re.search(r"\d{5,}", message), message  # no raw byte counts
    assert not root.exists()  # the open made it, and its lock: both gone


def test_a_waiter_on_a_removed_root_lock_takes_the_new_one(tmp_path: Path) -> None:
    first = lock_root_blocking(tmp_path)
    assert first is not None
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(lock_root_blocking(tmp_path)), daemon=True)
    waiter.start()
    time.sleep(0.2)  # it waits on the lock file first holds
    # A failed open on a root holding nothing else removes the lock file it holds.
    release_root(tmp_path, first, created_root=False)
    waiter.join(10)
    (fd,) = got
    assert fd is not None
    try:
        # The waiter did not keep the removed file's lock: it holds the file there now.
        assert os.fstat(fd).st_ino == os.stat(tmp_path / "kvtier.lock").st_ino
    finally:
        os.close(fd)


async def test_files_outside_kvtier_taking_most_of_the_budget_are_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    root.mkdir()
    want = budget(64)
    fd = os.open(root / "someone-elses.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, want * 3 // 4)
    finally:
        os.close(fd)
    outside = os.stat(root / "someone-elses.bin").st_blocks * 512
    with caplog.at_level(logging.INFO, logger="kvtier.file_tier"):
        tier = await open_ns(root, nbytes=want)
    left = tier.statistics().capacity_bytes
    assert 0 < left < want // 4
    (warned,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    said = warned.getMessage()
    assert f"someone-elses.bin ({format_size(outside)})" in said
    assert f"bytes_to_use {format_size(want)}" in said
    assert format_size(left) in said
    # At INFO, what the budget leaves the namespace, at every open.
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(f"({format_size(left)}) of bytes_to_use" in m for m in infos), infos
    await tier.aclose()
    # Outside files taking less than half draw no warning.
    os.truncate(root / "someone-elses.bin", 0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvtier.file_tier"):
        again = await open_ns(root, nbytes=want)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await again.aclose()


@pytest.fixture(params=["tmpfs", "ext4"])
def small_disk(request: pytest.FixtureRequest, mount_tmpfs: Mount, mount_ext4: Mount) -> Path:
    """A small filesystem: tmpfs (undoes a failed fallocate itself) or ext4 (does not)."""
    if request.param == "tmpfs":
        return mount_tmpfs(512 << 10)
    return mount_ext4(4 << 20)


@pytest.fixture
def fill_before_fallocate(
    monkeypatch: pytest.MonkeyPatch, fill_filesystem: Fill
) -> Callable[[Path], None]:
    """Arm: from now on ``posix_fallocate`` first fills the filesystem by writing ``filler``.

    The disk filling up after kvtier checked the free space (another writer)
    cannot be timed any other way; the ENOSPC is then the kernel's own.
    """
    real = os.posix_fallocate

    def arm(filler: Path) -> None:
        def filling(fd: int, offset: int, length: int) -> None:
            fill_filesystem(filler)
            real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", filling)

    return arm


async def test_disk_filled_after_the_check_leaves_no_new_namespace(
    small_disk: Path, fill_before_fallocate: Callable[[Path], None]
) -> None:
    root = small_disk / "tier"
    root.mkdir()
    before = free_blocks(small_disk)
    fill_before_fallocate(small_disk / "filler")
    with pytest.raises(TierIOError) as info:
        await open_ns(root, nbytes=budget(16))
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(root) == []  # its lock too: a failed open leaves no trace
    (small_disk / "filler").unlink()
    assert free_blocks(small_disk) == before


async def test_disk_filled_after_the_check_shrinks_the_slot_file_back(
    small_disk: Path, fill_before_fallocate: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = small_disk / "tier"
    ks, data = await four_blocks(root)
    size, allocated = data.stat().st_size, data.stat().st_blocks
    before = free_blocks(small_disk)
    fill_before_fallocate(small_disk / "filler")
    with pytest.raises(TierIOError) as info:
        await open_ns(root, nbytes=budget(24))
    assert info.value.errno == errno.ENOSPC
    assert (data.stat().st_size, data.stat().st_blocks) == (size, allocated)
    monkeypatch.undo()
    (small_disk / "filler").unlink()
    assert free_blocks(small_disk) == before
    await reopen_with(root, ks)


@pytest.fixture
def file_size_limit() -> Iterator[Callable[[int], None]]:
    """Set ``RLIMIT_FSIZE`` for the test (SIGXFSZ ignored, so writes fail with EFBIG)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))

    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


async def test_reservation_failing_leaves_no_namespace_behind(
    tmp_path: Path, file_size_limit: Callable[[int], None]
) -> None:
    root = tmp_path / "tier"
    file_size_limit(2 * SLOT)  # the slot file cannot be reserved: EFBIG from the kernel
    for _ in range(3):
        with pytest.raises(TierIOError) as info:
            await open_ns(root, nbytes=budget(8))
        assert info.value.errno == errno.EFBIG
        assert not root.exists()  # the open made the root: it goes, its lock with it


async def test_recovery_failing_after_the_reservation_shrinks_the_slot_file_back(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tier"
    ks, data = await four_blocks(root)
    size, allocated = data.stat().st_size, data.stat().st_blocks
    # A shared engine closed by its owner: the recovery scan's first read
    # raises, after the slot file was grown.
    engine = await open_io_engine("threads", queue_depth=4)
    await engine.aclose()
    config = FileTierConfig(root=root, bytes_to_use=budget(32))
    with pytest.raises(ClosedError):
        await FileTier.open(config, layout(), block_bytes=BLOCK, io_engine=engine)
    assert (data.stat().st_size, data.stat().st_blocks) == (size, allocated)
    await reopen_with(root, ks)


class GatedEngine(FaultyEngine):
    """Holds every read until :attr:`gate` is set; :attr:`reached` says one arrived."""

    def __init__(self, inner: IOEngine) -> None:
        super().__init__(inner)
        self.reached = asyncio.Event()
        self.gate = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def _submit_rw(
        self, read: bool, fd: int, views: list[memoryview], offset: int
    ) -> Completion[int]:
        if not read:
            return super()._submit_rw(read, fd, views, offset)
        self.reached.set()
        done: Completion[int] = Completion()

        async def later() -> None:
            await self.gate.wait()
            try:
                done.set_result(await super(GatedEngine, self)._submit_rw(read, fd, views, offset))
            except Exception as exc:
                done.set_exception(exc)

        task = asyncio.ensure_future(later())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return done


async def test_cancelled_open_shrinks_the_slot_file_back(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    ks, data = await four_blocks(root)
    size = data.stat().st_size
    engine = GatedEngine(await open_io_engine("threads", queue_depth=4))
    try:
        config = FileTierConfig(root=root, bytes_to_use=budget(32))
        task = asyncio.create_task(
            FileTier.open(config, layout(), block_bytes=BLOCK, io_engine=engine)
        )
        await engine.reached.wait()  # the slot file is grown; recovery is reading
        assert data.stat().st_size == 32 * SLOT
        task.cancel()
        engine.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        engine.gate.set()
        await engine.aclose()
    assert data.stat().st_size == size
    await reopen_with(root, ks)


# -- the budget is the root's ---------------------------------------------------------------


async def quarantine(tier: FileTier, ks: list[bytes]) -> None:
    """Damage the payload of each block and load it, so that verification fails."""
    data = tier.path / "blocks.dat"
    fd = os.open(data, os.O_WRONLY)
    try:
        for k in ks:
            slot = tier.slot_of(k)
            assert slot is not None
            os.pwrite(fd, b"\xff" * 16, slot * SLOT + HEADER_BYTES)
    finally:
        os.close(fd)
    result = await tier.load(ks, rows(ks))
    assert result.loaded == ()
    await tier.aclose()  # waits for the quarantine copies


async def test_the_root_never_takes_more_than_the_budget(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    limit = budget(40)
    seen: list[int] = []

    def check(where: str) -> None:
        seen.append(usage(root))
        assert seen[-1] <= limit, f"{where}: {seen[-1]} bytes on disk, budget {limit}"

    # One namespace, then quarantines: 40 slots keep 2 whole-slot copies.
    a = await open_ns(root, "a", limit)
    assert a.statistics().capacity_bytes == 40 * SLOT
    await store(a, keys(40))
    check("a full")
    await quarantine(a, keys(40)[:6])
    assert len(os.listdir(a.path / "quarantine")) == 2
    check("a quarantined")
    # Another model, dtype or block size: another namespace. It takes a's
    # room (a is not open), never a second budget; here, half of it.
    b = await open_ns(root, "b", limit // 2, block=2 * BLOCK)
    check("b open")
    assert not namespace_dir(root, "a").exists()
    await b.store(keys(3), rows(keys(3), 2 * BLOCK))
    await b.aclose()
    # Reclaim off: a third namespace gets what b leaves.
    c = await open_ns(root, "c", limit, reclaim="off")
    check("c beside b")
    await store(c, keys(2))
    await c.aclose()
    # A smaller budget, then a larger one.
    small = await open_ns(root, "c", limit // 2)
    check("c at half the budget")
    assert usage(root) <= limit // 2
    await small.aclose()
    big = await open_ns(root, "c", 2 * limit)
    assert usage(root) <= 2 * limit
    await big.aclose()
    # Two open at once: the second gets what the first leaves.
    first = await open_ns(root, "a", limit // 2)
    second = await open_ns(root, "d", limit)
    check("a and d open")
    await first.aclose()
    await second.aclose()
    check("end")


async def test_open_namespaces_keep_their_share(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    a = await open_ns(root, "a", budget(16))
    b = await open_ns(root, "b", 2 * budget(16))
    assert a.statistics().capacity_bytes == b.statistics().capacity_bytes == 16 * SLOT
    assert usage(root) <= 2 * budget(16)
    await store(a, keys(16))
    await store(b, keys(16))
    with pytest.raises(CapacityError) as info:
        await open_ns(root, "c", 2 * budget(16))
    message = str(info.value)
    assert f"bytes_to_use ({format_size(2 * budget(16))})" in message
    assert "open namespaces" in message
    assert a.path.name in message
    assert b.path.name in message
    assert not namespace_dir(root, "c").exists()
    await assert_loads(a, keys(16))
    await a.aclose()
    await b.aclose()


async def test_reclaim_off_opens_with_what_is_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    a = await open_ns(root, "a", budget(16))
    await store(a, keys(3))
    await a.aclose()
    with caplog.at_level(logging.WARNING, logger="kvtier.file_tier"):
        b = await open_ns(root, "b", 2 * budget(16), reclaim="off")
    # a holds what it has on disk; b gets the rest (a closed namespace's unused
    # quarantine allowance is not held for it).
    assert b.statistics().capacity_bytes >= 16 * SLOT
    assert any(
        "not open (reclaim is off)" in r.getMessage() and a.path.name in r.getMessage()
        for r in caplog.records
    )
    await b.aclose()
    with pytest.raises(CapacityError, match="reclaim is off"):
        await open_ns(root, "c", 2 * budget(16), reclaim="off")
    assert usage(root) <= 2 * budget(16)
    again = await open_ns(root, "a", 2 * budget(16), reclaim="off")  # a kept its blocks
    await assert_loads(again, keys(3))
    await again.aclose()


@pytest.mark.parametrize("older", ["x", "y"])
async def test_lru_reclaims_the_least_recently_used_first_and_only_what_it_needs(
    tmp_path: Path, older: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    for model, nbytes in (("x", budget(1)), ("y", 2 * budget(1))):
        tier = await open_ns(root, model, nbytes, reclaim="off")
        await store(tier, keys(1))
        await tier.aclose()
    now = time.time()
    for model, age in (("x", 1000 if older == "x" else 10), ("y", 1000 if older == "y" else 10)):
        os.utime(namespace_dir(root, model) / "lock", (now - age, now - age))
    big = 1 << 20
    sizes = {m: usage(namespace_dir(root, m)) for m in ("x", "y")}
    # Room for two 1 MiB slots once either small namespace is gone, not with both.
    gone = namespace_dir(root, older).name
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        d = await open_ns(root, "d", budget(2, big) + max(sizes.values()), block=big)
    assert d.statistics().capacity_bytes == 2 * (HEADER_BYTES + big)
    # Another model's cache went away: a WARNING naming it, its model and its size.
    (said,) = [r for r in caplog.records if "reclaimed namespace" in r.getMessage()]
    assert said.levelno == logging.WARNING
    assert f"{gone} ({older}, {format_size(sizes[older])})" in said.getMessage()
    newer = "y" if older == "x" else "x"
    assert not namespace_dir(root, older).exists()
    assert namespace_dir(root, newer).exists()
    await d.aclose()


async def test_reclaim_removes_only_what_kvtier_wrote(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    x = await open_ns(root, "x", budget(4))
    await store(x, keys(2))
    await x.aclose()
    ns_x = namespace_dir(root, "x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"p" * 5000)
    # Files kvtier did not write, in and beside its namespaces.
    (ns_x / "notes.txt").write_text("an operator's notes")
    (ns_x / "quarantine" / "link").symlink_to(outside / "precious")
    foreign = root / ("f" * 32)  # a namespace name without namespace.json
    foreign.mkdir()
    (foreign / "data").write_bytes(b"d" * 100)
    mislabeled = root / ("e" * 32)  # a namespace.json naming another namespace
    mislabeled.mkdir()
    (mislabeled / "namespace.json").write_bytes((ns_x / "namespace.json").read_bytes())
    (mislabeled / "blocks.dat").write_bytes(b"b" * 100)
    fake = outside / "fake"  # a symlinked namespace, with a valid description
    fake.mkdir()
    (fake / "namespace.json").write_bytes((ns_x / "namespace.json").read_bytes())
    (fake / "blocks.dat").write_bytes(b"b" * 100)
    (root / ("a" * 32)).symlink_to(fake)
    d = await open_ns(root, "d", budget(8))
    assert d.statistics().capacity_bytes >= SLOT
    await d.aclose()
    assert not (ns_x / "blocks.dat").exists()
    assert not (ns_x / "namespace.json").exists()
    assert (ns_x / "notes.txt").read_text() == "an operator's notes"
    assert (ns_x / "quarantine" / "link").is_symlink()
    assert (outside / "precious").read_bytes() == b"p" * 5000
    assert (foreign / "data").read_bytes() == b"d" * 100
    assert (mislabeled / "blocks.dat").read_bytes() == b"b" * 100
    assert (fake / "blocks.dat").read_bytes() == b"b" * 100
    assert (root / ("a" * 32)).is_symlink()


def format_1_leftovers(ns_dir: Path, key: bytes) -> Path:
    """What format 1 (one file per block) left in a namespace directory: ``blocks/<fan>/<key>``."""
    fan = ns_dir / "blocks" / key.hex()[:2]
    fan.mkdir(parents=True)
    (fan / key.hex()).write_bytes(b"v" * SLOT)
    return fan / key.hex()


async def test_a_format_1_directory_is_reused_and_what_it_left_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    ns_dir = namespace_dir(root)
    ns_dir.mkdir(parents=True)
    old = format_1_leftovers(ns_dir, keys(1)[0])
    desc = {"format": "kvtier file tier", "format_version": 1, "namespace": ns_dir.name}
    (ns_dir / "namespace.json").write_text(json.dumps({**desc, "block_bytes": BLOCK}))
    limit = budget(16)
    with caplog.at_level(logging.WARNING, logger="kvtier.file_tier"):
        tier = await open_ns(root, nbytes=limit)
    assert any("format 1" in r.getMessage() for r in caplog.records)
    assert tier.path == ns_dir
    written = json.loads((ns_dir / "namespace.json").read_text())
    assert (written["format_version"], written["slot_bytes"]) == (2, SLOT)
    assert tier.statistics().recovered_blocks == 0
    # What format 1 left is not kvtier's any more: kept as it is, and counted.
    assert old.read_bytes() == b"v" * SLOT
    slots = tier.statistics().capacity_bytes // SLOT
    assert 1 <= slots <= 16
    await store(tier, keys(slots, salt=1))
    assert usage(root) <= limit
    await tier.aclose()
    assert old.read_bytes() == b"v" * SLOT


async def test_a_format_1_tree_outlives_a_reclaim_and_counts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "tier"
    x = await open_ns(root, "x", budget(4))
    await store(x, keys(2))
    await x.aclose()
    ns_x = namespace_dir(root, "x")
    old = format_1_leftovers(ns_x, keys(1)[0])
    limit = budget(8)
    with caplog.at_level(logging.WARNING, logger="kvtier.file_tier"):
        d = await open_ns(root, "d", limit)
    # x was reclaimed for d: what kvtier wrote in it went; the old tree stayed, and counts.
    assert any("reclaimed namespace " + ns_x.name in r.getMessage() for r in caplog.records)
    assert any("kvtier did not write" in r.getMessage() for r in caplog.records)
    assert not (ns_x / "blocks.dat").exists()
    assert not (ns_x / "namespace.json").exists()
    assert old.read_bytes() == b"v" * SLOT
    slots = d.statistics().capacity_bytes // SLOT
    assert slots >= 1
    await store(d, keys(slots, salt=1))
    assert usage(root) <= limit
    await d.aclose()
    # No namespace.json left: a directory kvtier does not recognize, never removed.
    done = collect(root, unused_for=0)
    assert ns_x.name not in {ns.name for ns in done.chosen}
    (kept,) = [ns for ns in done.kept if ns.name == ns_x.name]
    assert kept.problem == "no namespace.json"
    assert old.read_bytes() == b"v" * SLOT


_OPENER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from kvtier.config import FileTierConfig
    from kvtier.errors import CapacityError
    from kvtier.layout import KVLayout, TensorSpec
    from kvtier.tiers.file import FileTier

    root, model, nbytes, sync = sys.argv[1:]
    spec = TensorSpec(name="kv", shape=(8, 2048), dtype="float16", itemsize=2, kv_first=False)
    layout = KVLayout(tensors=(spec,), model_id=model, block_tokens=16)

    async def main():
        while not os.path.exists(os.path.join(sync, "go")):
            time.sleep(0.001)
        config = FileTierConfig(root=root, bytes_to_use=int(nbytes))
        try:
            tier = await FileTier.open(config, layout, block_bytes=8192)
        except CapacityError as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            return
        except BaseException as exc:
            print(json.dumps({"crash": repr(exc)}), flush=True)
            raise
        print(json.dumps({"capacity": tier.statistics().capacity_bytes}), flush=True)
        while not os.path.exists(os.path.join(sync, "done")):
            await asyncio.sleep(0.01)
        await tier.aclose()

    asyncio.run(main())
    """
)


def test_two_processes_opening_at_once_do_not_both_take_the_budget(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    sync = tmp_path / "sync"
    sync.mkdir()
    limit = budget(64)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPENER, str(root), model, str(limit), str(sync)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for model in ("p", "q")
    ]
    try:
        time.sleep(0.5)  # both interpreters started and waiting
        (sync / "go").touch()
        results = []
        for proc in procs:
            assert proc.stdout is not None
            results.append(json.loads(proc.stdout.readline()))
        # Both have opened or given up, and the one that opened is still open.
        assert usage(root) <= limit
        (sync / "done").touch()
        for proc in procs:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    opened = [r for r in results if "capacity" in r]
    refused = [r for r in results if "error" in r]
    assert len(opened) == 1, results
    assert len(refused) == 1, results
    assert "open namespaces" in refused[0]["error"]


# -- namespace.json of the wrong shape ---------------------------------------------------------


def _shape(desc: dict[str, Any], name: str) -> tuple[bytes, str]:
    """``namespace.json`` bytes of the named wrong shape, and what the error must name."""

    def changed(field: str, value: object) -> bytes:
        return json.dumps({**desc, field: value}).encode()

    missing = {k: v for k, v in desc.items() if k != "block_bytes"}
    shapes: dict[str, tuple[bytes, str]] = {
        "array": (b"[1, 2, 3]", "JSON array"),
        "string": (b'"kvtier"', "JSON string"),
        "number": (b"42", "JSON number"),
        "null": (b"null", "JSON null"),
        "not-json": (b'{"format": ', "not valid JSON"),
        "digits-past-the-limit": (b'{"block_bytes": ' + b"9" * 5000 + b"}", "not valid JSON"),
        "huge-size": (changed("block_bytes", 10**30), "'block_bytes' is out of range"),
        "float-size": (changed("block_bytes", 8192.0), "'block_bytes' is not an integer"),
        "bool-size": (changed("block_bytes", True), "'block_bytes' is not an integer"),
        "string-size": (changed("block_bytes", "8192"), "'block_bytes' is not an integer"),
        "missing-size": (
            json.dumps(missing).encode(),
            "'block_bytes' is not an integer (got missing)",
        ),
        "slot-size": (changed("slot_bytes", 1), "'slot_bytes' is not 4096 + block_bytes"),
        "namespace-int": (changed("namespace", 5), "'namespace' is not 32 lowercase hex"),
        "version-string": (changed("format_version", "2"), "'format_version' is not an integer"),
        "version-newer": (changed("format_version", 3), "'format_version' is newer"),
        "layout-array": (changed("layout", []), "'layout' is not an object"),
        "format-other": (changed("format", "other"), "'format' is not 'kvtier file tier'"),
    }
    return shapes[name]


SHAPES = [
    "array",
    "string",
    "number",
    "null",
    "not-json",
    "digits-past-the-limit",
    "huge-size",
    "float-size",
    "bool-size",
    "string-size",
    "missing-size",
    "slot-size",
    "namespace-int",
    "version-string",
    "version-newer",
    "layout-array",
    "format-other",
]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("shape", SHAPES)
async def test_malformed_namespace_json_is_a_typed_error_and_releases_everything(
    tmp_path: Path, shape: str
) -> None:
    root = tmp_path / "tier"
    tier = await open_ns(root, nbytes=budget(4))
    await store(tier, keys(2))
    await tier.aclose()
    desc_path = tier.path / "namespace.json"
    data = tier.path / "blocks.dat"
    text, needle = _shape(json.loads(desc_path.read_text()), shape)
    desc_path.write_bytes(text)
    before = (open_fds(), data.stat().st_size, data.stat().st_mtime_ns)
    for _ in range(3):
        with pytest.raises(TierIOError) as info:
            await open_ns(root, nbytes=budget(4))
        assert info.value.errno == errno.EUCLEAN
        assert info.value.path == str(desc_path)
        assert needle in str(info.value)
    assert (open_fds(), data.stat().st_size, data.stat().st_mtime_ns) == before
    # Nothing else was touched, and the lock was released: with its
    # description back, the namespace opens with its blocks.
    desc_path.write_text(json.dumps(json.loads(_valid_text(tier.path))))
    again = await open_ns(root, nbytes=budget(4))
    await assert_loads(again, keys(2))
    await again.aclose()


def _valid_text(ns_dir: Path) -> str:
    return json.dumps(
        {
            "format": "kvtier file tier",
            "format_version": 2,
            "layout_kind": "slots",
            "namespace": ns_dir.name,
            "block_bytes": BLOCK,
            "slot_bytes": SLOT,
            "header_bytes": HEADER_BYTES,
            "alignment": 4096,
            "layout": layout().describe(),
        }
    )
