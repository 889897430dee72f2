"""Private: ``kvtier gc``: namespaces no tier has open; stale shared memory (``--shm``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from kvtier._text import fit_table, human_bytes, make_console, plural
from kvtier.cli._args import SHM_DIR, check_directory, parse_size_or_zero, when
from kvtier.errors import InvalidArgumentError

__all__ = ["add_gc"]


def add_gc(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``gc`` subcommand's arguments."""
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
        const=SHM_DIR,
        default=None,
        metavar="DIR",
        help="reap stale shared CPU regions in /dev/shm and host tier segments in DIR "
        "(default /dev/shm) instead (no ROOT; --unused-for limits it to region files "
        "unwritten for that long)",
    )
    gc.add_argument(
        "--keep-bytes",
        type=parse_size_or_zero,
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


def _gc(args: argparse.Namespace) -> int:
    from kvtier.tiers.file import collect

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
                when(ns.last_used),
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
    if args.shm != SHM_DIR:
        check_directory(Path(args.shm), "--shm")
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
