"""kvtier below SGLang's real HiCache classes (CPU): run by `make test-sglang`, not by `make test`.

SGLang's KV-cache modules import ``torchvision.transforms`` (through
``sglang.srt.configs``) and nothing on the HiCache path calls it. The
registry's torchvision for torch 2.13 is CUDA-linked, so where no torchvision
imports, the import-only shim in ``shims/`` stands in (docs/lab/engines-below.md,
"Installs").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SHIMS = Path(__file__).resolve().parent / "shims"

try:
    import torchvision  # noqa: F401
except Exception:  # absent, or a CUDA build that cannot load here
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    sys.path.insert(0, str(SHIMS))

pytest.importorskip("sglang", reason="needs SGLang 0.5.23 in .venv-sglang: run `make test-sglang`")
