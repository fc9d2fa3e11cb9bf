"""The packages depend on each other one way only.

entrypoints -> bench -> engine -> speculative -> executor -> loading -> worker ->
scheduler/attention/distributed -> kernels -> plain data (config, sampling_params, request, outputs, uploads, sampling)
-> text_checks. Every
import (at module level or inside a function, but not under ``TYPE_CHECKING``) must
point to a lower layer or stay in its own package; so there are no import cycles
between packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedtree"

# Lower numbers are lower layers; each key is a package or a top-level module.
LAYERS = {
    "text_checks": -1,
    "config": 0, "sampling_params": 0, "outputs": 0, "uploads": 0,
    "request": 1, "sampling": 1,
    "kernels": 2,
    "attention": 3, "scheduler": 3, "distributed": 3,
    "worker": 4,
    "loading": 5,
    "executor": 6,
    "speculative": 7,
    "engine": 8,
    "bench": 9,
    "entrypoints": 10,
}


def _unit(module: str) -> str | None:
    """The layer unit of a ``pagedtree.x.y`` module name (None for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pagedtree" else None


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every pagedtree import outside ``if TYPE_CHECKING:``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
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
    assert [m for _, m in _imports(tree)] == ["pagedtree.engine.llm"]
