"""The ``kvtier`` command: ``demo``, ``bench``, ``inspect`` and ``gc``.

Exit status: 0 success; 1 the command ran and its check failed (a wrong demo
answer, a damaged block or host segment found by ``inspect``, a ``gc`` target
out of reach);
2 it could not run as asked (a bad argument, a missing directory, a system
error), said in one line on stderr; 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier._text import fit_table, human_bytes, make_console, plural
from kvtier.errors import InvalidArgumentError, KVTierError

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.demo.serving import DemoResult, DemoSettings, RequestRecord, TierSizes

__all__ = ["main"]


EXIT_CODES = """exit status:
  0    success
  1    the command ran and its check failed: a demo answer differs from the
       recompute, inspect found a damaged block or host segment, gc could not
       reach --keep-bytes
  2    it could not run as asked: a bad argument, a missing directory, a
       system error (one line on stderr; -v logs more)
  130  interrupted (Ctrl-C)"""
"""The exit codes, as ``--help`` prints them."""


_SHM_DIR = "/dev/shm"
"""Where ``--shm`` looks without a DIR (the host tier's default ``directory``)."""


def _directory(path: Path | None, flag: str) -> None:
    """Refuse ``flag``'s ``path`` unless it is an existing directory."""
    if path is None:
        return
    if not path.exists():
        raise InvalidArgumentError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: not a directory")


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.text import Text

    from kvtier.demo.report import render
    from kvtier.demo.serving import DemoSettings

    if any(v is not None and v < 1 for v in (args.conversations, args.turns, args.concurrency)):
        raise InvalidArgumentError("--conversations, --turns and --concurrency must be positive")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise InvalidArgumentError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    _directory(args.dir, "--dir")
    _warn_native()
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    workload = settings.workload
    for name in ("conversations", "turns", "seed"):
        if getattr(args, name) is not None:
            workload = replace(workload, **{name: getattr(args, name)})
    settings = replace(
        settings,
        workload=workload,
        concurrency=args.concurrency or settings.concurrency,
        tmp_parent=args.dir,
        corrupt_one_block=args.corrupt_one_block,
        metrics_port=args.metrics_port,
    )
    console = make_console()
    total = workload.conversations * workload.turns
    console.print(
        f"kvtier demo: {total} requests ({workload.conversations} conversations x "
        f"{workload.turns} turns, {settings.concurrency} at once) on a "
        f"{settings.model.layers}-layer Llama-shaped model, CPU standing in for the GPU"
    )

    def opened(sizes: TierSizes) -> None:
        console.print(
            f"the workload spans {sizes.workload_blocks} blocks of KV "
            f"({human_bytes(sizes.workload_blocks * sizes.block_bytes)}); device: "
            f"{sizes.device_blocks} blocks of {settings.block_tokens} tokens; CPU tier: "
            f"{sizes.cpu_blocks} blocks ({human_bytes(sizes.cpu_bytes)}); file tier: "
            f"{human_bytes(sizes.file_bytes)} in {sizes.file_root} (removed at the end)",
            highlight=False,
            soft_wrap=True,
        )
        if sizes.metrics_url is not None:
            console.print(f"metrics: {sizes.metrics_url}", highlight=False, soft_wrap=True)

    if console.is_terminal:
        result = _demo_live(console, settings, total, opened)
    else:
        result = _demo_logged(console, settings, opened)
    for part in render(result, width=console.width):
        console.print(part, soft_wrap=isinstance(part, Text), highlight=False)
    return 1 if result.mismatches else 0


def _demo_live(
    console: Console, settings: DemoSettings, total: int, opened: Callable[[TierSizes], None]
) -> DemoResult:
    """Run the demo under progress bars (a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier.demo.serving import run_demo

    progress = Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
    )
    serving = progress.add_task("serving", total=total, note="")
    checking = progress.add_task("checking", total=total, note="", start=False)
    counts = {"cpu": 0, "file": 0, "none": 0, "wrong": 0}

    def update(kind: str, record: RequestRecord, done: int, _total: int) -> None:
        if kind == "served":
            counts[record.source] += 1
            note = f"prefix from CPU {counts['cpu']}, file {counts['file']}, none {counts['none']}"
            progress.update(serving, completed=done, note=note)
        else:
            progress.start_task(checking)
            counts["wrong"] += not record.correct
            progress.update(checking, completed=done, note=f"{counts['wrong']} differ")

    def stage(line: str) -> None:
        progress.console.print(line, highlight=False, soft_wrap=True)

    with progress:
        return asyncio.run(run_demo(settings, update, opened, stage))


def _demo_logged(
    console: Console, settings: DemoSettings, opened: Callable[[TierSizes], None]
) -> DemoResult:
    """Run the demo with a line per request (not a terminal)."""
    from kvtier.demo.serving import run_demo

    def log(kind: str, r: RequestRecord, done: int, total: int) -> None:
        if kind == "served":
            console.print(
                f"served {done}/{total}: conversation {r.conversation} turn {r.turn + 1}, "
                f"{r.prompt_tokens} tokens, {r.loaded_tokens} loaded ({r.cpu_blocks} blocks "
                f"from CPU, {r.file_blocks} from file), TTFT {r.ttft_s * 1e3:.0f} ms",
                highlight=False,
                soft_wrap=True,
            )
        else:
            console.print(
                f"checked {done}/{total}: request {r.index}, recompute "
                f"{r.recompute_s * 1e3:.0f} ms, {_verdict(r)}",
                highlight=False,
                soft_wrap=True,
            )

    def stage(line: str) -> None:
        console.print(line, highlight=False, soft_wrap=True)

    return asyncio.run(run_demo(settings, log, opened, stage))


def _verdict(r: RequestRecord) -> str:
    """One request's check in a few words: what failed, or how close the logits came."""
    v = r.verdict
    if v is None:
        return "not checked"
    if v.correct:
        return (
            "correct, logits bit for bit"
            if v.logits_identical
            else f"correct, logits within {v.logits_difference:.1e}"
        )
    faults = []
    if v.blocks_wrong:
        faults.append(f"{v.blocks_wrong} of {v.blocks_loaded} loaded blocks not the stored bytes")
    if not v.tokens_identical:
        faults.append("other tokens")
    if not v.logits_within:
        faults.append(f"logits off by {v.logits_difference:.1e}")
    return "DIFFERENT: " + ", ".join(faults)


def _warn_native() -> None:
    """Say once, before the work starts, which compiled parts are missing (if any)."""
    from kvtier._native_status import warn_if_missing

    warn_if_missing(python_warning=False)  # logged: the command configures logging


def _size(text: str) -> int:
    """A byte size from the command line: ``2MiB``, ``256KiB``, ``4096``."""
    from pydantic import TypeAdapter, ValidationError

    from kvtier.config import Bytes  # the configuration's rule: 2M is 2 MiB

    try:
        return int(TypeAdapter(Bytes).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 2MiB)") from None


def _size_or_zero(text: str) -> int:
    """A byte size that may be 0 (``gc --keep-bytes 0``: down to nothing), by the same rule."""
    from kvtier.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} ({exc})") from None


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
    _directory(args.dir, "--dir")
    _warn_native()
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


