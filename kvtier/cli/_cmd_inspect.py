"""Private: ``kvtier inspect``: a file tier root, the host tier's segments, a cluster."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path

from kvtier._text import fit_table, human_bytes, make_console, plural
from kvtier.cli._args import SHM_DIR, check_directory, when
from kvtier.errors import InvalidArgumentError

__all__ = ["add_inspect"]


def add_inspect(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``inspect`` subcommand's arguments."""
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
        const=SHM_DIR,
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
            when(r.last_used),
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
                f"({human_bytes(r.legacy_bytes)}), not read; the tier no longer deletes them: "
                "remove blocks/ by hand",
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
    if args.shm != SHM_DIR:  # a machine without /dev/shm has nothing in it to list
        check_directory(Path(args.shm), "--shm")
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
