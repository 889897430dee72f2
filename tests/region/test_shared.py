"""Shared CPU regions across real worker processes on the real /dev/shm."""

from __future__ import annotations

import gc
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.processes import Children

from kvtier.cli import main
from kvtier.errors import InvalidArgumentError, SharedRegionError
from kvtier.layout import KVLayout
from kvtier.region import CPURegion, _shm, reap_shared_regions

WORKER = Path(__file__).with_name("_worker.py")
BUDGET = 1 << 20
Leftovers = Callable[[str], list[Any]]


class Workers(Children):
    """Worker processes of one test; every one still running at the end is killed."""

    def spawn(  # type: ignore[override]
        self,
        name: str,
        world: int,
        rank: int | str,
        mode: str,
        *extra: str,
        budget: int = BUDGET,
    ) -> subprocess.Popen[str]:
        return super().spawn(str(WORKER), name, world, rank, budget, mode, *extra)

    report = staticmethod(Children.line)

    def finish(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        out = self.report(proc)
        assert proc.wait(timeout=20) == 0
        return out


@pytest.fixture
def workers() -> Iterator[Workers]:
    group = Workers()
    yield group
    group.kill_all()


@pytest.mark.parametrize("world", [2, 4])
def test_workers_see_each_others_slices(
    workers: Workers, leftovers: Leftovers, shm_name: str, world: int
) -> None:
    procs = [workers.spawn(shm_name, world, rank, "exchange") for rank in range(world)]
    reports = [workers.finish(p) for p in procs]
    assert all(r["saw_all"] for r in reports), reports
    assert all(r["padding_zero"] for r in reports), reports
    assert sum(r["created"] for r in reports) == 1
    assert {r["backing"] for r in reports} <= {"shm", "hugetlbfs"}
    assert not leftovers(shm_name)


def test_creation_race_has_exactly_one_creator(
    workers: Workers, leftovers: Leftovers, shm_name: str
) -> None:
    world = 8
    procs = [workers.spawn(shm_name, world, rank, "exchange", "gate") for rank in range(world)]
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:  # release them together
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = [workers.finish(p) for p in procs]
    assert all("error" not in r for r in reports), reports
    assert sum(r["created"] for r in reports) == 1
    assert all(r["saw_all"] for r in reports), reports
    assert not leftovers(shm_name)


def test_sigkill_after_everyone_attached_leaves_no_file(
    workers: Workers, leftovers: Leftovers, shm_name: str
) -> None:
    procs = [workers.spawn(shm_name, 3, rank, "hold") for rank in range(3)]
    reports = [workers.report(p) for p in procs]
    assert sum(r["created"] for r in reports) == 1
    # Every worker has mapped it: the name is already gone, so no crash can leak it.
    assert not leftovers(shm_name)
    procs[1].send_signal(signal.SIGKILL)
    assert procs[1].wait() == -signal.SIGKILL
    assert not leftovers(shm_name)
    for proc in (procs[0], procs[2]):
        proc.kill()
        proc.wait()
    assert not leftovers(shm_name)


def test_crash_before_everyone_attached_is_recreated_fresh(
    workers: Workers, leftovers: Leftovers, shm_name: str, layout: KVLayout
) -> None:
    procs = [workers.spawn(shm_name, 3, rank, "hold") for rank in range(2)]
    for proc in procs:
        workers.report(proc)
    for proc in procs:
        proc.kill()
        proc.wait()
    # Rank 2 never came: the name is still there, but nobody holds the region...
    assert leftovers(shm_name)
    # ...so the next run removes the abandoned file and starts afresh.
    again = [workers.spawn(shm_name, 3, rank, "exchange") for rank in range(3)]
    reports = [workers.finish(p) for p in again]
    assert all(r["saw_all"] for r in reports), reports
    assert sum(r["created"] for r in reports) == 1
    assert not leftovers(shm_name)


def test_last_close_removes_the_file_before_everyone_attached(
    layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    first = CPURegion.create(layout, BUDGET, world_size=3, shared_name=shm_name, pin="off")
    second = CPURegion.create(layout, BUDGET, world_size=3, rank=1, shared_name=shm_name, pin="off")
    assert leftovers(shm_name)
    first.close()
    assert leftovers(shm_name)  # rank 1 still holds it
    second.close()
    assert not leftovers(shm_name)


# A creator that dies part way: it follows the real protocol (unnamed file,
# mutex taken, linked under the name, sized) and then stops before the header
# is marked ready, as a creator SIGKILLed between ftruncate and populate would.
STUCK_CREATOR = textwrap.dedent(
    """
    import fcntl, os, sys, time
    from kvtier.region import _shm
    path = _shm.region_path(sys.argv[1])
    fd = os.open(_shm.SHM_DIR, os.O_TMPFILE | os.O_RDWR, 0o600)
    assert _shm._setlk(fd, fcntl.F_WRLCK, _shm._MUTEX)
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    os.ftruncate(fd, 64 << 20)
    print("ready", flush=True)
    time.sleep(3600)
    """
)


def test_joiner_times_out_then_sees_that_the_creator_died(
    workers: Workers, layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    creator = subprocess.Popen(
        [sys.executable, "-c", STUCK_CREATOR, shm_name], stdout=subprocess.PIPE, text=True
    )
    workers.procs.append(creator)
    assert creator.stdout is not None
    assert creator.stdout.readline().strip() == "ready"
    start = time.monotonic()
    with pytest.raises(SharedRegionError, match=r"not ready within join_timeout=0\.3"):
        CPURegion.create(
            layout, BUDGET, world_size=2, shared_name=shm_name, join_timeout=0.3, pin="off"
        )
    assert 0.3 <= time.monotonic() - start < 5
    assert leftovers(shm_name)
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    with pytest.raises(SharedRegionError, match="died before the region was ready"):
        CPURegion.create(
            layout, BUDGET, world_size=2, shared_name=shm_name, join_timeout=5, pin="off"
        )
    assert not leftovers(shm_name)  # the partial file was removed
    # so the next attempt creates it afresh
    with CPURegion.create(
        layout, BUDGET, world_size=2, shared_name=shm_name, join_timeout=5, pin="off"
    ) as region:
        assert region.statistics().created
    assert not leftovers(shm_name)


def test_file_is_private_to_its_owner(layout: KVLayout, shm_name: str) -> None:
    with CPURegion.create(layout, BUDGET, world_size=2, shared_name=shm_name, pin="off"):
        mode = os.stat(f"/dev/shm/kvtier-{shm_name}").st_mode & 0o777
        assert mode == 0o600


@pytest.mark.skipif(
    _shm._hugetlbfs_dir(8 << 20) is None,
    reason="no hugetlbfs mount with reserved huge pages (vm.nr_hugepages)",
)
def test_hugetlbfs_backs_a_shared_region_where_huge_pages_are_reserved(
    layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    a = CPURegion.create(layout, 8 << 20, world_size=2, shared_name=shm_name, pin="off")
    b = CPURegion.create(layout, 8 << 20, world_size=2, rank=1, shared_name=shm_name, pin="off")
    try:
        stats = a.statistics()
        assert stats.backing == "hugetlbfs"
        assert stats.page_size >= 2 << 20
        assert a.row_address(0) % stats.page_size == 0
        a.row(5)[:3] = b"abc"
        assert bytes(b.row(5)[:3]) == b"abc"
        assert not leftovers(shm_name)
        where, _size = _shm._hugetlbfs_dir(0) or ("", 0)
        assert not [f for f in os.listdir(where) if shm_name in f]
    finally:
        a.close()
        b.close()


def test_a_real_creator_stopped_then_killed_part_way(
    workers: Workers, layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    path = f"/dev/shm/kvtier-{shm_name}"
    # 1 GiB takes the creator a few hundred ms to allocate: stop it in there.
    creator = workers.spawn(shm_name, 2, 0, "hold", budget=1 << 30)
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the creator never made its file"
        assert creator.poll() is None
        time.sleep(0.0005)
    creator.send_signal(signal.SIGSTOP)
    with open(path, "rb") as f:
        ready = f.read(8) == b"KVTIERRG"
    if ready:  # pragma: no cover - the creator was faster than this poll
        pytest.skip("the creator finished before it could be stopped")
    with pytest.raises(SharedRegionError, match="creator is alive but has not finished"):
        CPURegion.create(
            layout, 1 << 30, world_size=2, rank=1, shared_name=shm_name, join_timeout=0.2
        )
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    with pytest.raises(SharedRegionError, match="died before the region was ready"):
        CPURegion.create(layout, 1 << 30, world_size=2, rank=1, shared_name=shm_name, pin="off")
    assert not leftovers(shm_name)


def test_an_unclosed_region_gives_up_its_hold_when_collected(
    layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    region = CPURegion.create(layout, BUDGET, world_size=2, shared_name=shm_name, pin="off")
    assert leftovers(shm_name)
    del region
    gc.collect()
    assert not leftovers(shm_name)


@pytest.mark.parametrize(
    ("offset", "value"),
    [
        pytest.param(76, struct.pack("<Q", 0), id="page-size-zero"),
        pytest.param(76, struct.pack("<Q", 4097), id="page-size-not-a-power-of-two"),
        pytest.param(24, struct.pack("<Q", 1 << 60), id="data-bytes-huge"),
        pytest.param(16, struct.pack("<Q", 4096 * 3), id="data-offset-elsewhere"),
        pytest.param(100, b"\xff\xfe/not-utf8", id="data-path-not-text"),
        pytest.param(100, b"relative/hugepage-file", id="data-path-relative"),
    ],
)
def test_a_damaged_header_is_a_typed_error(
    layout: KVLayout, shm_name: str, leftovers: Leftovers, offset: int, value: bytes
) -> None:
    # The rendezvous file is writable by every process of the user: what a
    # joiner reads back from it is checked field by field before it is used.
    first = CPURegion.create(layout, BUDGET, world_size=2, shared_name=shm_name, pin="off")
    try:
        fd = os.open(_shm.region_path(shm_name), os.O_WRONLY)
        try:
            os.pwrite(fd, value, offset)
        finally:
            os.close(fd)
        with pytest.raises(SharedRegionError, match="damaged header"):
            CPURegion.create(layout, BUDGET, world_size=2, rank=1, shared_name=shm_name, pin="off")
    finally:
        first.close()
    assert not leftovers(shm_name)


def test_a_holder_joins_ranks_that_started_first(
    layout: KVLayout, shm_name: str, leftovers: Leftovers
) -> None:
    # vLLM builds its workers' KV caches (the ranks attach) before its
    # scheduler (the holder). Without holder=True the last rank unlinked the
    # name and the holder created a second region: the two sides then saw
    # different bytes, silently.
    inst = bytes(range(16))

    def open_region(rank: int | None) -> CPURegion:
        return CPURegion.create(
            layout,
            BUDGET,
            world_size=2,
            rank=rank,
            shared_name=shm_name,
            instance=inst,
            holder=rank is not None,
            pin="off",
        )

    ranks = [open_region(0)]
    whole = open_region(None)
    try:
        with pytest.raises(SharedRegionError, match="another instance"):
            open_region(None)  # one holder per instance
        ranks.append(open_region(1))
        assert not leftovers(shm_name)  # every party attached: the name is gone
        for r, region in enumerate(ranks):
            for t in region.tensor_views():
                t[3].fill_(0x11 * (r + 1))
        row = bytes(whole.row(3))
        for r in (0, 1):
            piece = row[r * whole.slice_bytes : (r + 1) * whole.slice_bytes]
            assert piece == bytes([0x11 * (r + 1)]) * whole.slice_bytes
        whole.row(5)[:] = b"\x7f" * whole.row_stride
        assert all(bool((t[5] == 0x7F).all()) for t in ranks[0].tensor_views())
    finally:
        whole.close()
        for region in ranks:
            region.close()


def test_holder_true_needs_a_rank_and_a_name(layout: KVLayout, shm_name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="holder=True"):
        CPURegion.create(layout, BUDGET, rank=0, holder=True, pin="off")
    with pytest.raises(InvalidArgumentError, match="holder=True"):
        CPURegion.create(layout, BUDGET, rank=None, shared_name=shm_name, holder=True)


@pytest.mark.parametrize(
    "parties",
    [
        pytest.param([("holder", "hold"), (0, "hold")], id="instance-killed-before-rank-1-came"),
        pytest.param(
            [(0, "hold-for-holder"), (1, "hold-for-holder")], id="ranks-killed-before-the-holder"
        ),
    ],
)
def test_the_reaper_removes_what_sigkilled_parties_left(
    workers: Workers,
    leftovers: Leftovers,
    shm_name: str,
    parties: list[tuple[int | str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _shm.region_path(shm_name)
    procs = []
    for rank, mode in parties:  # one after the other: the first creates
        procs.append(workers.spawn(shm_name, 2, rank, mode))
        assert "rows" in workers.report(procs[-1])
    # Dry runs, and a real reap of this test's file only: other test runs on the
    # machine may be looking at stale files of their own.
    mine = _shm.FILE_PREFIX + shm_name
    assert path not in _shm.reap(prefix=mine)  # alive: never reaped
    assert leftovers(shm_name)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Not every party attached: the name stayed, and nobody holds the file now.
    assert leftovers(shm_name)
    assert path not in reap_shared_regions(older_than=3600, dry_run=True)  # too recent
    assert path in reap_shared_regions(dry_run=True)
    assert main(["gc", "--shm", "--dry-run", "--json"]) == 0  # the same, by hand
    assert path in json.loads(capsys.readouterr().out)["removed"]
    assert leftovers(shm_name)
    assert _shm.reap(prefix=mine) == [path]
    assert not leftovers(shm_name)


def test_creating_a_region_reaps_files_stale_for_a_minute(
    workers: Workers, leftovers: Leftovers, shm_name: str, layout: KVLayout
) -> None:
    proc = workers.spawn(shm_name, 2, 0, "hold")
    workers.report(proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = time.time() - _shm.REAP_AFTER - 1
    os.utime(_shm.region_path(shm_name), (stale, stale))
    with CPURegion.create(layout, BUDGET, world_size=1, shared_name=f"{shm_name}-b", pin="off"):
        assert not leftovers(shm_name)


def test_the_reaper_leaves_files_it_did_not_write(shm_name: str) -> None:
    path = _shm.region_path(shm_name)
    with open(path, "wb") as f:
        f.write(b"not a region")
    try:
        assert path not in reap_shared_regions(dry_run=True)
        assert _shm.reap(prefix=path.rsplit("/", 1)[1]) == []
    finally:
        os.unlink(path)
    with pytest.raises(InvalidArgumentError):
        reap_shared_regions(-1)


def test_a_shared_region_beyond_dev_shm_names_the_budget(layout: KVLayout, shm_name: str) -> None:
    from kvtier.errors import CapacityError

    with pytest.raises(CapacityError, match="lower cpu_bytes_to_use"):
        CPURegion.create(layout, 1 << 40, shared_name=shm_name)


def test_a_shared_region_beyond_memory_is_refused(layout: KVLayout, shm_name: str) -> None:
    """/dev/shm may be larger than what memory is available: the OOM killer must not pay."""
    from kvtier.errors import CapacityError
    from kvtier.shm import memory_bytes

    st = os.statvfs("/dev/shm")
    shm_free = st.f_bavail * st.f_frsize
    _, available = memory_bytes()
    budget = available + (64 << 20)
    if shm_free <= budget:
        pytest.skip(
            f"/dev/shm has {shm_free} bytes free, not more than the memory available "
            f"({available}): a budget between the two cannot be formed on this machine"
        )
    with pytest.raises(CapacityError, match=r"available memory.*lower cpu_bytes_to_use"):
        CPURegion.create(layout, budget, shared_name=shm_name)
