"""Verifying a token tree against the target model's outputs at every node.

Rows of the verify pass: row 0 is the root (the request's newest token), row
``1 + i`` is tree node ``i``. Greedy verification follows the target's argmax down
the tree. Stochastic verification preserves the target distribution exactly with
the rule that matches how each node's children were drawn (SpecInfer's multi-step
speculative sampling / recursive rejection sampling):

- ``iid`` children (independent samples of q): test child ``x`` with probability
  ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))``;
- ``without_replacement`` children: the same test with ``q`` renormalised over the
  tokens not yet drawn in that draw (the distribution the sibling was drawn from);
- ``topk`` children (deterministic): accept with probability ``p(x)``; on rejection
  ``p <- norm(p with x removed)``.

If every child is rejected (or the node is a leaf) the bonus token is drawn from the
final residual ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.spec.tree import ROOT, TokenTree
from pagedtree.worker.sampler import draw_token

_EPS = 1e-12


@dataclass(slots=True)
class VerifyResult:
    """The accepted path (node indices, root's child first) and the target's next token.

    ``rank_trials`` records, for every child tested, its rank among its siblings and
    whether it was accepted (the measurements behind Sequoia shapes).
    """

    accepted_nodes: list[int]
    bonus_token: int
    rank_trials: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the bonus token not counted)."""
        return len(self.accepted_nodes)


def _children_by_parent(tree: TokenTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(tree: TokenTree, target_tokens: Sequence[int]) -> VerifyResult:
    """Longest path whose tokens equal the target's argmax; ``target_tokens[r]`` is the
    argmax at verify row ``r``."""
    if len(target_tokens) != tree.num_nodes + 1:
        raise ValueError(f"{len(target_tokens)} target tokens for a tree of {tree.num_nodes} nodes")
    kids = _children_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        want = target_tokens[node + 1]
        nxt = None
        for rank, child in enumerate(kids.get(node, [])):
            hit = tree.tokens[child] == want
            result.rank_trials.append((rank, hit))
            if hit:
                nxt = child
                break
        if nxt is None:
            result.bonus_token = int(want)
            return result
        result.accepted_nodes.append(nxt)
        node = nxt


def verify_stochastic(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Distribution-preserving verification; ``target_probs [1 + T, V]`` are the
    target's (processed) next-token distributions at every verify row."""
    if target_probs.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"{target_probs.shape[0]} rows of target probabilities for {tree.num_nodes} nodes")
    kids = _children_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        p = target_probs[node + 1].double()
        drawn: dict[int, list[int]] = {}  # draw index -> tokens already tested from it
        nxt = None
        for rank, child in enumerate(kids.get(node, [])):
            x = tree.tokens[child]
            draw = tree.draws[tree.draw_of[child]]
            before = drawn.setdefault(tree.draw_of[child], [])
            if draw.rule == "topk":
                q = None
                accept_prob = float(p[x])
            else:
                q = draw.probs.double()
                if draw.rule == "without_replacement" and before:
                    q = q.clone()
                    q[before] = 0.0
                    q = q / q.sum()
                qx = float(q[x])
                accept_prob = 1.0 if qx <= 0.0 else min(1.0, float(p[x]) / qx)
            before.append(x)
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < accept_prob:
                result.rank_trials.append((rank, True))
                nxt = child
                break
            result.rank_trials.append((rank, False))
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            # A vanishing residual means p == q up to rounding: rejection had probability
            # ~0, and p itself is the right distribution to continue with.
            if total > _EPS:
                p = residual / total
        if nxt is None:
            result.bonus_token = draw_token(p, generator)
            return result
        result.accepted_nodes.append(nxt)
        node = nxt
