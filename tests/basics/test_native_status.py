"""Whether the compiled parts are in use: said by ``kvtier --version``, ``kvtier bench``
and a warning at first use when one is missing (issue 41: without a C compiler
``pip install`` succeeds and everything runs the slow fallbacks, silently)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import _native_status

ROOT = Path(__file__).resolve().parents[2]

# A process in which one extension cannot be imported, as where no compiler built it.
BLOCKED = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not built)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""


def _blocked(module: str, code: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED.format(module=module) + code, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "80"},
        timeout=120,
        check=False,
    )


CLI = "from kvtier.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def test_setup_py_builds_exactly_the_listed_extensions() -> None:
    built = re.findall(r'Extension\(\s*"([\w.]+)"', (ROOT / "setup.py").read_text())
    assert built == [e.module for e in _native_status.EXTENSIONS]


def test_every_extension_is_in_use_here() -> None:
    assert [s.extension.module for s in _native_status.status() if not s.available] == []
    assert not _native_status.warn_if_missing()  # nothing to say, nothing said
    assert _native_status.describe(every=False) == ["compiled parts: 5 of 5 in use"]


@pytest.mark.parametrize("module", [e.module for e in _native_status.EXTENSIONS])
def test_first_use_warns_once_naming_what_is_slower(module: str) -> None:
    code = """
import logging, warnings
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
from kvtier._native_status import NativeExtensionWarning, warn_if_missing
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert warn_if_missing()
    assert warn_if_missing()  # still missing, not said again
assert [w.category for w in seen] == [NativeExtensionWarning], seen
print(seen[0].message)
"""
    done = _blocked(module, code)
    assert done.returncode == 0, done.stderr
    ext = next(e for e in _native_status.EXTENSIONS if e.module == module)
    (logged,) = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert logged.startswith("WARNING kvtier.native: 1 of 5 compiled parts of kvtier are not built")
    assert f"{module} -> {ext.fallback}" in logged
    assert f"{module} -> {ext.fallback}" in done.stdout  # the Python warning says the same


def test_version_names_the_missing_part_and_its_fallback() -> None:
    module = "kvtier.transfer._copy"
    done = _blocked(module, CLI, "--version")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "compiled parts: 4 of 5 in use; the others run pure-Python equivalents" in out
    assert f"  {module}: MISSING;" in out
    assert "    instead: a Python loop of one copy per piece" in out
    assert "(not built)" in out  # the import error
    assert "  kvtier.manager._native: in use;" in out


def test_bench_warns_at_start_and_says_what_ran(tmp_path: Path) -> None:
    module = "kvtier.tiers._blocks"
    argv = ["bench", "--block-size", "64KiB", "--queue-depth", "2", "--total", "1MiB"]
    done = _blocked(module, CLI, *argv, "--repeat", "1", "--no-fio", "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert module in warning
    assert "Python struct packing and the xxhash module" in warning
    assert "compiled parts: 4 of 5 in use" in done.stdout
    assert f"  {module}: MISSING;" in done.stdout


def test_opening_an_engine_warns_when_a_compiled_part_is_missing() -> None:
    # A library user never runs the CLI: Engine.open is their first use.
    code = """
import asyncio, warnings
import torch
from kvtier import Engine, KVLayout, KVTierConfig
from kvtier._native_status import NativeExtensionWarning

async def main():
    kv = [torch.zeros(4, 2, 16, 64)]
    layout = KVLayout.from_tensors(kv, model_id="warn", block_tokens=16)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = await Engine.open(KVTierConfig(cpu_bytes_to_use="1MiB"), layout, kv)
        await engine.aclose()
    assert NativeExtensionWarning in [w.category for w in seen], seen

asyncio.run(main())
print("warned")
"""
    done = _blocked("kvtier.transfer._gather", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "warned"
