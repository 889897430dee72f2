"""``kvtier bench``: throughput of each tier beside the machine's own limits.

For every block size and queue depth asked for, in one run:

* **memcpy**: torch copying the same number of contiguous bytes (the ceiling
  of any device <-> CPU copy on a machine where CPU memory stands in for the GPU);
* **device -> CPU / CPU -> device**: the device copier of the CPU backend moving
  whole offloaded blocks between a KV tensor and CPU-region rows;
* **CPU -> file / file -> CPU**: the file tier storing and loading those rows
  (O_DIRECT, checksums on, through the configured I/O engine), in the steady
  state of a full tier where every store evicts a block and reuses its file;
* **fio** (when installed): ``ioengine=io_uring, direct=1`` writing and reading
  the same bytes at the same block size and depth in the same directory.

Ratios, not absolute figures, are what carry between runs on a shared machine.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvtier.config import FileTierConfig
from kvtier.keys import chain_keys
from kvtier.layout import KVLayout
from kvtier.region import CPURegion
from kvtier.tiers.file import FileTier, StoreResult
from kvtier.transfer.device import open_device_transfer

__all__ = ["BenchResult", "BenchSettings", "run_bench"]

_GB = 1e9


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """What to measure."""

    block_sizes: tuple[int, ...] = (256 << 10, 2 << 20)
    """Offloaded block sizes in bytes (multiples of 4096)."""
    queue_depths: tuple[int, ...] = (4, 32)
    """File tier queue depths."""
    total_bytes: int = 256 << 20
    """Bytes moved per measurement."""
    repeat: int = 3
    """Repeats per measurement; the median is reported."""
    io_engine: Literal["auto", "io_uring", "threads"] = "auto"
    """File tier I/O engine."""
    directory: Path | None = None
    """Where the file tier and fio write (default: a temporary directory)."""
    fio: bool = True
    """Run fio when it is installed."""


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Throughputs for one block size and queue depth, in GB/s (None: not measured)."""

    block_bytes: int
    queue_depth: int
    memcpy: float
    device_to_cpu: float
    cpu_to_device: float
    cpu_to_file: float
    file_to_cpu: float
    fio_write: float | None
    fio_read: float | None
    io_engine: str

    def as_dict(self) -> dict[str, object]:
        """A JSON-able dict, with the ratios against the limits."""
        out: dict[str, object] = asdict(self)
        out["device_to_cpu_vs_memcpy"] = self.device_to_cpu / self.memcpy
        out["cpu_to_device_vs_memcpy"] = self.cpu_to_device / self.memcpy
        if self.fio_write:
            out["file_write_vs_fio"] = self.cpu_to_file / self.fio_write
        if self.fio_read:
            out["file_read_vs_fio"] = self.file_to_cpu / self.fio_read
        return out


