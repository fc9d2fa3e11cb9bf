"""Growing a token tree level by level from the draft model's logits.

The draft worker feeds the nodes a builder asks for (the root first), one tree level
per draft forward, and hands back each fed node's draft logits; the builder decides
which children to add and which of them to feed next. Builders know nothing about
KV blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.sampling_params import SamplingParams
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree, TreeShape
from pagedtree.draft_sampling import ChildRule, DrawnChildren, draft_distribution, draw_children, read_drawn
from pagedtree.structured.matcher import RequestGrammar, apply_bitmasks

# depth of the children to propose (1 = the root's) -> the request's Gumbel noise
# for that output position (coupled proposals of seeded requests).
NoiseForDepth = Callable[[int], torch.Tensor]


@dataclass(slots=True)
class StagedChildren:
    """The children drawn below one fed node, still on the device until
    :func:`read_children` brings every node's of a draft level back in one copy.

    ``tokens`` in drawing order and each one's score increment: its draft
    log-probability, or for coupled proposals its log-probability of being the
    noisy argmax. An increment of ``-inf`` marks a token the rule could not have
    drawn (top-k past the finite scores, a token of probability 0 without
    replacement); reading back drops those. A whole draft's children come back
    read already (``worker/draft_levels.py``): their device tensors are None.
    """

    node: int
    tokens: torch.Tensor | None  # [k] int64
    increments: torch.Tensor | None  # [k] float
    draw: ChildDraw
    host_tokens: list[int] = field(default_factory=list)
    host_increments: list[float] = field(default_factory=list)


def stage_children(
    logprobs: torch.Tensor,
    k: int,
    rule: str,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ChildDraw]:
    """Draw up to ``k`` sibling tokens from ``logprobs [V]`` by ``rule``, on the
    device (``draft_sampling.draw_children``): the tokens in drawing order, their
    score increments, and the draw (its ``parent`` still to be set). Nothing is read
    back."""
    drawn = draw_children(logprobs, k, rule, generator, noise)
    return drawn.tokens, drawn.increments, ChildDraw(rule, ROOT, probs=drawn.probs)


def read_children(staged: Sequence[StagedChildren]) -> None:
    """Fill every staged node's host tokens and increments in one device-to-host
    copy (``draft_sampling.read_drawn``: one sync per draft level), without the
    tokens the rule could not have drawn; a NaN increment raises ``ValueError``."""
    read = read_drawn([DrawnChildren(s.tokens, s.increments) for s in staged])
    for s, (tokens, increments) in zip(staged, read):
        s.host_tokens, s.host_increments = tokens, increments


class TreeBuilder:
    """Base: one request's tree in the making.

    ``rule`` is how children are proposed: ``"topk"``, ``"iid"``,
    ``"without_replacement"``, or ``"coupled"`` (the top tokens of the draft's
    log-probabilities plus ``noise(depth)``, the request's seeded Gumbel noise).

    ``min_prob`` (llama.cpp's ``--draft-p-min``): a child whose score increment is
    below ``log(min_prob)`` (a draft probability, or for coupled proposals the
    probability of being the noisy argmax) stays in the tree but is not fed, so
    nothing is drafted below it: where the draft is unsure, the levels below would
    rarely be accepted. Which nodes grow depends only on their own paths, so each
    node's children are still drawn from the draft's distribution there, which is
    all verification needs.
    """

    def __init__(
        self,
        root_token: int,
        params: SamplingParams,
        rule: str,
        generator: torch.Generator | None,
        noise: NoiseForDepth | None = None,
        grammar: RequestGrammar | None = None,
        min_prob: float = 0.0,
    ):
        # Greedy requests verify by argmax: their children are always the draft's top tokens.
        rule = "topk" if params.greedy else rule
        if rule == "coupled" and noise is None:
            raise ValueError("coupled proposals need the request's noise")
        self.tree = TokenTree(root_token)
        self.params = params
        self.rule = rule
        self.generator = generator
        self.noise = noise
        self.grammar = grammar
        self.min_increment = math.log(min_prob) if min_prob > 0 else -math.inf

    def _stage_children(self, node: int, logits: torch.Tensor, k: int) -> StagedChildren:
        """Draw up to ``k`` children below ``node`` on the device (``stage_children``).

        Under a grammar the draft proposes only what the grammar allows after the
        node's path: its logits are masked there, so its distribution (which random
        proposals are verified against) is the masked one."""
        if self.grammar is not None:
            path = [] if node == ROOT else [self.tree.tokens[i] for i in self.tree.path_to(node)]
            bitmask = self.grammar.bitmask_after(path)
            if bitmask is None:  # the grammar ends here (or rejects the path): no children
                empty = torch.empty(0, dtype=torch.long, device=logits.device)
                return StagedChildren(node, empty, empty.float(), ChildDraw(self.rule, ROOT))
            logits = logits.float().reshape(1, -1).clone()
            apply_bitmasks(logits, [0], [bitmask])
            logits = logits[0]
        logprobs = draft_distribution(logits, self.params)
        depth = 1 if node == ROOT else self.tree.depths[node] + 1
        noise = self.noise(depth) if self.rule == "coupled" else None
        tokens, increments, draw = stage_children(logprobs, k, self.rule, self.generator, noise)
        return StagedChildren(node, tokens, increments, draw)

    def _confident(self, staged: StagedChildren, index: int) -> bool:
        """Whether the ``index``-th child of ``staged`` may be fed (see ``min_prob``)."""
        return staged.host_increments[index] >= self.min_increment

    def _add_children(self, staged: StagedChildren) -> list[int | None]:
        """Add the read-back children below their node; returns, per proposal, its new
        node, or None where the token was already a child (a repeated i.i.d. draw)."""
        node, tokens = staged.node, staged.host_tokens
        if not tokens:
            return []
        draw = staged.draw
        draw.parent = node
        draw.tokens = tokens
        self.tree.draws.append(draw)
        base = 0.0 if node == ROOT else self.tree.scores[node]
        added: list[int | None] = []
        for token, inc in zip(tokens, staged.host_increments):
            new = self.tree.child(node, token) is None
            child = self.tree.add(node, token, base + inc)
            added.append(child if new else None)
        return added

    def stage_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[StagedChildren]:
        """Draw, on the device, the children of the nodes just fed (their draft logits)."""
        raise NotImplementedError

    def grow(self, staged: Sequence[StagedChildren]) -> list[int]:
        """Add the read-back children of a level; return the nodes to feed next."""
        raise NotImplementedError

    def expand_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[int]:
        """``stage_level``, read back, ``grow``: one builder's level on its own (the
        draft worker stages every request's level before one read-back)."""
        staged = self.stage_level(fed)
        read_children(staged)
        return self.grow(staged)

    def finish(self) -> TokenTree:
        """The tree to verify."""
        return self.tree


class ShapeTreeBuilder(TreeBuilder):
    """Static shapes (SpecInfer expansion, chain, Sequoia): children by rank.

    A repeated i.i.d. draw adds no node, and the shape's subtree below it is not grown.
    """

    def __init__(self, shape: TreeShape, root_token: int, params: SamplingParams, rule: str, generator,
                 noise: NoiseForDepth | None = None, grammar: RequestGrammar | None = None, min_prob: float = 0.0):
        super().__init__(root_token, params, rule, generator, noise, grammar, min_prob)
        self.shape = shape
        self._children = {ROOT: []}
        for i, p in enumerate(shape.parents):
            self._children.setdefault(p, []).append(i)
            self._children.setdefault(i, [])
        for kids in self._children.values():
            kids.sort(key=lambda i: shape.ranks[i])
        self._shape_node = {ROOT: ROOT}  # tree node -> shape node

    def stage_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[StagedChildren]:
        staged = []
        for node, logits in fed:
            shape_kids = self._children[self._shape_node[node]]
            if shape_kids:
                staged.append(self._stage_children(node, logits, len(shape_kids)))
        return staged

    def drafts_whole(self) -> bool:
        """Whether the draft worker may run this tree's levels back to back without
        reading children back between them (``DraftWorker.whole_drafts``): every node
        the shape would feed is fed whatever was drawn above it, and ``grow_drawn``
        keeps what level by level would have kept. A grammar's mask follows each
        path on the host, so a tree under a grammar is grown level by level.

        Fed all the same, a node whose token the rule could not draw (``-inf``) or a
        repeated i.i.d. draw still draws children, which the tree then drops: for the
        random rules that moves later draws along the request's random stream, so the
        tree can differ from level by level's, each of its draws still an independent
        draw from the draft's distribution (what verification needs)."""
        return self.grammar is None

    def shape_children(self, shape_node: int) -> list[int]:
        """The shape's children of ``shape_node`` (``ROOT`` included), in drawing order."""
        return self._children[shape_node]

    def child_rule(self, shape_node: int, depth: int) -> ChildRule:
        """How the children of ``shape_node`` (at ``depth``, the root's 0) are drawn:
        what ``stage_level`` draws there."""
        noise = self.noise(depth + 1) if self.rule == "coupled" else None
        return ChildRule(len(self._children[shape_node]), self.rule, self.params, self.generator, noise)

    def grow_drawn(self, drawn: dict[int, StagedChildren]) -> dict[int, int]:
        """Grow the tree from children drawn below shape nodes (read back, ``node``
        not set yet) as ``grow`` would have grown it level by level; returns the tree
        node of every shape node that made it into the tree (``ROOT`` included)."""
        tree_of = {ROOT: ROOT}
        level = [ROOT]
        while level:
            staged = []
            for shape_node in level:
                children = drawn.get(shape_node)
                if children is not None:
                    children.node = tree_of[shape_node]
                    staged.append(children)
            fed = self.grow(staged)
            for tree_node, shape_node in self._shape_node.items():
                tree_of.setdefault(shape_node, tree_node)
            level = [self._shape_node[node] for node in fed]
        return tree_of

    def grow(self, staged: Sequence[StagedChildren]) -> list[int]:
        to_feed = []
        for children in staged:
            shape_kids = self._children[self._shape_node[children.node]]
            for index, (tree_node, shape_node) in enumerate(zip(self._add_children(children), shape_kids)):
                if tree_node is None:
                    continue
                self._shape_node[tree_node] = shape_node
                if self._children[shape_node] and self._confident(children, index):
                    to_feed.append(tree_node)
        return to_feed


class DynamicTreeBuilder(TreeBuilder):
    """EAGLE-2 style: expand the ``top_k`` most probable frontier nodes per level,
    then keep the ``max_nodes`` nodes with the highest cumulative draft probability.

    Children are always deterministic (the draft's top tokens, or for seeded
    requests the coupled ones), so sampling requests never need a random-draw rule.
    """

    def __init__(self, top_k: int, depth: int, max_nodes: int, root_token: int, params: SamplingParams,
                 rule: str = "topk", noise: NoiseForDepth | None = None, grammar: RequestGrammar | None = None,
                 min_prob: float = 0.0):
        if rule not in ("topk", "coupled"):
            raise ValueError(f"dynamic trees propose deterministic children, not {rule!r}")
        super().__init__(root_token, params, rule, None, noise, grammar, min_prob)
        self.top_k = top_k
        self.depth = depth
        self.max_nodes = max_nodes

    def stage_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[StagedChildren]:
        return [self._stage_children(node, logits, self.top_k) for node, logits in fed]

    def grow(self, staged: Sequence[StagedChildren]) -> list[int]:
        frontier = []
        for children in staged:
            nodes = self._add_children(children)
            frontier.extend(n for i, n in enumerate(nodes) if n is not None and self._confident(children, i))
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
        # The best nodes by score are closed under parents (``TokenTree.best_nodes``).
        return self.tree.subtree(self.tree.best_nodes(self.max_nodes))
