"""Speculation counters (vLLM's names where vLLM has them), engine-wide and per request."""

from __future__ import annotations

from collections import deque

from pagedtree.request import Request
from pagedtree.speculative.tree import TokenTree
from pagedtree.speculative.verification.rules import VerifyResult

# Per-step tree sizes kept for stats (bounded so long runs do not grow without end).
_TREE_SIZE_HISTORY = 10_000


class SpecMetrics:
    """What speculation drafted and what the target accepted."""

    def __init__(self) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.tree_sizes_per_step: deque[int] = deque(maxlen=_TREE_SIZE_HISTORY)

    def record(self, request: Request, tree: TokenTree, result: VerifyResult) -> None:
        """Count one verified tree, engine-wide and on the request."""
        self.num_drafts += 1
        self.num_draft_tokens += tree.num_nodes
        self.num_accepted_tokens += result.num_accepted
        while len(self.accepted_per_position) < result.num_accepted:
            self.accepted_per_position.append(0)
        for i in range(result.num_accepted):
            self.accepted_per_position[i] += 1
        request.spec_num_drafts += 1
        request.spec_num_draft_tokens += tree.num_nodes
        request.spec_num_accepted_tokens += result.num_accepted

    def stats(self) -> dict[str, object]:
        """The counters for ``LLM.stats()``."""
        drafts = max(self.num_drafts, 1)
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_tokens_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if self.num_drafts else 0.0,
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "tree_sizes_per_step": list(self.tree_sizes_per_step),
        }