INSPECT_COLUMNS = (
    "namespace",
    "model",
    "format",
    "block bytes",
    "slots",
    "blocks",
    "free",
    "torn",
    "dup",
    "bytes",
    "on disk",
    "last use",
    "open",
    "tmp",
    "quarantined",
)
"""The fields ``kvtier inspect`` shows per namespace (``--verify`` adds two)."""


def _run_inspect(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from kvtier.cli._inspect import inspect_root

    if args.cluster is not None:
        return _inspect_cluster(args)
    if args.shm:
        return _inspect_shm(args)
    if args.root is None:
        raise InvalidArgumentError("inspect: give a file tier ROOT, --cluster URL or --shm")

    reports = inspect_root(args.root, verify=args.verify)
    bad = sum(len(r.bad) for r in reports)
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
        return 1 if bad else 0
    console = make_console()
    if not reports:
        console.print(f"{args.root}: no kvtier namespaces", highlight=False, soft_wrap=True)
        return 0
    columns = list(INSPECT_COLUMNS)
    if args.verify:
        columns += ["verified", "bad"]
    rows = []
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
            human_bytes(r.bytes),
            human_bytes(r.disk_bytes),
            _when(r.last_used),
            {True: "yes", False: "no", None: "?"}[r.open],
            str(r.temporaries),
            str(r.quarantined),
        ]
        if args.verify:
            row += [str(r.verified), str(len(r.bad))]
        rows.append(row)
    console.print(
        fit_table(
            f"kvtier file tier at {args.root}: {plural(len(reports), 'namespace')}",
            columns,
            rows,
            console.width,
            left=("namespace", "model"),
            own_line=("model",),
        ),
        highlight=False,
        soft_wrap=True,
    )
    for r in reports:
        if r.legacy_files:
            # Legacy files are not read, so they never count as bad: the tier
            # discards them when it opens the namespace.
            console.print(
                f"{r.namespace}: {plural(r.legacy_files, 'format version 1 block file')} "
                f"({human_bytes(r.legacy_bytes)}), not read; the tier discards them when it opens",
                highlight=False,
                soft_wrap=True,
            )
    for r in reports:
        for b in r.bad:
            console.print(
                f"[red]bad[/red] {escape(b.path)}: {escape(b.reason)}",
                highlight=False,
                soft_wrap=True,
            )
    return 1 if bad else 0


