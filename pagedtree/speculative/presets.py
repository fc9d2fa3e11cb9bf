"""Named speculation configurations used by the benchmarks and the CLI.

Each preset is a dict of ``SpeculativeConfig`` fields; the name says the tree kind and
its node budget. ``adaptive`` presets let the engine pick a smaller budget (or none)
per step from measured costs.
"""

from __future__ import annotations

from typing import Any

TREE_PRESETS: dict[str, dict[str, Any]] = {
    "chain-5": dict(tree="chain", depth=5, max_nodes=5, adaptive=False),
    "chain-3": dict(tree="chain", depth=3, max_nodes=3, adaptive=False),
    "static-16": dict(tree="static", expansion=(2, 2, 1, 1, 1, 1), max_nodes=16, adaptive=False),
    "static-8": dict(tree="static", expansion=(2, 1, 1, 1, 1), max_nodes=8, adaptive=False),
    "dynamic-16": dict(tree="dynamic", top_k=4, depth=6, max_nodes=16, adaptive=False),
    "sequoia-16": dict(tree="sequoia", depth=8, max_nodes=16, adaptive=False),
    "adaptive-16": dict(tree="static", expansion=(2, 2, 1, 1, 1, 1), max_nodes=16, adaptive=True),
    "adaptive-chain-5": dict(tree="chain", depth=5, max_nodes=5, adaptive=True),
}


def tree_preset(name: str) -> dict[str, Any]:
    """A copy of the preset ``name``; ``ValueError`` naming the known presets otherwise."""
    if name not in TREE_PRESETS:
        raise ValueError(f"unknown speculation preset {name!r}; known: {', '.join(TREE_PRESETS)}")
    return dict(TREE_PRESETS[name])
