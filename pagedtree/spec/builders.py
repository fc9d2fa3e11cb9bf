"""Growing a token tree level by level from the draft model's logits.

The draft worker feeds the nodes a builder asks for (the root first), one tree level
per draft forward, and hands back each fed node's draft logits; the builder decides
which children to add and which of them to feed next. Builders know nothing about
KV blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedtree.sampling_params import SamplingParams
from pagedtree.spec.tree import ROOT, ChildDraw, TokenTree, TreeShape
from pagedtree.worker.sampler import target_probs


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities the draft proposes from: the raw distribution for greedy
    requests, the request's processed distribution (temperature, top-k/p, min-p)
    for sampling ones, so that it resembles what the target will sample from."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    return torch.log(target_probs(logits, params))


def pick_children(
    logprobs: torch.Tensor,
    k: int,
    rule: str,
    generator: torch.Generator | None,
) -> tuple[list[int], ChildDraw]:
    """Draw up to ``k`` sibling tokens from ``logprobs [V]`` by ``rule``."""
    if rule == "topk":
        k = min(k, int(torch.isfinite(logprobs).sum()))
        tokens = torch.topk(logprobs, k).indices.tolist() if k > 0 else []
        return tokens, ChildDraw("topk")
    probs = logprobs.exp()
    if rule == "iid":
        tokens = torch.multinomial(probs, k, replacement=True, generator=generator).tolist()
    elif rule == "without_replacement":
        k = min(k, int((probs > 0).sum()))
        tokens = torch.multinomial(probs, k, replacement=False, generator=generator).tolist()
    else:
        raise ValueError(f"unknown draft sampling rule {rule!r}")
    return tokens, ChildDraw(rule, probs)


class TreeBuilder:
    """Base: one request's tree in the making."""

    def __init__(self, root_token: int, params: SamplingParams, rule: str, generator: torch.Generator | None):
        self.tree = TokenTree(root_token)
        self.params = params
        self.rule = "topk" if params.greedy else rule
        self.generator = generator

    def _add_children(self, node: int, logits: torch.Tensor, k: int) -> list[int]:
        logprobs = draft_distribution(logits, self.params)
        tokens, draw = pick_children(logprobs, k, self.rule, self.generator)
        if not tokens:
            return []
        self.tree.draws.append(draw)
        draw_index = len(self.tree.draws) - 1
        base = 0.0 if node == ROOT else self.tree.scores[node]
        token_logprobs = logprobs[torch.as_tensor(tokens)].tolist()
        return [self.tree.add(node, t, draw_index, base + lp) for t, lp in zip(tokens, token_logprobs)]

    def expand_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[int]:
        """Add children below the nodes just fed; return the nodes to feed next."""
        raise NotImplementedError

    def finish(self) -> TokenTree:
        """The tree to verify."""
        return self.tree


class ShapeTreeBuilder(TreeBuilder):
    """Static shapes (SpecInfer expansion, chain, Sequoia): children by rank."""

    def __init__(self, shape: TreeShape, root_token: int, params: SamplingParams, rule: str, generator):
        super().__init__(root_token, params, rule, generator)
        self.shape = shape
        self._children = {ROOT: []}
        for i, p in enumerate(shape.parents):
            self._children.setdefault(p, []).append(i)
            self._children.setdefault(i, [])
        for kids in self._children.values():
            kids.sort(key=lambda i: shape.ranks[i])
        self._shape_node = {ROOT: ROOT}  # tree node -> shape node

    def expand_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[int]:
        to_feed = []
        for node, logits in fed:
            shape_kids = self._children[self._shape_node[node]]
            if not shape_kids:
                continue
            for tree_node, shape_node in zip(self._add_children(node, logits, len(shape_kids)), shape_kids):
                self._shape_node[tree_node] = shape_node
                if self._children[shape_node]:
                    to_feed.append(tree_node)
        return to_feed


class DynamicTreeBuilder(TreeBuilder):
    """EAGLE-2 style: expand the ``top_k`` most probable frontier nodes per level,
    then keep the ``max_nodes`` nodes with the highest cumulative draft probability.

    Children are always the draft's top tokens (deterministic), so verification of
    sampling requests uses the top-k rule.
    """

    def __init__(self, top_k: int, depth: int, max_nodes: int, root_token: int, params: SamplingParams, generator):
        super().__init__(root_token, params, "topk", generator)
        self.top_k = top_k
        self.depth = depth
        self.max_nodes = max_nodes

    def expand_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[int]:
        frontier = []
        for node, logits in fed:
            frontier.extend(self._add_children(node, logits, self.top_k))
        if not frontier or self.tree.depths[frontier[0]] >= self.depth:
            return []
        scores = self.tree.scores
        best = sorted(frontier, key=lambda i: (-scores[i], i))[: self.top_k]
        # Feeding a node that cannot make the final cut wastes a draft slot.
        cutoff = self._cutoff_score()
        return sorted(i for i in best if cutoff is None or scores[i] >= cutoff)

    def _cutoff_score(self) -> float | None:
        if self.tree.num_nodes < self.max_nodes:
            return None
        return sorted(self.tree.scores, reverse=True)[self.max_nodes - 1]

    def finish(self) -> TokenTree:
        if self.tree.num_nodes <= self.max_nodes:
            return self.tree
        scores = self.tree.scores
        # A child never outscores its parent (log-probabilities are <= 0) and ties go to
        # the lower index, which is the parent, so the kept set is closed under parents.
        keep = sorted(range(self.tree.num_nodes), key=lambda i: (-scores[i], i))[: self.max_nodes]
        return self.tree.subtree(keep)
