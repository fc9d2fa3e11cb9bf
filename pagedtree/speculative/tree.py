"""Token trees and tree shapes.

A ``TokenTree`` hangs off the request's newest committed token (its root, which the
target has not yet computed). Nodes are draft tokens; ``parents[i]`` is the index of
node ``i``'s parent among the nodes, or -1 for a child of the root; parents precede
children. A node has at most one child per token: equal proposals (two draft models
proposing the same token, or repeated i.i.d. samples) share one node. The verify
pass feeds ``[root] + tokens`` with the ancestors-only mask.

How the children were proposed is kept separately, in ``draws``: one ``ChildDraw``
per (parent, draft model, expansion) with the proposed tokens in the order they
were drawn, repeats included. Stochastic verification replays exactly those
proposals, draw after draw, so a merged node is tested once per draw that proposed
it, against that draw's own distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1

# Children chosen without randomness: the draft's top tokens ("topk"), or the top
# tokens of draft log-probabilities plus the request's seeded Gumbel noise
# ("coupled"). Any subset of such proposals may be verified, so trees made of them
# may be pruned; random draws ("iid", "without_replacement") may not.
DETERMINISTIC_RULES = ("topk", "coupled")
RANDOM_RULES = ("iid", "without_replacement")


@dataclass(slots=True)
class ChildDraw:
    """One draw of sibling tokens below ``parent`` from a draft distribution.

    ``rule`` says how the siblings were drawn, which decides how they are verified:
    ``"topk"`` (deterministic: the draft's top tokens), ``"coupled"`` (deterministic
    given the request's seeded noise), ``"iid"`` (independent samples of ``probs``)
    or ``"without_replacement"`` (successive samples of ``probs`` with the earlier
    siblings removed). ``tokens`` are the proposals in drawing order (an i.i.d. draw
    may repeat a token); ``probs`` is kept for the two random rules.
    """

    rule: str
    parent: int
    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    @property
    def deterministic(self) -> bool:
        """Whether the proposals were chosen without random draws."""
        return self.rule in DETERMINISTIC_RULES


@dataclass(slots=True)
class TokenTree:
    """Draft tokens arranged as a tree below the root token (see module docstring)."""

    root_token: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for children of the root
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    draws: list[ChildDraw] = field(default_factory=list)
    _child: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)

    @property
    def num_nodes(self) -> int:
        """Draft tokens in the tree (the root not counted)."""
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Length of the longest branch."""
        return max(self.depths, default=0)

    @property
    def deterministic(self) -> bool:
        """Whether every proposal in the tree was chosen without random draws."""
        return all(d.deterministic for d in self.draws)

    def child(self, parent: int, token: int) -> int | None:
        """The node holding ``token`` below ``parent``, if any."""
        return self._child.get((parent, token))

    def add(self, parent: int, token: int, score: float = 0.0) -> int:
        """The node for ``token`` below ``parent`` (ROOT or a node index), created if new.

        An existing node keeps the higher of the two scores.
        """
        if parent != ROOT and not 0 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of the tree")
        existing = self._child.get((parent, token))
        if existing is not None:
            self.scores[existing] = max(self.scores[existing], score)
            return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self.scores.append(score)
        node = len(self.tokens) - 1
        self._child[(parent, token)] = node
        return node

    def children(self, node: int) -> list[int]:
        """Indices of ``node``'s children (ROOT for the root's), in order of creation."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def draws_at(self, node: int) -> list[ChildDraw]:
        """The draws that proposed ``node``'s children, in drawing order."""
        return [d for d in self.draws if d.parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def best_nodes(self, max_nodes: int | None = None) -> list[int]:
        """The ``max_nodes`` best nodes by score (all with None), best first. A child
        never outscores its parent (scores are cumulative log-probabilities) and ties
        go to the lower index, the parent, so any prefix is closed under parents."""
        order = sorted(range(self.num_nodes), key=lambda i: (-self.scores[i], i))
        return order if max_nodes is None else order[:max_nodes]

    def subtree(self, keep: Sequence[int]) -> TokenTree:
        """The tree restricted to the nodes ``keep`` (closed under parents), reindexed.

        Proposals of dropped nodes leave their draws. Only deterministic proposals may
        be dropped: skipping a randomly drawn sibling would change the distribution
        its later siblings were drawn from.
        """
        keep_sorted = sorted(set(keep))
        new_index = {old: new for new, old in enumerate(keep_sorted)}
        out = TokenTree(self.root_token)
        for old in keep_sorted:
            parent = self.parents[old]
            if parent != ROOT and parent not in new_index:
                raise ValueError(f"node {old} kept without its parent {parent}")
            out.add(ROOT if parent == ROOT else new_index[parent], self.tokens[old], self.scores[old])
        for draw in self.draws:
            if draw.parent != ROOT and draw.parent not in new_index:
                if not draw.deterministic:
                    raise ValueError("randomly drawn proposals cannot be pruned from a tree")
                continue
            parent = ROOT if draw.parent == ROOT else new_index[draw.parent]
            tokens = [t for t in draw.tokens if out.child(parent, t) is not None]
            if len(tokens) != len(draw.tokens) and not draw.deterministic:
                raise ValueError("randomly drawn proposals cannot be pruned from a tree")
            if tokens:
                out.draws.append(ChildDraw(draw.rule, parent, tokens, draw.probs))
        return out


@dataclass(slots=True)
class TreeShape:
    """A static tree shape: ``parents`` of each node and its ``rank`` among its siblings.

    Rank 0 is the draft's most likely child. Shapes list nodes in breadth-first order.
    """

    parents: list[int]
    ranks: list[int]

    @property
    def num_nodes(self) -> int:
        """Nodes in the shape."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        """Length of the longest branch."""
        depth = [0] * len(self.parents)
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p == ROOT else depth[p] + 1
        return max(depth, default=0)

    @classmethod
    def from_expansion(cls, expansion: Sequence[int], max_nodes: int) -> TreeShape:
        """SpecInfer's ``<k1, ..., kd>``: every node at depth i-1 gets k_i children.

        Breadth-first, so a budget smaller than the full expansion keeps the shallow
        levels (the ones most likely to be accepted) and the top-ranked branches.
        """
        parents: list[int] = []
        ranks: list[int] = []
        frontier = [ROOT]
        for k in expansion:
            next_frontier = []
            for node in frontier:
                for rank in range(k):
                    if len(parents) == max_nodes:
                        return cls(parents, ranks)
                    parents.append(node)
                    ranks.append(rank)
                    next_frontier.append(len(parents) - 1)
            frontier = next_frontier
        return cls(parents, ranks)

    @classmethod
    def chain(cls, depth: int) -> TreeShape:
        """A single branch of ``depth`` nodes."""
        return cls(list(range(-1, depth - 1)), [0] * depth)
