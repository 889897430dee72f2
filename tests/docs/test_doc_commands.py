"""Every benchmark command the docs show names a script that exists and flags it takes.

The benchmarks themselves take minutes and are not part of the suite; what a
reader copies from the docs must at least start: each script's ``--help`` is
run once and must list every ``--flag`` a command in the docs passes it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"\.venv/bin/python (benchmarks/[\w/]+\.py)([^`\n]*)")


def _commands() -> list[tuple[str, str, str]]:
    found = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if "lab" in doc.relative_to(ROOT).parts:
            continue  # benchmark history: commands as they were then
        for m in COMMAND.finditer(doc.read_text()):
            found.add((str(doc.relative_to(ROOT)), m.group(1), m.group(2)))
    return sorted(found)


@cache
def _help(script: str) -> str:
    out = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"{script} --help failed: {out.stderr[-2000:]}"
    return out.stdout


def test_the_docs_show_benchmark_commands() -> None:
    assert len(_commands()) >= 8


@pytest.mark.parametrize(("doc", "script", "args"), _commands())
def test_a_documented_benchmark_command_starts(doc: str, script: str, args: str) -> None:
    assert (ROOT / script).is_file(), f"{doc} shows {script}, which does not exist"
    text = _help(script)
    for flag in re.findall(r"(--[\w-]+)", args):
        assert flag in text, f"{doc}: {script} takes no {flag}"
