"""The README's code runs as written: each ``python`` block is run as a script.

A ``python`` block followed by "It prints:" and a ``text`` block must print
exactly that text.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(
    r"^```python\n(.*?)^```\n(?:\nIt prints:\n\n```text\n(.*?)^```\n)?",
    README.read_text(),
    flags=re.S | re.M,
)


def test_the_readme_has_a_program() -> None:
    assert BLOCKS, "README.md has no python block"


def test_the_readme_program_shows_a_hit() -> None:
    shown = [printed for _, printed in BLOCKS if printed]
    assert shown, "README.md shows no program's output"
    assert any(
        int(m.group(1)) > 0 for text in shown for m in re.finditer(r"(\d+) blocks loaded", text)
    ), "the README's program never loads a block"


@pytest.mark.parametrize(
    ("code", "printed"), BLOCKS, ids=[f"block-{i}" for i in range(len(BLOCKS))]
)
def test_readme_block_runs(code: str, printed: str, tmp_path: Path) -> None:
    script = tmp_path / "readme.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    if printed:
        assert out.stdout == printed, "README.md shows other output than its program prints"
