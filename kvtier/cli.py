"""The ``kvtier`` command."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from kvtier.errors import KVTierError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    """Prefix sharing of a simulated multi-turn chat workload, measured on real keys.

    Until the engine lands this runs the end-to-end path that exists: a KV layout
    described from real CPU tensors, and chained block keys over conversations
    that share a system prompt and grow turn by turn.
    """
    import torch
    from rich.console import Console
    from rich.table import Table

    from kvtier.keys import chain_keys
    from kvtier.layout import KVLayout

    rng = random.Random(args.seed)
    kv = [torch.zeros(2, 256, 16, 8, 128, dtype=torch.float16) for _ in range(4)]
    layout = KVLayout.from_tensors(kv, model_id="demo-model", block_tokens=16, num_blocks=256)
    system = [rng.randrange(32000) for _ in range(512)]
    seen: set[bytes] = set()
    total = reused = 0
    for _conv in range(args.conversations):
        history = list(system)
        for _turn in range(args.turns):
            history += [rng.randrange(32000) for _ in range(rng.randrange(32, 256))]
            keys = chain_keys(history, layout.offload_block_tokens, layout.namespace)
            total += len(keys)
            reused += sum(k in seen for k in keys)
            seen.update(keys)
    table = Table(title="kvtier demo: prefix reuse in a multi-turn chat workload")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("conversations x turns", f"{args.conversations} x {args.turns}")
    table.add_row("bytes per offloaded block", f"{layout.bytes_per_chunk:,}")
    table.add_row("blocks requested", f"{total:,}")
    table.add_row("blocks already seen (reusable)", f"{reused:,} ({reused / max(total, 1):.1%})")
    table.add_row("distinct blocks to store", f"{len(seen):,}")
    saved = reused * layout.bytes_per_chunk / 2**30
    table.add_row("KV bytes a cache would save", f"{saved:.2f} GiB")
    Console().print(table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvtier`` command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the simulated serving workload")
    demo.add_argument("--conversations", type=int, default=64)
    demo.add_argument("--turns", type=int, default=6)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    try:
        status: int = args.func(args)
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