def _inspect_shm(args: argparse.Namespace) -> int:
    """``kvtier inspect --shm [DIR]``: the host tier segments of DIR, read without joining."""
    from rich.markup import escape

    from kvtier.tiers.host import survey_host_segments

    if args.root is not None:
        raise InvalidArgumentError("--shm takes no ROOT (--shm DIR names the directory)")
    if args.shm != _SHM_DIR:  # a machine without /dev/shm has nothing in it to list
        _directory(Path(args.shm), "--shm")
    survey = survey_host_segments(args.shm)
    status = 1 if survey.damaged else 0
    if args.json:
        print(json.dumps(survey.as_dict(), indent=2))
        return status
    console = make_console()
    if not survey.segments:
        console.print(
            f"{escape(args.shm)}: no kvtier host segments"
            + (", but damaged entries:" if survey.damaged else ""),
            highlight=False,
            soft_wrap=True,
        )
    else:
        columns = ["namespace", "row", "rows", "live", "held", "orphaned", "free", "blocks"]
        columns += ["watched"]
        rows = [
            [
                r.namespace,
                human_bytes(r.row_bytes),
                str(r.rows),
                f"{r.live_instances}/{r.instances}",
                "+".join(str(n) for n in r.rows_held if n) or "0",
                str(r.rows_orphaned),
                str(r.rows_free),
                str(r.blocks),
                "yes" if r.watched else "no",
            ]
            for r in survey.segments
        ]
        console.print(
            fit_table(
                f"kvtier host tier segments in {escape(args.shm)}: {len(survey.segments)}",
                columns,
                rows,
                console.width,
                left=("namespace",),
                own_line=("namespace",),
            ),
            highlight=False,
            soft_wrap=True,
        )
    for d in survey.damaged:
        fate = "kvtier gc --shm removes it" if d.removable else "kvtier gc --shm keeps it"
        console.print(
            f"[red]damaged[/red] {escape(d.path)}: {escape(d.problem)} ({fate})",
            highlight=False,
            soft_wrap=True,
        )
    return status


def _inspect_cluster(args: argparse.Namespace) -> int:
    from kvtier.cli._cluster_inspect import config_from_cli, inspect_cluster, render

    config = config_from_cli(
        args.cluster,
        mode=args.mode,
        username=args.user,
        password_file=args.password_file,
        tls_ca_file=args.tls_ca_file,
        environ=os.environ,
    )
    report = asyncio.run(inspect_cluster(config, prefix=args.prefix, max_keys=args.max_keys))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        render(report, ",".join(config.nodes), print)
    return 0


