"""The examples are part of the documentation: each must run and pass its checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip()


def test_there_are_examples() -> None:
    assert {p.stem for p in EXAMPLES} >= {"serving_loop", "multi_turn_chat", "restart_recovery"}
