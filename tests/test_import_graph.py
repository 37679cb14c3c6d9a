"""The package's import graph has no cycle: no module imports, at any depth and counting the
imports made inside functions and those under ``if TYPE_CHECKING`` (an annotation that names a
type from above is a dependency on the layer above all the same), a module that imports it back.
Dependencies run one way (specs -> core formulas -> allocator -> verdict and plan -> answers ->
reports -> CLI); a cycle is how a layer starts to depend on the one above it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zeroplan"


def _module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names[name] = path
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it."""
    modules = _module_names(package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import submodule` reaches the submodule; `from pkg import name` the package.
                submodules = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                targets = submodules if len(submodules) == len(node.names) else [node.module, *submodules]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan 1972), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "zeroplan.core.plan" in graph and graph["zeroplan.core.plan"], "the graph was not read"
    assert cycles(graph) == []


def test_results_do_not_import_reports_and_layout_does_not_import_framework_formulas():
    graph = import_graph()
    assert not {m for m in graph["zeroplan.results"] if m.startswith("zeroplan.report")}
    assert "zeroplan.core.frameworks" not in graph["zeroplan.core.layout"]


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()] - seen:
            seen.add(child)
            todo.append(child)
    return seen


def test_an_annotation_only_import_closes_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n")
    (package / "high.py").write_text("def make():\n    from pkg.low import low\n")
    assert cycles(import_graph(package)) == [["pkg.high", "pkg.low"]]


def test_the_allocator_sits_below_the_planner_and_the_answers_above_both() -> None:
    graph = import_graph()
    above_allocator = {"zeroplan.core.plan", "zeroplan.core.search", "zeroplan.answers", "zeroplan.frames"}
    for module in (m for m in graph if m.startswith("zeroplan.allocator.")):
        assert not _reaches(graph, module) & above_allocator, module
    assert "zeroplan.answers" not in _reaches(graph, "zeroplan.frames")
    assert not {"zeroplan.core.plan", "zeroplan.core.search"} & _reaches(graph, "zeroplan.answers")
