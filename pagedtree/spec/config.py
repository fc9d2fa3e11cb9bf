"""The user-facing speculative decoding settings."""

from __future__ import annotations

from dataclasses import dataclass

TREE_KINDS = ("static", "chain", "dynamic", "sequoia")
DRAFT_SAMPLING_RULES = ("without_replacement", "iid", "topk")


@dataclass(slots=True)
class SpeculativeConfig:
    """How the draft model(s) propose token trees and how large they may grow.

    ``tree`` picks the shape:

    - ``"static"``: SpecInfer expansion ``expansion = [k1, ..., kd]`` — every node at
      depth ``i-1`` gets its top ``k_i`` draft tokens as children;
    - ``"chain"``: one branch of ``depth`` tokens (classic speculative decoding);
    - ``"dynamic"``: EAGLE-2 style — at each of ``depth`` levels the ``top_k`` frontier
      nodes with the highest cumulative draft probability are expanded into their
      ``top_k`` children, then the best ``max_nodes`` nodes are kept;
    - ``"sequoia"``: the static shape of ``max_nodes`` nodes (at most ``depth`` deep)
      that maximises the expected accepted length for per-rank acceptance rates
      ``acceptance_rates`` (measured online when None).

    Several draft models (``draft_model=[...]`` on ``LLM``) each build a tree of this
    kind and the trees are merged. ``max_nodes`` caps the draft tokens per request and
    step. ``adaptive`` shrinks that budget as the batch grows and turns speculation off
    for a step when the measured draft and target costs say it would not pay.

    ``draft_sampling`` is how children are drawn for requests that sample
    (temperature > 0) in static/chain/sequoia trees: ``"without_replacement"``,
    ``"iid"`` or ``"topk"`` (deterministic); verification uses the matching rule.
    Greedy requests always take the draft's top tokens; dynamic trees always use top-k.
    """

    # Defaults measured on the Qwen2.5-Coder 1.5B/0.5B pair on the 2-core CPU
    # (benchmarks/RESULTS.md): there every draft level costs a full draft forward
    # while extra verify rows are cheap only up to a few, so a 5-token chain beat
    # wider trees (1.55x against 1.31x for a 16-node dynamic tree at batch 1).
    tree: str = "chain"
    expansion: tuple[int, ...] = (2, 2, 1, 1, 1, 1)
    depth: int = 5
    top_k: int = 4
    max_nodes: int = 5
    acceptance_rates: tuple[float, ...] | None = None
    draft_sampling: str = "without_replacement"
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.tree not in TREE_KINDS:
            raise ValueError(f"speculative tree must be one of {TREE_KINDS}, got {self.tree!r}")
        if self.draft_sampling not in DRAFT_SAMPLING_RULES:
            raise ValueError(
                f"draft_sampling must be one of {DRAFT_SAMPLING_RULES}, got {self.draft_sampling!r}"
            )
        self.expansion = tuple(self.expansion)
        if not self.expansion or any(not isinstance(k, int) or k < 1 for k in self.expansion):
            raise ValueError(f"expansion must be a non-empty list of positive integers, got {self.expansion}")
        for name in ("depth", "top_k", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.max_nodes > 256:
            raise ValueError(f"max_nodes must be <= 256 (one verify pass per tree), got {self.max_nodes}")
        if self.acceptance_rates is not None:
            self.acceptance_rates = tuple(float(a) for a in self.acceptance_rates)
            if not self.acceptance_rates or any(not 0.0 <= a <= 1.0 for a in self.acceptance_rates):
                raise ValueError(f"acceptance_rates must be probabilities, got {self.acceptance_rates}")

    @property
    def max_depth(self) -> int:
        """The deepest a tree of this config can grow."""
        if self.tree == "static":
            return len(self.expansion)
        return self.depth