def _when(t: float | None) -> str:
    import time

    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _gc(args: argparse.Namespace) -> int:
    from kvtier.tiers.file._root import collect

    if args.shm:
        return _gc_shm(args)
    if args.root is None or (args.keep_bytes is None and args.unused_for is None):
        raise InvalidArgumentError(
            "say what to reclaim: ROOT with --keep-bytes SIZE and/or --unused-for SECONDS, or --shm"
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
    console = make_console()
    verb = "would remove" if args.dry_run else "removed"
    if done.chosen:
        rows = [
            [
                ns.name,
                (ns.description.model_id if ns.description else None) or "?",
                _when(ns.last_used),
                human_bytes(ns.disk_bytes),
            ]
            for ns in done.chosen
        ]
        console.print(
            fit_table(
                f"kvtier gc {args.root}: {verb}",
                ("namespace", "model", "last use", "on disk"),
                rows,
                console.width,
                left=("namespace", "model", "last use"),
                own_line=("model",),
            ),
            highlight=False,
            soft_wrap=True,
        )
    opened = [ns.name for ns in done.kept if ns.open]
    console.print(
        f"{args.root}: {verb} {plural(len(done.chosen), 'namespace')} "
        f"({human_bytes(done.freed_bytes)}); {human_bytes(done.before_bytes)} on disk before, "
        f"{human_bytes(done.after_bytes)} after"
        + (f"; open, never removed: {', '.join(opened)}" if opened else ""),
        highlight=False,
        soft_wrap=True,
    )
    if not done.target_met:
        console.print(
            f"[red]cannot reach --keep-bytes {args.keep_bytes}[/red]: what is left is open "
            "or not kvtier's",
            soft_wrap=True,
        )
    return status


def _gc_shm(args: argparse.Namespace) -> int:
    """``kvtier gc --shm [DIR]``: this user's stale shared CPU regions (in /dev/shm) and
    host segments (in DIR), and what is damaged under the host segments' prefix."""
    from kvtier.region import reap_shared_regions
    from kvtier.tiers.host import reap_damaged_host_segments, reap_host_segments

    if args.root is not None or args.keep_bytes is not None:
        raise InvalidArgumentError(
            "--shm takes no ROOT nor --keep-bytes (--shm DIR names the directory)"
        )
    if args.shm != _SHM_DIR:
        _directory(Path(args.shm), "--shm")
    paths = reap_shared_regions(args.unused_for or 0.0, dry_run=args.dry_run)
    # A host segment no instance holds is kept by design (a restarted instance
    # adopts its blocks) until the last one closes; --unused-for does not apply.
    # The damaged first, each then named with what is wrong with it (the
    # reaper would take a truncated segment along as a plain unheld one).
    damaged = [] if args.unused_for else reap_damaged_host_segments(args.shm, dry_run=args.dry_run)
    said = {d.path for d in damaged}
    hosts = [] if args.unused_for else reap_host_segments(args.shm, dry_run=args.dry_run)
    hosts = [p for p in hosts if p not in said]
    if args.json:
        out = {
            "dry_run": args.dry_run,
            "removed": paths,
            "host_segments": hosts,
            "damaged": [d.as_dict() for d in damaged],
        }
        print(json.dumps(out, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(
            f"/dev/shm: {verb} {plural(len(paths), 'stale shared region')}"
            + "".join(f"\n  {p}" for p in paths)
            + f"\n{args.shm}: {verb} {plural(len(hosts), 'host segment')} no instance holds"
            + "".join(f"\n  {p}" for p in hosts)
            + f"\n{args.shm}: {verb} {plural(len(damaged), 'damaged entry', 'damaged entries')}"
            + "".join(f"\n  {d.path}: {d.problem}" for d in damaged)
        )
    return 0


class _Version(argparse.Action):
    """``--version``: the version, the Python, and which compiled parts are in use."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        import platform

        import kvtier
        from kvtier._native_status import describe

        where = Path(kvtier.__file__).parent
        lines = [
            f"kvtier {kvtier.__version__} ({where}; Python {platform.python_version()})",
            *describe(),
        ]
        print("\n".join(lines))
        parser.exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvtier`` command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache storage for LLM serving.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, **kwargs: object) -> argparse.ArgumentParser:
        """A subcommand whose --help ends with the exit codes."""
        made: argparse.ArgumentParser = sub.add_parser(
            name,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,  # type: ignore[arg-type]
        )
        return made

    demo = add(
        "demo",
        help="serve multi-turn chats with a small real model over every tier, "
        "checked against full recompute",
    )
    demo.add_argument(
        "--quick", action="store_true", help="a few short requests (seconds), as the tests run"
    )
    demo.add_argument(
        "--conversations",
        type=int,
        default=None,
        metavar="N",
        help="chat conversations to serve (default: 20; 8 with --quick)",
    )
    demo.add_argument(
        "--turns",
        type=int,
        default=None,
        metavar="N",
        help="turns per conversation, each a request that extends the previous one's prompt "
        "(default: 3; 2 with --quick)",
    )
    demo.add_argument("--concurrency", type=int, default=None, help="requests in flight at once")
    demo.add_argument("--seed", type=int, default=None, help="seed of the token streams")
    demo.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the file tier's temporary directory goes (default: the system's)",
    )
    demo.add_argument(
        "--corrupt-one-block",
        action="store_true",
        help="zero one loaded KV block, as a tier returning wrong bytes would, to see the "
        "check of loaded blocks fail (exit status 1)",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the engine's Prometheus metrics on http://127.0.0.1:PORT/metrics while "
        "the demo runs (0: a free port; needs kvtier[metrics])",
    )
    demo.set_defaults(func=_demo)

    bench = add("bench", help="tier throughput beside memcpy and fio, measured in the same run")
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
    bench.set_defaults(func=_run_bench)

    insp = add(
        "inspect",
        help="what a file tier root, a cluster tier's cluster, or the host tier holds",
        description="A file tier root (ROOT), with --cluster the kvtier blocks on a "
        "Valkey/Redis cluster per tenant prefix and namespace (SCAN, read only), or with "
        "--shm the host tier segments in /dev/shm or DIR (read without joining them; "
        "what else is under their prefix is listed as damaged, exit status 1). The "
        "cluster's password is read from $KVTIER_CLUSTER_PASSWORD or --password-file, "
        "never from the command line.",
    )
    insp.add_argument("root", type=Path, nargs="?", help="the file tier root")
    insp.add_argument(
        "--shm",
        nargs="?",
        const=_SHM_DIR,
        default=None,
        metavar="DIR",
        help="the host tier segments in DIR (default /dev/shm; host_tier.directory): "
        "instances, rows held, blocks, and what is damaged",
    )
    insp.add_argument(
        "--cluster",
        metavar="URL",
        help="redis://host:port[,host:port...] (rediss:// for TLS) of the cluster tier",
    )
    insp.add_argument("--prefix", help="tenant prefix to count (default: every key)")
    insp.add_argument("--mode", choices=["cluster", "single"], default="cluster")
    insp.add_argument("--user", help="ACL user (or $KVTIER_CLUSTER_USERNAME)")
    insp.add_argument("--password-file", help="file whose first line is the password")
    insp.add_argument("--tls-ca-file", help="CA bundle that verifies the servers (implies TLS)")
    insp.add_argument(
        "--max-keys", type=int, default=1_000_000, help="stop the SCAN after this many keys"
    )
    insp.add_argument(
        "--verify",
        action="store_true",
        help="read every block and check its namespace, length and payload checksum",
    )
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.set_defaults(func=_run_inspect)

    gc = add(
        "gc",
        help="remove file tier namespaces no process has open (by age, or down to a size)",
        description="Remove namespaces of a file tier root that no tier has open: those "
        "unused for --unused-for seconds, then the least recently used until the root "
        "takes at most --keep-bytes on disk. Open namespaces are never removed; only "
        "what kvtier wrote is deleted. With --shm instead: remove this user's shared CPU "
        "regions in /dev/shm that no live process holds (left by an instance killed "
        "before every worker attached), and, in /dev/shm or DIR, host tier segments no "
        "instance holds (left by instances all killed) and this user's damaged entries "
        "under their prefix (truncated segments, garbage, FIFOs), never another user's; "
        "host segments only without --unused-for.",
    )
    gc.add_argument("root", type=Path, nargs="?", default=None, help="the file tier root")
    gc.add_argument(
        "--shm",
        nargs="?",
        const=_SHM_DIR,
        default=None,
        metavar="DIR",
        help="reap stale shared CPU regions in /dev/shm and host tier segments in DIR "
        "(default /dev/shm) instead (no ROOT; --unused-for limits it to region files "
        "unwritten for that long)",
    )
    gc.add_argument(
        "--keep-bytes",
        type=_size_or_zero,
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
    except OSError as exc:  # the system refused (a full disk, a permission): one line too
        logging.getLogger("kvtier.cli").info("what failed", exc_info=True)
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status
