"""The packages depend on each other one way only, and no two files import each other.

entrypoints -> loadgen/diagnostics -> engine -> executor -> speculative/loading -> worker ->
scheduler/attention/distributed -> kernels/draft_sampling -> step_data -> plain data (config,
sampling_params, request, outputs, uploads, sampling) -> text_checks, numba_cache, devices,
host_memory -> process_env. Every import
(at module level, inside a function, or under ``TYPE_CHECKING``) must point to a
lower layer or stay in its own package, so there are no import cycles between
packages; inside a package, the files' imports form no cycle either.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedtree"

# Lower numbers are lower layers; each key is a package or a top-level module.
LAYERS = {
    "process_env": -1,
    "text_checks": 0, "numba_cache": 0, "devices": 0, "host_memory": 0,
    "structured_params": 1,
    "config": 2, "sampling_params": 2, "outputs": 2, "uploads": 2,
    "structured": 3,
    "request": 4, "sampling": 4,
    "step_data": 5,
    "kernels": 6, "draft_sampling": 6,
    "attention": 7, "scheduler": 7, "distributed": 7,
    "worker": 8,
    "loading": 9, "speculative": 9,
    "executor": 10,
    "engine": 11,
    "loadgen": 12, "diagnostics": 12,
    "entrypoints": 13,
}


def _unit(module: str) -> str | None:
    """The layer unit of a ``pagedtree.x.y`` module name (None for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pagedtree" else None


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every pagedtree import, ``if TYPE_CHECKING:`` ones included
    (a type-only import is a dependency all the same)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("pagedtree."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagedtree"):
            if node.module == "pagedtree":
                # The package root re-exports the engine (LLM, ...): importing it is
                # importing the engine layer, unless a submodule is named.
                found.extend((node.lineno, f"pagedtree.{a.name}" if a.name in LAYERS else "pagedtree.engine")
                             for a in node.names)
            else:
                found.append((node.lineno, node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def test_every_package_has_a_layer():
    units = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in _modules()}
    assert units <= set(LAYERS), sorted(units - set(LAYERS))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    unit = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    bad = []
    for line, module in _imports(ast.parse(path.read_text())):
        target = _unit(module)
        if target is None or target == unit:
            continue
        if LAYERS[target] >= LAYERS[unit]:
            bad.append(f"line {line}: {unit} (layer {LAYERS[unit]}) imports {module} (layer {LAYERS[target]})")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_wrong_import():
    tree = ast.parse("from pagedtree.engine.llm import LLM\nif TYPE_CHECKING:\n    import pagedtree.entrypoints\n")
    assert [m for _, m in _imports(tree)] == ["pagedtree.engine.llm", "pagedtree.entrypoints"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_graph() -> dict[str, set[str]]:
    """Module -> the pagedtree modules it imports (``from pkg import submodule`` counts
    as importing the submodule)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in paths)
            elif isinstance(node, ast.ImportFrom) and node.module in paths:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(paths)
                targets.update(subs or {node.module})
        graph[name] = targets - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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
            connect(node)
    return found


def test_no_two_files_import_each_other():
    # A package's __init__ re-exporting its own modules is not a cycle unless a
    # module imports the package root back.
    assert _cycles(_file_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
