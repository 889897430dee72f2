"""Private: ``kvtier bench``: the tiers' throughput beside memcpy and fio."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

from kvtier._text import fit_table, human_bytes, make_console
from kvtier.cli._args import check_directory, parse_size, warn_native
from kvtier.errors import InvalidArgumentError

__all__ = ["add_bench"]


def add_bench(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``bench`` subcommand's arguments."""
    bench = add("bench", help="tier throughput beside memcpy and fio, measured in the same run")
    bench.add_argument(
        "--block-size",
        type=parse_size,
        nargs="+",
        default=[256 << 10, 2 << 20],
        metavar="SIZE",
        help="offloaded block sizes (default: 256KiB 2MiB)",
    )
    bench.add_argument(
        "--queue-depth",
        type=int,
        nargs="+",
        default=[4, 32],
        metavar="N",
        help="file tier queue depths (default: 4 32)",
    )
    bench.add_argument(
        "--total",
        type=parse_size,
        default=256 << 20,
        metavar="SIZE",
        help="bytes moved per measurement (default: 256MiB)",
    )
    bench.add_argument("--repeat", type=int, default=3, help="repeats; the median is shown")
    bench.add_argument("--io-engine", choices=["auto", "io_uring", "threads"], default="auto")
    bench.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory for the file tier and fio (default: a temporary one)",
    )
    bench.add_argument("--no-fio", action="store_true", help="do not run fio even if installed")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.set_defaults(func=_run_bench)


BENCH_NOTE = (
    "Each cell is GB/s; in brackets, kvtier's rate as a multiple of the reference "
    "measured beside it in the same run. memcpy: torch's Tensor.copy_ of the same bytes "
    "in one call; fio: fio writing or reading the same bytes (io_uring, O_DIRECT, the same "
    "block size and depth, in the same directory). They are references, not the "
    "machine's limits: above 1x, kvtier moved the bytes faster than the reference did "
    "(its copy loop calls memcpy, which can beat torch's copy_, and a shared machine's "
    "load changes between two measurements); below 1x, kvtier was slower by that factor."
)
"""What ``kvtier bench``'s table shows, printed under it."""


def _run_bench(args: argparse.Namespace) -> int:
    from kvtier._native_status import describe

    bad = [b for b in args.block_size if b <= 0 or b % 4096]
    if bad:
        raise InvalidArgumentError(f"block sizes must be positive multiples of 4096, got {bad}")
    if any(d < 1 for d in args.queue_depth) or args.repeat < 1 or args.total <= 0:
        raise InvalidArgumentError("queue depths, --repeat and --total must be positive")
    check_directory(args.dir, "--dir")
    warn_native()
    from rich.console import Console

    from kvtier.cli._bench import BenchSettings, run_bench

    settings = BenchSettings(
        block_sizes=tuple(args.block_size),
        queue_depths=tuple(args.queue_depth),
        total_bytes=args.total,
        repeat=args.repeat,
        io_engine=args.io_engine,
        directory=args.dir,
        fio=not args.no_fio,
    )
    console = Console(stderr=True)
    with console.status("measuring") as status:
        results = asyncio.run(run_bench(settings, lambda m: status.update(m)))
    native = describe(every=False)
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
        for line in native:  # stderr: the JSON on stdout keeps its shape
            print(line, file=sys.stderr)
        return 0

    def gbs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def ratio(a: float, b: float | None) -> str:
        return "" if not b else f" ({a / b:.2f}x)"

    columns = (
        "block",
        "depth",
        "memcpy (reference)",
        "device->CPU (x memcpy)",
        "CPU->device (x memcpy)",
        "fio write (reference)",
        "CPU->file (x fio write)",
        "fio read (reference)",
        "file->CPU (x fio read)",
    )
    rows = [
        [
            human_bytes(r.block_bytes),
            str(r.queue_depth),
            gbs(r.memcpy),
            gbs(r.device_to_cpu) + ratio(r.device_to_cpu, r.memcpy),
            gbs(r.cpu_to_device) + ratio(r.cpu_to_device, r.memcpy),
            gbs(r.fio_write),
            gbs(r.cpu_to_file) + ratio(r.cpu_to_file, r.fio_write),
            gbs(r.fio_read),
            gbs(r.file_to_cpu) + ratio(r.file_to_cpu, r.fio_read),
        ]
        for r in results
    ]
    out = make_console()
    out.print(
        fit_table(
            "kvtier bench: GB/s, and (in brackets) as a multiple of the reference",
            columns,
            rows,
            out.width,
            left=("block",),
            caption=BENCH_NOTE,
        ),
        highlight=False,
    )
    engine = results[0].io_engine if results else "-"
    note = "fio not installed (apt-get install fio)" if not any(r.fio_read for r in results) else ""
    out.print(f"file tier I/O engine: {engine}. {note}".strip(), highlight=False, soft_wrap=True)
    for line in native:
        out.print(line, highlight=False, soft_wrap=True)
    return 0
