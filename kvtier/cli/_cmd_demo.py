"""Private: ``kvtier demo``: serve chats with a small real model over every tier, checked."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier._text import human_bytes, make_console
from kvtier.cli._args import check_directory, warn_native
from kvtier.errors import InvalidArgumentError

if TYPE_CHECKING:
    from rich.console import Console

    from kvtier.demo.serving import DemoResult, DemoSettings, RequestRecord, TierSizes

__all__ = ["add_demo"]


def add_demo(add: Callable[..., argparse.ArgumentParser]) -> None:
    """The ``demo`` subcommand's arguments."""
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


def _demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.text import Text

    from kvtier.demo.report import render
    from kvtier.demo.serving import DemoSettings

    if any(v is not None and v < 1 for v in (args.conversations, args.turns, args.concurrency)):
        raise InvalidArgumentError("--conversations, --turns and --concurrency must be positive")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise InvalidArgumentError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    check_directory(args.dir, "--dir")
    warn_native()
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
