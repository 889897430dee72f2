"""The first example of docs/file-tier.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).parents[2] / "docs" / "file-tier.md"


def test_the_first_example_runs() -> None:
    text = DOC.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None
    exec(compile(block.group(1), str(DOC), "exec"), {"__name__": "docs_example"})
