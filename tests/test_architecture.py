"""kvtier's import structure (docs/architecture.md, "Layout").

The contracts in pyproject.toml (``[tool.importlinter]``: the layers, the tiers'
independence, vLLM only under ``kvtier.integrations.vllm``) hold, and no module
of kvtier imports one that imports it back, through any chain. Imports inside
functions and under ``TYPE_CHECKING`` count.

grimp reads .py files only, so a compiled module (``kvtier.manager._native``,
``kvtier.transfer._address``, ...: a ``.pyi`` stub beside its C source) is
imported whole, ``from kvtier.transfer import _address``, which grimp takes for
an import of its package. A name taken from it (``from kvtier.transfer._address
import address``) names a module grimp cannot find, and reads as an import of
the root package ``kvtier``, which imports the engine: a false edge from the
bottom layers to the top that every contract would have to ignore.
"""

from __future__ import annotations

import ast
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


def _compiled(module: str) -> bool:
    """Whether ``module`` is one of kvtier's compiled modules (its stub is beside its C source)."""
    return (ROOT / (module.replace(".", "/") + ".pyi")).exists()


def _imports_a_compiled_module_of(line: str, package: str) -> bool:
    """Whether ``line`` imports compiled modules of ``package`` whole, and nothing else."""
    try:
        (node,) = ast.parse(line.strip()).body
    except (SyntaxError, ValueError):
        return False  # a line that is not a whole statement: counted as an import
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == package:
        return all(_compiled(f"{package}.{alias.name}") for alias in node.names)
    if isinstance(node, ast.Import):
        return all(a.name.startswith(f"{package}.") and _compiled(a.name) for a in node.names)
    return False


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("kvtier", include_external_packages=False, cache_dir=None)
    imports = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    # A compiled module imported whole reads as an import of its package (see the module
    # docstring). From a module inside that package this is no cycle: Python imported the
    # package first anyway, and the line takes no name from it.
    for importer, targets in imports.items():
        for package in [t for t in targets if importer.startswith(f"{t}.")]:
            details = graph.get_import_details(importer=importer, imported=package)
            if all(_imports_a_compiled_module_of(d["line_contents"], package) for d in details):
                targets.discard(package)
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


def test_compiled_modules_are_imported_whole_and_no_contract_ignores_an_import() -> None:
    """No line takes a name from a compiled module; so no contract needs to ignore an import.

    See the module docstring: ``from kvtier.manager._native import Core`` would read
    as an import of the root package from the manager layer, and break the layers.
    """
    taken = []
    for path in sorted((ROOT / "kvtier").rglob("*.py")):
        package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.module is None:
                continue
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module]) if node.level else node.module
            if _compiled(module):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                taken.append(f"{where}: import {module} whole (from its package), not names of it")
    assert not taken, "\n".join(taken)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    ignored = [
        f"{contract['id']}: {rule}"
        for contract in config["contracts"]
        if contract["type"] != "forbidden"
        for rule in contract.get("ignore_imports", ())
    ]
    assert not ignored, ignored
