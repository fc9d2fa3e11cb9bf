"""Named speculation configurations used by the benchmarks and the CLI.

Each preset is a dict of ``SpeculativeConfig`` fields; the name says the tree kind and
its node budget, and each says its drafter (switched on one engine, a draft model's
preset sits the suffix drafter out). ``adaptive`` presets let the engine pick a
smaller budget (or none) per step from measured costs. (The acceptance priors the
budget starts from are in ``budget/priors.py``.)
"""

from __future__ import annotations

from typing import Any

from pagedtree.config import CPU_STREAM_SPECULATION, OFFLOADED_SPECULATION

TREE_PRESETS: dict[str, dict[str, Any]] = {
    "chain-5": dict(drafter="model", tree="chain", depth=5, max_nodes=5, adaptive=False),
    "chain-4": dict(drafter="model", tree="chain", depth=4, max_nodes=4, adaptive=False),
    "chain-3": dict(drafter="model", tree="chain", depth=3, max_nodes=3, adaptive=False),
    # One draft token a step from a draft whose head keeps 32,768 ids: the fastest
    # measured at batch 1 in q4 on the 2-core AVX2 CPU, where a 2-row verify costs
    # about what one row does and 4 rows about 1.5x.
    "chain-1-v32k": dict(drafter="model", tree="chain", depth=1, max_nodes=1, adaptive=False, draft_vocab_size=32768),
    "static-16": dict(drafter="model", tree="static", expansion=(2, 2, 1, 1, 1, 1), max_nodes=16, adaptive=False),
    "static-8": dict(drafter="model", tree="static", expansion=(2, 1, 1, 1, 1), max_nodes=8, adaptive=False),
    "dynamic-16": dict(drafter="model", tree="dynamic", top_k=4, depth=6, max_nodes=16, adaptive=False),
    "sequoia-16": dict(drafter="model", tree="sequoia", depth=8, max_nodes=16, adaptive=False),
    "adaptive-16": dict(drafter="model", tree="static", expansion=(2, 2, 1, 1, 1, 1), max_nodes=16, adaptive=True),
    # The draft model's adaptive chain of 5 alone (the default of servers and GPUs).
    "adaptive-chain-5": dict(drafter="model", tree="chain", depth=5, max_nodes=5, adaptive=True),
    # The default with the drafts' heads cut to 32,768 ids (the tokenizer's first ids
    # and its special tokens): outputs stay exact, a draft level reads less.
    "adaptive-chain-5-v32k": dict(drafter="model", tree="chain", depth=5, max_nodes=5, adaptive=True, draft_vocab_size=32768),
    # The model-free suffix drafter alone, and beside a draft model's chain.
    "suffix": dict(drafter="suffix", max_nodes=12, adaptive=True),
    "suffix-16-fixed": dict(drafter="suffix", max_nodes=16, adaptive=False),
    # A single stream's default on a CPU (``config.CPU_STREAM_SPECULATION``).
    "adaptive-chain-5+suffix": dict(CPU_STREAM_SPECULATION),
    # 64-node dynamic trees every step (the offloaded default without the adaptive budget).
    "dynamic-64": dict(OFFLOADED_SPECULATION, adaptive=False),
    # An offloaded target's default (``config.OFFLOADED_SPECULATION``).
    "offload-dynamic-64": dict(OFFLOADED_SPECULATION),
}


def tree_preset(name: str) -> dict[str, Any]:
    """A copy of the preset ``name``; ``ValueError`` naming the known presets otherwise."""
    if name not in TREE_PRESETS:
        raise ValueError(f"unknown speculation preset {name!r}; known: {', '.join(TREE_PRESETS)}")
    return dict(TREE_PRESETS[name])
