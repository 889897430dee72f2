"""The ``kvtier`` command: ``demo``, ``bench``, ``inspect`` and ``gc``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import InvalidArgumentError, KVTierError

if TYPE_CHECKING:
    from rich.table import Table

    from kvtier._demo import DemoReport

__all__ = ["main"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier._demo import DemoSettings, run_demo
    from kvtier.engine import Engine

    settings = DemoSettings(
        conversations=args.conversations,
        turns=args.turns,
        concurrency=args.concurrency,
        seed=args.seed,
        root=args.root,
        prefill_tokens_per_s=args.prefill_rate,
    )
    console = Console()
    progress = Progress(
        TextColumn("[bold]serving"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit rate {task.fields[hit]:>6.1%}"),
        TextColumn("cpu {task.fields[cpu]}"),
        TextColumn("file {task.fields[file]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    total = settings.conversations * settings.turns
    task = progress.add_task("requests", total=total, hit=0.0, cpu="-", file="-")

    def update(report: DemoReport, engine: Engine) -> None:
        st = engine.statistics()
        file_used = "-" if st.file is None else f"{st.file.blocks} blk"
        progress.update(
            task,
            completed=report.requests,
            hit=report.blocks_loaded / max(report.blocks_requested, 1),
            cpu=f"{st.cpu.used}/{st.cpu.capacity} rows",
            file=file_used,
        )

    with Live(progress, console=console, refresh_per_second=8, transient=False):
        report = asyncio.run(run_demo(settings, update))
    console.print(_demo_table(report))
    if report.blocks_wrong:
        console.print(f"[red]{report.blocks_wrong} loaded blocks had wrong bytes")
        return 1
    return 0


def _demo_table(report: DemoReport) -> Table:
    from rich.table import Table

    st = report.stats
    if st is None:
        raise RuntimeError("the demo ended without engine statistics")
    table = Table(
        title="kvtier demo: simulated serving loop (CPU stands in for the GPU)",
        caption="GB/s: bytes over the time the tier had work in flight, in a loop busy "
        "simulating a model; `kvtier bench` measures tier throughput",
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    req = max(report.blocks_requested, 1)
    cpu_hits = st.cpu_traffic.hits
    file_hits = 0 if st.file_traffic is None else st.file_traffic.hits
    cpu_in, cpu_out = st.cpu_traffic, st.cpu_traffic
    table.add_row(
        "requests / offloaded blocks asked", f"{report.requests} / {report.blocks_requested}"
    )
    table.add_row("hit rate, CPU tier", f"{cpu_hits / req:.1%}")
    table.add_row("hit rate, file tier", f"{file_hits / req:.1%}")
    table.add_row(
        "blocks loaded (verified, wrong)",
        f"{report.blocks_loaded} ({report.blocks_verified} sub-blocks, "
        f"{report.blocks_wrong} wrong)",
    )
    table.add_row("blocks computed (misses)", f"{report.blocks_computed}")
    table.add_row("device -> CPU", f"{_gib(cpu_in.bytes_in)} at {cpu_in.gbps_in:.2f} GB/s")
    table.add_row("CPU -> device", f"{_gib(cpu_out.bytes_out)} at {cpu_out.gbps_out:.2f} GB/s")
    if st.file_traffic is not None:
        ft = st.file_traffic
        table.add_row("CPU -> file", f"{_gib(ft.bytes_in)} at {ft.gbps_in:.2f} GB/s")
        table.add_row("file -> CPU (promotions)", f"{_gib(ft.bytes_out)} at {ft.gbps_out:.2f} GB/s")
    table.add_row(
        "CPU evictions / file evictions",
        f"{st.cpu.evictions} / {0 if st.file is None else st.file.evictions}",
    )
    table.add_row("wall time", f"{report.seconds:.1f} s")
    saved = report.tokens_reused / report.prefill_tokens_per_s
    table.add_row(
        f"recompute avoided at {report.prefill_tokens_per_s:,.0f} tok/s prefill",
        f"{report.tokens_reused:,} tokens = {saved:.1f} s of prefill",
    )
    return table


def _size(text: str) -> int:
    """A byte size from the command line: ``2MiB``, ``256KiB``, ``4096``."""
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 2MiB)") from None


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    bad = [b for b in args.block_size if b <= 0 or b % 4096]
    if bad:
        raise InvalidArgumentError(f"block sizes must be positive multiples of 4096, got {bad}")
    if any(d < 1 for d in args.queue_depth) or args.repeat < 1 or args.total <= 0:
        raise InvalidArgumentError("queue depths, --repeat and --total must be positive")
    from kvtier._bench import BenchSettings, run_bench

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
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
        return 0

    def gbs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    def ratio(a: float, b: float | None) -> str:
        return "" if not b else f" ({a / b:.2f}x)"

    table = Table(title="kvtier bench: GB/s (ratio to the machine's limit in the same run)")
    for col in (
        "block",
        "depth",
        "memcpy",
        "device->CPU",
        "CPU->device",
        "fio write",
        "CPU->file",
        "fio read",
        "file->CPU",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            f"{r.block_bytes >> 10} KiB",
            str(r.queue_depth),
            gbs(r.memcpy),
            gbs(r.device_to_cpu) + ratio(r.device_to_cpu, r.memcpy),
            gbs(r.cpu_to_device) + ratio(r.cpu_to_device, r.memcpy),
            gbs(r.fio_write),
            gbs(r.cpu_to_file) + ratio(r.cpu_to_file, r.fio_write),
            gbs(r.fio_read),
            gbs(r.file_to_cpu) + ratio(r.file_to_cpu, r.fio_read),
        )
    out = Console()
    if not out.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        out = Console(width=160)
    out.print(table)
    engine = results[0].io_engine if results else "-"
    note = "fio not installed (apt-get install fio)" if not any(r.fio_read for r in results) else ""
    out.print(f"file tier I/O engine: {engine}. {note}".strip())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from kvtier._inspect import inspect_root

    reports = inspect_root(args.root, verify=args.verify)
    bad = sum(len(r.bad) for r in reports)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
        return 1 if bad else 0
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=200)
    if not reports:
        console.print(f"{args.root}: no kvtier namespaces")
        return 0
    table = Table(title=f"kvtier file tier at {args.root}")
    columns = ["namespace", "model", "format", "block bytes", "slots", "blocks", "free", "torn"]
    columns += ["dup", "bytes", "on disk", "last use", "open", "tmp", "quarantined"]
    if args.verify:
        columns += ["verified", "bad"]
    for col in columns:
        table.add_column(col, justify="left" if col in ("namespace", "model") else "right")
    for r in reports:
        d = r.as_dict()
        version = "?" if r.format_version is None else str(r.format_version)
        row = [
            r.namespace,
            str(d["model_id"] or "?"),
            f"{version} (legacy)" if r.legacy else version,
            str(d["block_bytes"] or "?"),
            str(r.slots),
            str(r.blocks),
            str(r.free),
            str(r.torn),
            str(r.duplicates),
            _gib(r.bytes),
            _gib(r.disk_bytes),
            _when(r.last_used),
            {True: "open", False: "no", None: "?"}[r.open],
            str(r.temporaries),
            str(r.quarantined),
        ]
        if args.verify:
            row += [str(r.verified), str(len(r.bad))]
        table.add_row(*row)
    console.print(table)
    for r in reports:
        if r.legacy_files:
            # Legacy files are not read, so they never count as bad: the tier
            # discards them when it opens the namespace.
            console.print(
                f"{r.namespace}: {r.legacy_files} format version 1 block files "
                f"({_gib(r.legacy_bytes)}), not read; the tier discards them when it opens"
            )
    for r in reports:
        for b in r.bad:
            console.print(f"[red]bad[/red] {escape(b.path)}: {escape(b.reason)}")
    return 1 if bad else 0


def _when(t: float | None) -> str:
    import time

    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _gc(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.tiers._root import collect

    if args.keep_bytes is None and args.unused_for is None:
        raise InvalidArgumentError(
            "say what to reclaim: --keep-bytes SIZE and/or --unused-for SECONDS"
        )
    if args.unused_for is not None and args.unused_for < 0:
        raise InvalidArgumentError("--unused-for must be zero or more seconds")
    if not args.root.is_dir() or args.root.is_symlink():
        raise InvalidArgumentError(f"{args.root} is not a directory")
    done = collect(
        args.root, keep_bytes=args.keep_bytes, unused_for=args.unused_for, dry_run=args.dry_run
    )
    status = 0 if done.target_met else 1
    if args.json:
        report = {
            "dry_run": args.dry_run,
            "removed": [
                {
                    "namespace": ns.name,
                    "model_id": ns.description.model_id if ns.description else None,
                    "last_used": ns.last_used,
                    "disk_bytes": ns.disk_bytes,
                }
                for ns in done.chosen
            ],
            "freed_bytes": done.freed_bytes,
            "before_bytes": done.before_bytes,
            "after_bytes": done.after_bytes,
            "open": [ns.name for ns in done.kept if ns.open],
            "target_met": done.target_met,
        }
        print(json.dumps(report, indent=2))
        return status
    console = Console()
    if not console.is_terminal:  # a pipe or a file: one line per message
        console = Console(width=200)
    verb = "would remove" if args.dry_run else "removed"
    if done.chosen:
        table = Table(title=f"kvtier gc {args.root}: {verb}")
        for col in ("namespace", "model", "last use", "on disk"):
            table.add_column(col, justify="right" if col == "on disk" else "left")
        for ns in done.chosen:
            model = ns.description.model_id if ns.description else None
            table.add_row(ns.name, model or "?", _when(ns.last_used), _gib(ns.disk_bytes))
        console.print(table)
    opened = [ns.name for ns in done.kept if ns.open]
    console.print(
        f"{args.root}: {verb} {len(done.chosen)} namespaces ({_gib(done.freed_bytes)}); "
        f"{_gib(done.before_bytes)} on disk before, {_gib(done.after_bytes)} after"
        + (f"; open, never removed: {', '.join(opened)}" if opened else "")
    )
    if not done.target_met:
        console.print(
            f"[red]cannot reach --keep-bytes {args.keep_bytes}[/red]: what is left is open "
            "or not kvtier's"
        )
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvtier`` command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tiered KV-cache storage for LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a simulated async serving loop over all tiers")
    demo.add_argument("--conversations", type=int, default=48)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--concurrency", type=int, default=8)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--prefill-rate",
        type=float,
        default=8000.0,
        help="assumed prefill tokens/s, for the recompute time avoided",
    )
    demo.add_argument(
        "--root", type=Path, default=None, help="file tier root (default: a temporary directory)"
    )
    demo.set_defaults(func=_demo)

    bench = sub.add_parser(
        "bench", help="tier throughput beside memcpy and fio, measured in the same run"
    )
    bench.add_argument(
        "--block-size",
        type=_size,
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
        type=_size,
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
    bench.set_defaults(func=_bench)

    insp = sub.add_parser("inspect", help="what a file tier root holds")
    insp.add_argument("root", type=Path, help="the file tier root")
    insp.add_argument(
        "--verify",
        action="store_true",
        help="read every block and check its namespace, length and payload checksum",
    )
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.set_defaults(func=_inspect)

    gc = sub.add_parser(
        "gc",
        help="remove file tier namespaces no process has open (by age, or down to a size)",
        description="Remove namespaces of a file tier root that no tier has open: those "
        "unused for --unused-for seconds, then the least recently used until the root "
        "takes at most --keep-bytes on disk. Open namespaces are never removed; only "
        "what kvtier wrote is deleted.",
    )
    gc.add_argument("root", type=Path, help="the file tier root")
    gc.add_argument(
        "--keep-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="remove least recently used namespaces until the root takes at most SIZE",
    )
    gc.add_argument(
        "--unused-for",
        type=float,
        default=None,
        metavar="SECONDS",
        help="remove namespaces not opened or closed for at least SECONDS",
    )
    gc.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    gc.add_argument("--json", action="store_true", help="print the result as JSON")
    gc.set_defaults(func=_gc)

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        status: int = args.func(args)
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
