"""Shared fixture: figures each reliability test measured, for docs/lab/reliability-runs.md.

Set ``KVTIER_REPORT_DIR`` to collect them: every test writes
``<dir>/<test name>.json``; ``make reliability-report`` prints the table.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """A dict the test fills with its figures; written out when it passes or fails."""
    figures: dict[str, object] = {}
    yield figures
    where = os.environ.get("KVTIER_REPORT_DIR")
    if where and figures:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
