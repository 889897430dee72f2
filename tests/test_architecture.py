"""kvtier's import structure (docs/architecture.md, "Layout").

The contracts in pyproject.toml (``[tool.importlinter]``: the layers, the tiers'
independence, vLLM only under ``kvtier.integrations.vllm``) hold, and no module
of kvtier imports one that imports it back, through any chain. Imports inside
functions and under ``TYPE_CHECKING`` count.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def _cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("kvtier", include_external_packages=False, cache_dir=None)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    assert "kvtier.tiers.factory" in imports["kvtier.engine._open"]  # the graph is kvtier's own
    cycles = _cycles(imports)
    lines = []
    for component in cycles:
        members = set(component)
        for importer in component:
            for imported in sorted(imports[importer] & members):
                for d in graph.get_import_details(importer=importer, imported=imported):
                    lines.append(f"{importer}:{d['line_number']}: {d['line_contents']}")
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_the_import_contracts_hold() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_the_ignored_imports_are_compiled_modules_only() -> None:
    """grimp reads .py files only: the contracts ignore what it misreads, nothing else.

    A name imported from a compiled module (``from kvtier.manager._native import
    Core``) reads as an import of the root package ``kvtier``; each ignored
    import must be exactly such lines, so that a real import of the root (which
    imports the engine) from a low layer still breaks the contracts.
    """
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    ignored = {
        rule
        for contract in config["contracts"]
        if contract["type"] != "forbidden"
        for rule in contract.get("ignore_imports", ())
    }
    assert ignored
    graph = grimp.build_graph("kvtier", include_external_packages=True, cache_dir=None)
    for rule in sorted(ignored):
        importer, _, imported = (part.strip() for part in rule.partition("->"))
        assert imported == "kvtier", rule
        details = graph.get_import_details(importer=importer, imported=imported)
        assert details, f"{rule}: no such import"
        for d in details:
            words = d["line_contents"].split()
            assert words[0] == "from", d
            stub = ROOT / (words[1].replace(".", "/") + ".pyi")
            assert stub.exists(), f"{importer}:{d['line_number']} imports no compiled module"
