"""benchmarks/gpu/check.sh, the one-run check of the CUDA path, in its CPU-side mode.

Where there is no GPU, every CPU part of it runs and passes and every CUDA part
says it was skipped and why; this keeps the script working between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_check_sh_quick_passes_its_cpu_parts(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "KVTIER_CHECK_BUILD": "0",  # the suite runs on the extensions as built
        "KVTIER_CHECK_PYTEST": "0",  # the gpu-marked tests are this suite's own, skipped here
    }
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/check.sh"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "check.json").read_text())
    assert results["failures"] == []
    assert results["sweep"]["cases"] > 0
    if not torch.cuda.is_available():
        assert {r["copier"] for r in results["bench"]} == {"cpu"}
        assert "SKIPPED  sweep on CUDA" in done.stdout
        assert len(results["skipped"]) == 5, results["skipped"]
    assert "check.sh: exit 0" in done.stdout
