"""The CPU region in one process: geometry, budget, alignment, views, lifetime, errors."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import shm
from kvtier.errors import (
    CapacityError,
    ClosedError,
    ConfigurationError,
    InvalidArgumentError,
    SharedRegionError,
)
from kvtier.layout import KVLayout
from kvtier.region import CPURegion, RegionStatistics

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def vma_of(addr: int) -> tuple[int, int]:
    """The [start, end) of this process's mapping containing ``addr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return lo, hi
    raise LookupError(f"0x{addr:x} is not mapped")


def mapped_ranges() -> list[tuple[int, int]]:
    """Every [start, end) of this process's mappings."""
    with open("/proc/self/maps") as f:
        return [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f]  # type: ignore[misc]


def covered(lo: int, hi: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether every byte of [lo, hi) lies in one of ``ranges``."""
    at = lo
    for a, b in sorted(ranges):
        if a <= at < b:
            at = b
        if at >= hi:
            return True
    return at >= hi


def is_mapped(addr: int) -> bool:
    try:
        vma_of(addr)
    except LookupError:
        return False
    return True


# -- budget and geometry -------------------------------------------------------------------


LayoutFactory = Callable[..., KVLayout]
Leftovers = Callable[[str], list[Any]]

LAYOUTS: dict[str, dict[str, Any]] = {
    "page-multiple": {"block_bytes": (1024, 1024), "blocks_per_chunk": 2},
    "odd-slice": {"block_bytes": (100, 3000), "blocks_per_chunk": 3},
    "one-tensor": {"block_bytes": (20000,), "blocks_per_chunk": 1},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("alignment", [None, 8192])
def test_budget_sweep_never_exceeds_the_budget(
    layout_factory: LayoutFactory, name: str, alignment: int | None
) -> None:
    layout = layout_factory(**LAYOUTS[name])
    align = max(alignment or PAGE, PAGE)
    stride = shm.round_up(layout.bytes_per_chunk, align)
    budgets = [stride, stride + 1, 2 * stride - 1, 2 * stride, 7 * stride + 4095, 3 * MiB + 17]
    for budget in budgets:
        before = mapped_ranges()
        with CPURegion.create(layout, budget, alignment=alignment, pin="off") as region:
            stats = region.statistics()
            assert region.row_stride == stride
            assert region.slice_bytes == layout.bytes_per_chunk
            assert region.rows == budget // stride
            assert stats.mapped_bytes == region.rows * stride <= budget
            # The kernel mapping itself is exactly the rows: nothing over-reserved stays.
            # The kernel may merge it with a neighbouring anonymous mapping of the
            # same flags (one that other tests' threads left): what lies beyond the
            # rows in its VMA must have been mapped before the region was.
            start = region.row_address(0)
            end = start + stats.mapped_bytes
            lo, hi = vma_of(start)
            assert lo <= start
            assert end <= hi
            assert covered(lo, start, before), "mapped below the rows by the region"
            assert covered(end, hi, before), "mapped above the rows by the region"


def test_budget_below_one_row_says_what_a_row_needs(layout: KVLayout) -> None:
    stride = shm.round_up(layout.bytes_per_chunk, PAGE)
    with pytest.raises(CapacityError, match=f"a row needs {stride} bytes"):
        CPURegion.create(layout, stride - 1, pin="off")


@pytest.mark.parametrize("alignment", [None, 512, 4096, 65536, 2 * MiB], ids=str)
def test_every_row_address_is_aligned(layout: KVLayout, alignment: int | None) -> None:
    with CPURegion.create(layout, 8 * MiB, alignment=alignment, pin="off") as region:
        want = max(alignment or PAGE, PAGE)
        assert region.alignment == want
        assert region.row_stride % want == 0
        for i in range(region.rows):
            assert region.row_address(i) % want == 0
            assert len(region.row(i)) == region.row_stride


def test_large_regions_start_on_a_huge_page(layout: KVLayout) -> None:
    with CPURegion.create(layout, 6 * MiB, pin="off") as region:
        assert region.row_address(0) % shm.PMD_SIZE == 0


@pytest.mark.parametrize("alignment", [0, -4096, 3, 4097, 12288, True, 4096.0], ids=repr)
def test_alignment_must_be_a_power_of_two(layout: KVLayout, alignment: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="alignment"):
        CPURegion.create(layout, 8 * MiB, alignment=alignment, pin="off")


# -- views -----------------------------------------------------------------------------------


def test_tensor_views_shape_stride_offset_and_zero_copy(layout_factory: LayoutFactory) -> None:
    layout = layout_factory(block_bytes=(100, 3000, 512), blocks_per_chunk=3)
    with CPURegion.create(layout, 2 * MiB, pin="off") as region:
        views = region.tensor_views()
        base = region.rows_view()
        assert base.shape == (region.rows, region.row_stride)
        assert base.dtype == torch.uint8
        assert base.data_ptr() == region.row_address(0)
        assert len(views) == len(layout.tensors)
        for i, (view, spec) in enumerate(zip(views, layout.tensors, strict=True)):
            width = spec.bytes_per_block * layout.blocks_per_chunk
            assert view.dtype == torch.uint8
            assert view.shape == (region.rows, width)
            assert view.stride() == (region.row_stride, 1)
            assert view.data_ptr() == region.row_address(0) + layout.tensor_offset(i)
            view[region.rows - 1, width - 1] = 200 + i
            row = region.row(region.rows - 1)
            assert row[layout.tensor_offset(i) + width - 1] == 200 + i
        # and the other way round: bytes written into a row show in the views
        region.row(1)[layout.tensor_offset(2) : layout.tensor_offset(2) + 4] = b"\x01\x02\x03\x04"
        assert views[2][1, :4].tolist() == [1, 2, 3, 4]
        assert views[2].untyped_storage().data_ptr() == region.row_address(0)


def test_rows_are_padded_at_their_end(
    layout_factory: LayoutFactory, leftovers: Leftovers, shm_name: str
) -> None:
    layout = layout_factory(block_bytes=(100, 3000), blocks_per_chunk=3)
    slice_bytes = layout.bytes_per_chunk
    regions = [
        CPURegion.create(layout, 1 * MiB, world_size=3, rank=r, shared_name=shm_name, pin="off")
        for r in range(3)
    ]
    try:
        a = regions[0]
        assert a.row_stride == shm.round_up(3 * slice_bytes, PAGE) > 3 * slice_bytes
        for r, region in enumerate(regions):
            for i, view in enumerate(region.tensor_views()):
                assert view.data_ptr() - region.row_address(0) == (
                    r * slice_bytes + layout.tensor_offset(i)
                )
                view.fill_(r + 1)
        for region in regions:
            for i in range(region.rows):
                row = np.frombuffer(region.row(i), dtype=np.uint8)
                for r in range(3):
                    assert (row[r * slice_bytes : (r + 1) * slice_bytes] == r + 1).all()
                assert (row[3 * slice_bytes :] == 0).all()
        # tensor_views(rank=) of another worker is that worker's slice
        other = regions[0].tensor_views(rank=2)[0]
        assert other.data_ptr() - a.row_address(0) == 2 * slice_bytes
    finally:
        for region in regions:
            region.close()
    assert not leftovers(shm_name)


def test_numpy_row_indices_are_accepted(layout: KVLayout) -> None:
    with CPURegion.create(layout, 1 * MiB, pin="off") as region:
        rows = np.arange(region.rows, dtype=np.int64)
        assert region.row_address(rows[3]) == region.row_address(3)
        assert len(region.row(rows[-1])) == region.row_stride


def test_row_is_a_writable_memoryview(layout: KVLayout) -> None:
    with CPURegion.create(layout, 1 * MiB, pin="off") as region:
        row = region.row(2)
        assert isinstance(row, memoryview)
        assert not row.readonly
        assert row.format == "B"
        row[:3] = b"abc"
        assert ctypes.string_at(region.row_address(2), 3) == b"abc"


@pytest.mark.parametrize("index", [-1, 10**9, True, 1.0], ids=repr)
def test_row_index_out_of_range(layout: KVLayout, index: Any) -> None:
    with CPURegion.create(layout, 1 * MiB, pin="off") as region:
        with pytest.raises(InvalidArgumentError):
            region.row(index)
        with pytest.raises(InvalidArgumentError):
            region.row_address(index)
        with pytest.raises(InvalidArgumentError):
            region.tensor_views(rank=index)


# -- statistics ------------------------------------------------------------------------------


def test_statistics_of_an_anonymous_region(layout: KVLayout) -> None:
    with CPURegion.create(layout, 4 * MiB + 5) as region:
        stats = region.statistics()
    assert isinstance(stats, RegionStatistics)
    assert stats.rows == region.rows
    assert stats.row_stride == region.row_stride
    assert stats.mapped_bytes == region.rows * region.row_stride
    assert stats.backing == "anonymous"
    assert stats.page_size == PAGE
    assert stats.transparent_huge_pages is shm.thp_honours_madvise(shmem=False)
    assert stats.populated in ("populate_write", "touch")
    assert stats.shared_name is None
    assert stats.created is True
    if torch.cuda.is_available():  # pragma: no cover - needs a GPU
        assert stats.pinned
    else:
        assert stats.pinned is False
        assert "no CUDA" in stats.pin_reason
    with pytest.raises(AttributeError):
        stats.rows = 0  # type: ignore[misc]


def test_statistics_of_a_shared_region(
    layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    with CPURegion.create(layout, 1 * MiB, shared_name=shm_name, pin="off") as region:
        stats = region.statistics()
        assert stats.backing in ("shm", "hugetlbfs")
        if stats.backing == "shm":
            assert stats.transparent_huge_pages is shm.thp_honours_madvise(shmem=True)
        assert stats.shared_name == shm_name
        assert stats.created is True
        assert stats.pinned is False
        assert stats.pin_reason == "pin='off'"
        # world_size 1: everyone has attached, so the name is gone already
        assert not leftovers(shm_name)


def test_populated_pages_are_resident(layout: KVLayout) -> None:
    with CPURegion.create(layout, 8 * MiB, pin="off") as region:
        n = region.statistics().mapped_bytes
        vec = (ctypes.c_uint8 * (n // PAGE))()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(region.row_address(0)), ctypes.c_size_t(n), vec) == 0
        assert all(b & 1 for b in vec)


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the path without CUDA")
def test_pin_on_without_cuda_is_a_configuration_error(layout: KVLayout) -> None:
    with pytest.raises(ConfigurationError, match="CUDA"):
        CPURegion.create(layout, 1 * MiB, pin="on")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_region_copies_to_the_device(layout: KVLayout) -> None:  # pragma: no cover
    region = CPURegion.create(layout, 64 * MiB, pin="on")
    stats = region.statistics()
    assert stats.pinned, stats.pin_reason
    view = region.tensor_views()[0]
    assert view.is_pinned()
    view.copy_(torch.arange(view.numel(), dtype=torch.int64).view_as(view).to(torch.uint8))
    dev = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), view)
    del view, dev
    region.close()
    assert region._released


# -- populate fallback -----------------------------------------------------------------------


def test_touch_fallback_faults_in_private_pages() -> None:
    n = 4 * MiB
    addr = shm.map_aligned(n, PAGE)
    try:
        assert shm.populate(addr, n, shared=False, method="touch") == "touch"
        vec = (ctypes.c_uint8 * (n // PAGE))()
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n), vec) == 0
        assert all(b & 1 for b in vec)
    finally:
        shm.munmap(addr, n)


def test_touch_fallback_never_writes_shared_bytes(tmp_path: Any) -> None:
    n = 1 * MiB
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, n)
        os.pwrite(fd, bytes(range(256)) * (n // 256), 0)
        addr = shm.map_aligned(n, PAGE, fd=fd)
        try:
            assert shm.populate(addr, n, shared=True, method="touch") == "touch"
        finally:
            shm.munmap(addr, n)
        assert os.pread(fd, n, 0) == bytes(range(256)) * (n // 256)
    finally:
        os.close(fd)


# -- lifetime --------------------------------------------------------------------------------


def test_close_is_idempotent_and_use_after_close_raises(layout: KVLayout) -> None:
    region = CPURegion.create(layout, 1 * MiB, pin="off")
    addr = region.row_address(0)
    region.close()
    region.close()
    assert region.closed
    assert region._released
    assert not is_mapped(addr)
    for call in (
        lambda: region.row(0),
        lambda: region.row_address(0),
        region.rows_view,
        region.tensor_views,
    ):
        with pytest.raises(ClosedError):
            call()
    assert region.statistics().rows == region.rows


def test_views_keep_the_memory_mapped_after_close(layout: KVLayout) -> None:
    region = CPURegion.create(layout, 1 * MiB, pin="off")
    addr = region.row_address(0)
    tensor = region.tensor_views()[1]
    row = region.row(3)
    region.close()
    assert region.closed
    assert not region._released
    tensor[0, 0] = 9  # still mapped: no crash
    row[0] = 7
    del tensor
    assert not region._released
    assert is_mapped(addr)
    del row
    assert region._released
    assert not is_mapped(addr)


def test_context_manager_closes(layout: KVLayout) -> None:
    with CPURegion.create(layout, 1 * MiB, pin="off") as region:
        assert not region.closed
    assert region.closed


def test_constructor_is_not_public() -> None:
    with pytest.raises(TypeError, match="create"):
        CPURegion()


# -- bad arguments ---------------------------------------------------------------------------


BAD_ARGS: dict[str, dict[str, Any]] = {
    "budget-zero": {"cpu_bytes_to_use": 0},
    "budget-bool": {"cpu_bytes_to_use": True},
    "budget-float": {"cpu_bytes_to_use": 1e6},
    "world-zero": {"world_size": 0},
    "world-bool": {"world_size": True},
    "world-huge": {"world_size": 4096, "shared_name": "x"},
    "rank-negative": {"rank": -1},
    "rank-not-below-world": {"rank": 2, "world_size": 2, "shared_name": "x"},
    "world-without-name": {"world_size": 2},
    "name-slash": {"shared_name": "a/b"},
    "name-dots": {"shared_name": ".."},
    "name-empty": {"shared_name": ""},
    "name-space": {"shared_name": "a b"},
    "name-too-long": {"shared_name": "x" * 201},
    "name-not-str": {"shared_name": b"abc"},
    "timeout-negative": {"join_timeout": -1.0},
    "timeout-nan": {"join_timeout": float("nan")},
    "timeout-str": {"join_timeout": "1"},
    "pin-bad": {"pin": "yes"},
    "layout-bad": {"layout": "not a layout"},
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_are_rejected_before_any_work(layout: KVLayout, case: str) -> None:
    kwargs: dict[str, Any] = {"layout": layout, "cpu_bytes_to_use": 1 * MiB, "pin": "off"}
    kwargs.update(BAD_ARGS[case])
    with pytest.raises(InvalidArgumentError):
        CPURegion.create(**kwargs)
    assert not [f for f in os.listdir("/dev/shm") if f in ("kvtier-x", "kvtier-a b")]


def test_shared_geometry_mismatch_and_duplicate_rank(
    layout: KVLayout, layout_factory: LayoutFactory, leftovers: Leftovers, shm_name: str
) -> None:
    with CPURegion.create(layout, 1 * MiB, world_size=3, shared_name=shm_name, pin="off"):
        with pytest.raises(SharedRegionError, match="rows"):
            CPURegion.create(layout, 2 * MiB, world_size=3, rank=1, shared_name=shm_name, pin="off")
        with pytest.raises(SharedRegionError, match="rank 0 is already attached"):
            CPURegion.create(layout, 1 * MiB, world_size=3, shared_name=shm_name, pin="off")
        other = layout_factory(block_bytes=(2048, 2048))
        with pytest.raises(SharedRegionError, match="namespace"):
            CPURegion.create(other, 1 * MiB, world_size=3, rank=1, shared_name=shm_name, pin="off")
    assert not leftovers(shm_name)


def test_a_budget_beyond_memory_is_a_capacity_error(layout: KVLayout) -> None:
    # Refused before mapping, whatever the overcommit setting: populating more
    # than there is would wake the OOM killer instead of failing.
    maps = _mappings()
    for budget in (1 << 50, (1 << 64) + 8192):
        with pytest.raises(CapacityError, match="exceeds this machine's available memory"):
            CPURegion.create(layout, budget, pin="off")
    assert _mappings() == maps


def test_a_length_beyond_size_t_is_refused_not_truncated() -> None:
    # ctypes passes size_t modulo 2**64: 2**64 + 8192 would map 8192 bytes.
    with pytest.raises(OSError, match="not a length any machine maps"):
        shm.map_aligned((1 << 64) + 8192, shm.PAGE_SIZE)


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return len(f.readlines())


def test_a_budget_beyond_dev_shm_is_a_capacity_error(
    layout: KVLayout, leftovers: Leftovers, shm_name: str
) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(CapacityError, match="bytes free but the shared region needs"):
        CPURegion.create(layout, 2 * free + MiB, shared_name=shm_name, pin="off")
    assert not leftovers(shm_name)


def anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping that starts at ``addr``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                inside = int(head.split("-")[0], 16) == addr
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    raise LookupError(f"no mapping starts at 0x{addr:x}")


@pytest.mark.skipif(
    not shm.thp_honours_madvise(shmem=False), reason="transparent huge pages are off"
)
def test_anonymous_region_gets_huge_pages(layout: KVLayout) -> None:
    with CPURegion.create(layout, 16 * MiB, pin="off") as region:
        assert region.statistics().transparent_huge_pages
        # defrag honours madvise, so the kernel compacts rather than fall back;
        # the whole region is 2 MiB-aligned and a multiple of 2 MiB.
        assert anon_huge_bytes(region.row_address(0)) == 16 * MiB