async def run_bench(
    settings: BenchSettings, progress: Callable[[str], None] | None = None
) -> list[BenchResult]:
    """Measure every (block size, queue depth) of ``settings``."""
    say = progress or (lambda _m: None)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=settings.directory) as tmp:
        base = Path(tmp)
        results = []
        for block in settings.block_sizes:
            say(f"{block >> 10} KiB blocks: memory and device copies")
            rows = max(settings.total_bytes // block, 1)
            memcpy = _memcpy(rows * block, settings.repeat)
            layout, kv = _layout(block, rows)
            region = CPURegion.create(layout, rows * block, alignment=4096)
            try:
                xfer = open_device_transfer(layout, [kv], region.tensor_views(), backend="cpu")
                try:
                    d2c, c2d = await _device(xfer, rows, block, settings.repeat)
                finally:
                    await xfer.aclose()
                for depth in settings.queue_depths:
                    say(f"{block >> 10} KiB blocks, depth {depth}: file tier")
                    write, read, engine = await _file(
                        base / f"tier-{block}-{depth}", layout, region, rows, depth, settings
                    )
                    fio_w = fio_r = None
                    if settings.fio and shutil.which("fio"):
                        say(f"{block >> 10} KiB blocks, depth {depth}: fio")
                        fio_w, fio_r = _fio(base / "fio.dat", block, depth, rows * block)
                    results.append(
                        BenchResult(
                            block, depth, memcpy, d2c, c2d, write, read, fio_w, fio_r, engine
                        )
                    )
            finally:
                region.close()
        return results


def _layout(block: int, rows: int) -> tuple[KVLayout, torch.Tensor]:
    """One block-first uint8 tensor whose blocks are ``block`` bytes: the bytes, nothing else."""
    kv = torch.randint(0, 256, (rows, block), dtype=torch.uint8)
    layout = KVLayout.from_tensors([kv], model_id="kvtier-bench", block_tokens=16)
    return layout, kv


def _memcpy(nbytes: int, repeat: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault both in before timing
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / _GB


async def _device(xfer: object, rows: int, block: int, repeat: int) -> tuple[float, float]:
    from kvtier.transfer.device import DeviceTransfer

    assert isinstance(xfer, DeviceTransfer)
    ids = np.arange(rows, dtype=np.int64)
    slots = np.arange(rows, dtype=np.int64)
    store = await _timed(lambda: _await(xfer.store(ids, slots)), repeat)
    load = await _timed(lambda: _await(xfer.load(slots, ids)), repeat)
    return rows * block / store / _GB, rows * block / load / _GB


async def _file(
    root: Path,
    layout: KVLayout,
    region: CPURegion,
    rows: int,
    depth: int,
    settings: BenchSettings,
) -> tuple[float, float, str]:
    """Median GB/s storing then loading ``rows`` rows through a full tier, per repeat.

    Each repeat opens a fresh tier that holds exactly ``rows`` blocks, fills it
    (untimed: creating files is a one-off cost of an empty tier), then times
    storing ``rows`` other blocks, the steady state of a serving node where
    every store evicts a block and reuses its file, and loading them back.
    """
    writes, reads = [], []
    engine = ""
    views = [region.row(i) for i in range(rows)]
    nbytes = rows * region.row_stride
    for rep in range(settings.repeat):
        config = FileTierConfig(
            root=root / str(rep),
            bytes_to_use=FileTier.budget_for(rows, region.row_stride),
            io_engine=settings.io_engine,
            queue_depth=depth,
        )
        tier = await FileTier.open(config, layout, block_bytes=region.row_stride)
        try:
            engine = tier.statistics().io_engine
            fill, keys = (
                chain_keys(list(range(n * rows * 16, (n + 1) * rows * 16)), 16, layout.namespace)
                for n in (2 * rep, 2 * rep + 1)
            )
            _check_stored(await tier.store(fill, views), rows)
            t0 = time.perf_counter()
            stored = await tier.store(keys, views)
            writes.append(time.perf_counter() - t0)
            _check_stored(stored, rows)
            t0 = time.perf_counter()
            loaded = await tier.load(keys, views)
            reads.append(time.perf_counter() - t0)
            if loaded.missing:
                first = next(iter(loaded.missing.values()))
                raise RuntimeError(f"{len(loaded.missing)} bench blocks failed to load: {first}")
        finally:
            await tier.aclose()
            shutil.rmtree(config.root, ignore_errors=True)
    return (
        nbytes / statistics.median(writes) / _GB,
        nbytes / statistics.median(reads) / _GB,
        engine,
    )


def _check_stored(result: StoreResult, rows: int) -> None:
    if result.failed or len(result.stored) != rows:
        first = next(iter(result.failed.values()), "not all stored")
        raise RuntimeError(f"{len(result.failed)} bench blocks failed to store: {first}")


def _fio(path: Path, block: int, depth: int, nbytes: int) -> tuple[float | None, float | None]:
    out: list[float | None] = []
    for rw in ("write", "read"):
        cmd = [
            "fio",
            "--name=kvtier",
            f"--filename={path}",
            f"--rw={rw}",
            f"--bs={block}",
            f"--iodepth={depth}",
            "--ioengine=io_uring",
            "--direct=1",
            f"--size={nbytes}",
            "--iomem=mmap",
            "--output-format=json",
            "--loops=3",
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
            job = json.loads(done.stdout)["jobs"][0][rw]
            out.append(float(job["bw_bytes"]) / _GB)
        except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
            out.append(None)
    path.unlink(missing_ok=True)
    return out[0], out[1]


async def _await(aw: Awaitable[object]) -> None:
    await aw


async def _timed(fn: Callable[[], Awaitable[None]], repeat: int) -> float:
    await fn()  # warm-up: first touch of the device tensor pages and the thread
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
