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
from pagedtree.sampling import target_probs
from pagedtree.structured.matcher import RequestGrammar, apply_bitmasks

# depth of the children to propose (1 = the root's) -> the request's Gumbel noise
# for that output position (coupled proposals of seeded requests).
NoiseForDepth = Callable[[int], torch.Tensor]


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities the draft proposes from: the raw distribution for greedy
    requests, the request's processed distribution (temperature, top-k/p, min-p)
    for sampling ones, so that it resembles what the target will sample from."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    return torch.log(target_probs(logits, params))


@dataclass(slots=True)
class StagedChildren:
    """The children drawn below one fed node, still on the device until
    :func:`read_children` brings every node's of a draft level back in one copy.

    ``tokens`` in drawing order and each one's score increment: its draft
    log-probability, or for coupled proposals its log-probability of being the
    noisy argmax. An increment of ``-inf`` marks a token the rule could not have
    drawn (top-k past the finite scores, a token of probability 0 without
    replacement); reading back drops those.
    """

    node: int
    tokens: torch.Tensor  # [k] int64
    increments: torch.Tensor  # [k] float
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
    device: the tokens in drawing order, their score increments, and the draw (its
    ``parent`` still to be set). Nothing is read back.

    Without replacement, the ``k`` tokens are the top ``k`` of the log-probabilities
    plus Gumbel noise (the Gumbel-top-k trick: the same distribution, drawing order
    included, as ``k`` successive draws each renormalised over what is left).
    """
    k = min(k, logprobs.shape[-1])
    if rule in ("topk", "coupled"):
        scores = logprobs if rule == "topk" else logprobs + noise
        tokens = torch.topk(scores, k).indices
        ranked = logprobs if rule == "topk" else torch.log_softmax(scores, dim=-1)
        return tokens, ranked[tokens], ChildDraw(rule, ROOT)
    probs = logprobs.exp()
    if rule == "iid":
        tokens = _iid_draws(probs, k, generator)
    elif rule == "without_replacement":
        u = torch.rand(logprobs.shape, generator=generator, device=logprobs.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tokens = torch.topk(logprobs.double() + gumbel, k).indices
    else:
        raise ValueError(f"unknown draft sampling rule {rule!r}")
    return tokens, logprobs[tokens], ChildDraw(rule, ROOT, probs=probs)


def _iid_draws(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` independent draws from ``probs [V]`` on the device, the tokens
    ``torch.multinomial(probs, k, replacement=True)`` draws, without a host sync.

    For one sample, torch's own algorithm (argmax of ``probs / E``, ``E ~ Exp(1)``)
    without torch's checks of the distribution, which are host reads in older torch
    releases (newer ones assert on the device): the same token and the same
    generator state. Several samples with replacement are kernels only in every
    release. A distribution without mass gives a token of log-probability
    ``-inf`` (dropped on reading back), a NaN one a NaN increment (refused there).
    """
    if k == 1:
        race = torch.empty_like(probs).exponential_(1, generator=generator)
        return torch.argmax(probs / race, dim=-1, keepdim=True)
    return torch.multinomial(probs, k, replacement=True, generator=generator)


def read_children(staged: Sequence[StagedChildren]) -> None:
    """Fill every staged node's host tokens and increments in one device-to-host
    copy (one sync per draft level, not two per fed node), dropping the tokens the
    rule could not have drawn. A NaN increment (a draft distribution that is not a
    distribution) raises ``ValueError``: the request then drafts nothing this step."""
    if not staged:
        return
    flat = torch.cat([t for s in staged for t in (s.tokens.to(torch.float64), s.increments.to(torch.float64))])
    host = flat.tolist()
    if any(value != value for value in host):
        raise ValueError("the draft's distribution has NaN entries")
    offset = 0
    for s in staged:
        k = s.tokens.numel()
        tokens, increments = host[offset:offset + k], host[offset + k:offset + 2 * k]
        offset += 2 * k
        keep = [i for i, inc in enumerate(increments) if inc != -math.inf]
        s.host_tokens = [int(tokens[i]) for i in keep]
        s.host_increments = [increments[i] for i in keep]


class TreeBuilder:
    """Base: one request's tree in the making.

    ``rule`` is how children are proposed: ``"topk"``, ``"iid"``,
    ``"without_replacement"``, or ``"coupled"`` (the top tokens of the draft's
    log-probabilities plus ``noise(depth)``, the request's seeded Gumbel noise).
    """

    def __init__(
        self,
        root_token: int,
        params: SamplingParams,
        rule: str,
        generator: torch.Generator | None,
        noise: NoiseForDepth | None = None,
        grammar: RequestGrammar | None = None,
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
                 noise: NoiseForDepth | None = None, grammar: RequestGrammar | None = None):
        super().__init__(root_token, params, rule, generator, noise, grammar)
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

    def chain_length(self) -> int | None:
        """The nodes of this builder's tree when it is a chain without a grammar (every
        node at most one child), which the draft worker can feed level after level
        without reading the children back between levels; None otherwise."""
        if self.grammar is not None or any(len(kids) > 1 for kids in self._children.values()):
            return None
        return len(self.shape.parents)

    def stage_chain(self, depth: int, logits: torch.Tensor) -> StagedChildren:
        """The chain's child at ``depth`` (1: the root's), drawn on the device from its
        parent's draft ``logits`` before the parent is read back: the draw
        ``stage_level`` makes there (one child, the same rule, noise and generator).
        Its node is set when the chain is grown after the readback."""
        logprobs = draft_distribution(logits, self.params)
        noise = self.noise(depth) if self.rule == "coupled" else None
        tokens, increments, draw = stage_children(logprobs, 1, self.rule, self.generator, noise)
        return StagedChildren(ROOT, tokens, increments, draw)

    def grow(self, staged: Sequence[StagedChildren]) -> list[int]:
        to_feed = []
        for children in staged:
            shape_kids = self._children[self._shape_node[children.node]]
            for tree_node, shape_node in zip(self._add_children(children), shape_kids):
                if tree_node is None:
                    continue
                self._shape_node[tree_node] = shape_node
                if self._children[shape_node]:
                    to_feed.append(tree_node)
        return to_feed


class DynamicTreeBuilder(TreeBuilder):
    """EAGLE-2 style: expand the ``top_k`` most probable frontier nodes per level,
    then keep the ``max_nodes`` nodes with the highest cumulative draft probability.

    Children are always deterministic (the draft's top tokens, or for seeded
    requests the coupled ones), so sampling requests never need a random-draw rule.
    """

    def __init__(self, top_k: int, depth: int, max_nodes: int, root_token: int, params: SamplingParams,
                 rule: str = "topk", noise: NoiseForDepth | None = None, grammar: RequestGrammar | None = None):
        if rule not in ("topk", "coupled"):
            raise ValueError(f"dynamic trees propose deterministic children, not {rule!r}")
        super().__init__(root_token, params, rule, None, noise, grammar)
        self.top_k = top_k
        self.depth = depth
        self.max_nodes = max_nodes

    def stage_level(self, fed: Sequence[tuple[int, torch.Tensor]]) -> list[StagedChildren]:
        return [self._stage_children(node, logits, self.top_k) for node, logits in fed]

    def grow(self, staged: Sequence[StagedChildren]) -> list[int]:
        frontier = []
        for children in staged:
            frontier.extend(n for n in self._add_children(children) if n is not None)
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
