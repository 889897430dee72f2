"""Private: the ``kvtier`` command's parser and its dispatch (the subcommands are modules)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.cli._args import EXIT_CODES
from kvtier.cli._cmd_bench import add_bench
from kvtier.cli._cmd_demo import add_demo
from kvtier.cli._cmd_gc import add_gc
from kvtier.cli._cmd_inspect import add_inspect
from kvtier.errors import KVTierError

__all__ = ["main"]


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

    add_demo(add)
    add_bench(add)
    add_inspect(add)
    add_gc(add)

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
