"""Verifying a token tree against the target model's outputs at every node.

Rows of the verify pass: row 0 is the root (the request's newest token), row
``1 + i`` is tree node ``i``. Three ways to verify, one per kind of request:

- **greedy**: follow the target's argmax down the tree;
- **coupled** (seeded sampling requests): the target's token at every row is the
  Gumbel-max draw with the request's noise for that output position, exactly the
  token plain decoding draws there, and the tree is walked as in greedy. The
  output is then a function of the seed alone, whatever the tree;
- **stochastic** (other sampling requests): SpecInfer's multi-step speculative
  sampling (recursive rejection sampling), which preserves the target distribution
  with the rule that matches how each proposal was drawn. The proposals below a
  node are replayed draw by draw, in drawing order:

  - ``iid`` (independent samples of q): accept ``x`` with probability
    ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))``;
  - ``without_replacement``: the same test with ``q`` renormalised over the tokens
    this draw had not yet drawn (the distribution the sibling was drawn from);
  - ``topk`` (deterministic): accept with probability ``p(x)``; on rejection
    ``p <- norm(p with x removed)``.

  Each step is a valid rejection-sampling step for the current residual whatever
  came before, so proposals of several independent draws (several draft models,
  merged into one tree) chain correctly, each with its own ``q``. A token rejected
  once has no mass left in the residual, so a second proposal of it is rejected
  at once (only the residual update remains).

If no child is accepted (or the node is a leaf) the bonus token is drawn from the
final residual ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree
from pagedtree.sampling import draw_token

_EPS = 1e-12


@dataclass(slots=True)
class VerifyResult:
    """The accepted path (node indices, root's child first) and the target's next token.

    ``trials`` records, for every proposal tested, its depth (1 for the root's
    children), its rank among the proposals below its node and whether it was
    accepted: the measurements behind Sequoia shapes and the adaptive budget.
    """

    accepted_nodes: list[int]
    bonus_token: int
    trials: list[tuple[int, int, bool]] = field(default_factory=list)

    @property
    def rank_trials(self) -> list[tuple[int, bool]]:
        """``(rank, accepted)`` of every proposal tested."""
        return [(rank, hit) for _, rank, hit in self.trials]

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
    """Longest path whose tokens equal the target's; ``target_tokens[r]`` is the
    target's token at verify row ``r`` (its argmax, or its coupled draw)."""
    if len(target_tokens) != tree.num_nodes + 1:
        raise ValueError(f"{len(target_tokens)} target tokens for a tree of {tree.num_nodes} nodes")
    kids = _children_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        want = int(target_tokens[node + 1])
        nxt = None
        for rank, child in enumerate(kids.get(node, [])):
            hit = tree.tokens[child] == want
            result.trials.append((len(result.accepted_nodes) + 1, rank, hit))
            if hit:
                nxt = child
                break
        if nxt is None:
            result.bonus_token = want
            return result
        result.accepted_nodes.append(nxt)
        node = nxt


def _draws_by_parent(tree: TokenTree) -> dict[int, list[ChildDraw]]:
    out: dict[int, list[ChildDraw]] = {}
    for draw in tree.draws:
        if draw.rule not in ("topk", "iid", "without_replacement"):
            raise ValueError(f"proposals drawn by {draw.rule!r} are not verified by rejection sampling")
        out.setdefault(draw.parent, []).append(draw)
    return out


def verify_stochastic(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Distribution-preserving verification; ``target_probs [1 + T, V]`` are the
    target's (processed) next-token distributions at every verify row."""
    if target_probs.shape[0] != tree.num_nodes + 1:
        raise ValueError(f"{target_probs.shape[0]} rows of target probabilities for {tree.num_nodes} nodes")
    draws = _draws_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        p = target_probs[node + 1].double()
        nxt = None
        rank = 0
        for draw in draws.get(node, []):
            q_draw = draw.probs.double() if draw.probs is not None else None
            tried: list[int] = []
            for x in draw.tokens:
                if draw.rule == "topk":
                    q = None
                    accept_prob = float(p[x])
                else:
                    q = q_draw
                    if draw.rule == "without_replacement" and tried:
                        q = q_draw.clone()
                        q[tried] = 0.0
                        q = q / q.sum()
                    qx = float(q[x])
                    accept_prob = 1.0 if qx <= 0.0 else min(1.0, float(p[x]) / qx)
                tried.append(x)
                # A token with no mass left (rejected before) needs no coin.
                if accept_prob > 0.0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < accept_prob:
                    result.trials.append((len(result.accepted_nodes) + 1, rank, True))
                    nxt = tree.child(node, x)
                    break
                result.trials.append((len(result.accepted_nodes) + 1, rank, False))
                rank += 1
                if q is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                total = float(residual.sum())
                # A vanishing residual means p == q up to rounding: rejection had
                # probability ~0, and p itself is the right distribution to continue with.
                if total > _EPS:
                    p = residual / total
            if nxt is not None:
                break
        if nxt is None:
            result.bonus_token = draw_token(p, generator)
            return result
        result.accepted_nodes.append(nxt)
        node = nxt
