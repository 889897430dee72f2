"""The README's code runs as written: each ``python`` block is run as a script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_a_program() -> None:
    assert BLOCKS, "README.md has no python block"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block-{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code: str, tmp_path: Path) -> None:
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
    assert "0 blocks loaded, 6 stored" in out.stdout
