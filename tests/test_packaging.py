"""What the sdist and the wheel contain (issue 41).

The sdist holds what building kvtier takes (the C sources and headers of its
extensions) and the licences; the wheel holds the licences and no C source or
header. Both are built offline from a copy of the checkout. The wheel is built
with ``CC=false``: its extensions are optional, so they fail at once and are
left out, which keeps the build to a second; what is checked here is what
setuptools packages, not the compiler's output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
C_SOURCES = {
    "kvtier/manager/_native.c",
    "kvtier/transfer/_address.c",
    "kvtier/transfer/_copy.c",
    "kvtier/transfer/_gather.c",
    "kvtier/tiers/_blocks.c",
    "kvtier/third_party/xxhash/xxh_x86dispatch.c",
    "kvtier/third_party/xxhash/xxh_x86dispatch.h",
    "kvtier/third_party/xxhash/xxhash.h",
}
# What a build leaves in a checkout, and what never belongs in a distribution.
_IGNORE = shutil.ignore_patterns(
    ".git", ".venv*", ".vllm-*", "build", "dist", "*.egg-info", "__pycache__", "*.so",
    ".*_cache", ".hypothesis", ".reports",
)  # fmt: skip


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("checkout") / "kvtier"
    shutil.copytree(ROOT, dest, ignore=_IGNORE, symlinks=True)
    return dest


def _run(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "CC": "false", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    out = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def sdist(checkout: Path) -> set[str]:
    _run([sys.executable, "setup.py", "-q", "sdist", "-d", "dist"], checkout)
    (archive,) = (checkout / "dist").glob("kvtier-*.tar.gz")
    with tarfile.open(archive) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


@pytest.fixture(scope="module")
def wheel(checkout: Path) -> set[str]:
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    _run([*pip, "-w", "wheels", "."], checkout)
    (archive,) = (checkout / "wheels").glob("kvtier-*.whl")
    with zipfile.ZipFile(archive) as whl:
        return set(whl.namelist())


def test_the_sdist_has_what_a_build_needs_and_the_licences(sdist: set[str]) -> None:
    missing = C_SOURCES - sdist
    assert not missing, f"the sdist lacks {sorted(missing)}: it cannot build the extensions"
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        assert name in sdist
    assert "kvtier/third_party/xxhash/LICENSE" in sdist


def test_the_sdist_leaves_out_the_repository_only_parts(sdist: set[str]) -> None:
    tops = {name.split("/", 1)[0] for name in sdist}
    assert not tops & {"tests", "tests_vllm", "benchmarks", "examples", "docs", "build"}, tops
    assert not [n for n in sdist if n.endswith((".so", ".pyc"))]


def test_the_wheel_ships_both_licences(wheel: set[str]) -> None:
    licences = {n.split("/licenses/", 1)[1] for n in wheel if ".dist-info/licenses/" in n}
    assert licences == {"LICENSE", "kvtier/third_party/xxhash/LICENSE"}, sorted(wheel)


def test_the_wheel_has_no_c_source_or_header(wheel: set[str]) -> None:
    c_files = sorted(n for n in wheel if n.endswith((".c", ".h")))
    assert not c_files, f"the wheel ships {c_files}"


def test_the_wheel_has_the_stubs_and_py_typed(wheel: set[str]) -> None:
    assert "kvtier/py.typed" in wheel
    stubs = {n for n in wheel if n.endswith(".pyi")}
    assert {s.removesuffix(".c") + ".pyi" for s in C_SOURCES if "third_party" not in s} <= stubs


def test_the_licence_is_the_apache_licence() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "BSD 2-Clause" in (ROOT / "kvtier/third_party/xxhash/LICENSE").read_text()
