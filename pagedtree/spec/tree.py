"""Token trees and tree shapes.

A ``TokenTree`` hangs off the request's newest committed token (its root, which the
target has not yet computed). Nodes are draft tokens; ``parents[i]`` is the index of
node ``i``'s parent among the nodes, or -1 for a child of the root; parents precede
children. The verify pass feeds ``[root] + tokens`` with the ancestors-only mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ROOT = -1


@dataclass(slots=True)
class ChildDraw:
    """One joint draw of sibling tokens from a draft distribution.

    ``rule`` says how the siblings were drawn, which decides how they are verified:
    ``"topk"`` (deterministic: the draft's top tokens), ``"iid"`` (independent samples
    of ``probs``) or ``"without_replacement"`` (successive samples of ``probs`` with
    the earlier siblings removed). ``probs`` is kept for the two random rules.
    """

    rule: str
    probs: torch.Tensor | None = None


@dataclass(slots=True)
class TokenTree:
    """Draft tokens arranged as a tree below the root token (see module docstring)."""

    root_token: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for children of the root
    draw_of: list[int] = field(default_factory=list)  # index into ``draws`` per node
    draws: list[ChildDraw] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability

    @property
    def num_nodes(self) -> int:
        """Draft tokens in the tree (the root not counted)."""
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Length of the longest branch."""
        return max(self.depths, default=0)

    def add(self, parent: int, token: int, draw: int, score: float = 0.0) -> int:
        """Append a node below ``parent`` (ROOT or a node index); return its index."""
        if parent != ROOT and not 0 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of the tree")
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        self.draw_of.append(draw)
        self.scores.append(score)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Indices of ``node``'s children (ROOT for the root's), in drawing order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node``."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def verify_parents(self) -> list[int]:
        """Parents of ``[root] + nodes`` as the verify chunk sees them (root = -1)."""
        return [-1] + [p + 1 for p in self.parents]

    def subtree(self, keep: Sequence[int]) -> TokenTree:
        """The tree restricted to the nodes ``keep`` (closed under parents), reindexed."""
        keep_sorted = sorted(set(keep))
        new_index = {old: new for new, old in enumerate(keep_sorted)}
        out = TokenTree(self.root_token, draws=self.draws)
        for old in keep_sorted:
            parent = self.parents[old]
            if parent != ROOT and parent not in new_index:
                raise ValueError(f"node {old} kept without its parent {parent}")
            out.add(ROOT if parent == ROOT else new_index[parent], self.tokens[old], self.draw_of[old], self.scores[old])
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

    def num_children(self, node: int) -> int:
        """How many children ``node`` (ROOT for the root) has."""
        return sum(1 for p in self.parents if p == node)

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
