"""The house, drawn from its imports (issue 30): no import circle among the package's modules,
capture/ reading nothing of the diagnosis or the report's text, one room that builds a report.

Read from the source with ``ast``: nothing is imported, so a circle that Python's import system
happens to tolerate today (a lazy import inside a function) is found all the same.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_torchhang"
NAME = PACKAGE.name


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


#: Every module of the package (not ``inject/site``, which runs before the package is importable).
MODULES = {
    _module(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if "site" not in path.relative_to(PACKAGE).parts
}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports_in(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (a lazy import counts), but those only for typing."""
    for node in ast.iter_child_nodes(tree):
        if _type_checking_only(node):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _imports_in(node)


def _resolve(importer: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package's modules an import statement loads (the most precise module it names)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = importer.split(".")
        if MODULES[importer].name != "__init__.py":
            package.pop()
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    found = set()
    for alias in node.names:
        name = f"{base}.{alias.name}"
        if name in MODULES:
            found.add(name)  # ``from .report import model``: the submodule
        elif base in MODULES:
            found.add(base)  # ``from .model import Role``: the module
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in _imports_in(tree):
            edges |= _resolve(module, node)
        graph[module] = edges - {module}
    return graph


GRAPH = _graph()


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_the_import_graph_is_read_from_the_source() -> None:
    # the graph sees what the house is made of: a check that reads nothing would pass anyway
    assert f"{NAME}.report.model" in GRAPH[f"{NAME}.report.text"]
    assert f"{NAME}.capture.pipeline" in GRAPH[f"{NAME}.hang.path"]
    assert f"{NAME}.hang.path" in GRAPH[f"{NAME}.watchdog"]  # a lazy import counts


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_among_the_packages_modules() -> None:
    assert _circles(GRAPH) == []


@pytest.mark.parametrize(
    "forbidden", ["diagnosis", "hang", "report.text", "report.views", "report.groups"]
)
def test_capture_reads_the_world_and_nothing_of_the_diagnosis_or_the_text(forbidden: str) -> None:
    offending = {
        (module, imported)
        for module, edges in GRAPH.items()
        if _room(module) == "capture"
        for imported in edges
        if imported == f"{NAME}.{forbidden}" or imported.startswith(f"{NAME}.{forbidden}.")
    }
    assert offending == set()


def test_the_diagnosis_reads_facts_and_nothing_of_the_capture_or_the_hangs_path() -> None:
    offending = {
        (module, imported)
        for module, edges in GRAPH.items()
        if _room(module) == "diagnosis"
        for imported in edges
        if _room(imported) in ("capture", "hang", "runner", "monitor")
    }
    assert offending == set()


def test_the_data_model_imports_no_rendering() -> None:
    assert {m for m in GRAPH[f"{NAME}.report.model"] if _room(m) == "report"} <= {
        f"{NAME}.report.signals",
        f"{NAME}.report.waits",
    }


def _builds_a_report(path: Path) -> list[int]:
    """Lines where ``HangReport(...)`` is called in a module."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Name) and node.func.id == "HangReport")
            or (isinstance(node.func, ast.Attribute) and node.func.attr == "HangReport")
        )
    ]


def test_only_the_hang_room_builds_a_hang_report() -> None:
    builders = {module for module, path in MODULES.items() if _builds_a_report(path)}
    assert builders == {f"{NAME}.hang.reports"}


#: Rooms below the hang's path: they never call up into it.
BELOW_THE_HANG = ("capture", "diagnosis", "report", "inject", "devices", "deadline", "clock")


def test_no_room_below_the_hangs_path_imports_it() -> None:
    offending = {
        (module, imported)
        for module, edges in GRAPH.items()
        if _room(module) in BELOW_THE_HANG
        for imported in edges
        if _room(imported) == "hang"
    }
    assert offending == set()
