"""Sequoia-style optimal static tree shapes from measured per-rank acceptance rates.

``acceptance_rates[r]`` is the probability that the draft's rank-``r`` child is
accepted given that ranks ``0..r-1`` were rejected (what the verifier measures).
Under Sequoia's position-independence assumption a node's chance to be reached is
the product, along its path, of the marginal rate of its rank, and the expected
number of accepted draft tokens of a tree is the sum of those chances over its
nodes. The best tree of ``n`` nodes is found by dynamic programming over
(depth budget, node budget), with each node's children taking consecutive ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from pagedtree.speculative.tree import ROOT, TreeShape


def marginal_rank_rates(acceptance_rates: Sequence[float]) -> list[float]:
    """P(rank r is the accepted child) from the conditional per-rank rates."""
    out = []
    none_before = 1.0
    for a in acceptance_rates:
        out.append(none_before * a)
        none_before *= 1.0 - a
    return out


def expected_under_rates(shape: TreeShape, acceptance_rates: Sequence[float]) -> float:
    """Expected accepted draft tokens of ``shape`` (not counting the bonus token)."""
    marginal = marginal_rank_rates(acceptance_rates)
    reach = [0.0] * shape.num_nodes
    for i, (p, r) in enumerate(zip(shape.parents, shape.ranks)):
        rate = marginal[r] if r < len(marginal) else 0.0
        reach[i] = rate * (1.0 if p == ROOT else reach[p])
    return float(sum(reach))


def optimal_shape(acceptance_rates: Sequence[float], max_nodes: int, max_depth: int) -> TreeShape:
    """The shape of at most ``max_nodes`` nodes and ``max_depth`` levels maximising
    ``expected_under_rates`` (ties go to the smaller tree)."""
    marginal = np.asarray(marginal_rank_rates(acceptance_rates), dtype=np.float64)
    num_ranks = len(marginal)
    if max_nodes < 1 or max_depth < 1 or num_ranks == 0:
        return TreeShape([], [])

    @lru_cache(maxsize=None)
    def value(depth: int) -> np.ndarray:
        """value(d)[n] = best sum of reach over a subtree of at most n nodes (root
        included, counted as 1) whose children go at most d levels deeper."""
        v = np.zeros(max_nodes + 2)
        v[1:] = 1.0
        if depth == 0:
            return v
        v[1:] = 1.0 + children_value(depth)[0][: max_nodes + 1]
        return v

    @lru_cache(maxsize=None)
    def children_value(depth: int) -> list[np.ndarray]:
        """g[r][b]: best value of children with ranks >= r using at most b nodes."""
        child = value(depth - 1)
        g = [np.zeros(max_nodes + 1) for _ in range(num_ranks + 1)]
        for r in range(num_ranks - 1, -1, -1):
            nxt = g[r + 1]
            cur = np.zeros(max_nodes + 1)
            for b in range(1, max_nodes + 1):
                s = np.arange(1, b + 1)
                options = marginal[r] * child[s] + nxt[b - s]
                cur[b] = max(0.0, float(options.max()))
            g[r] = cur
        return g

    parents: list[int] = []
    ranks: list[int] = []
    # Rebuild breadth-first: a queue of (node index, depth budget, node budget).
    queue = [(ROOT, max_depth, max_nodes + 1)]
    while queue:
        node, depth, budget = queue.pop(0)
        if depth == 0 or budget <= 1:
            continue
        g = children_value(depth)
        child = value(depth - 1)
        remaining = budget - 1
        for r in range(num_ranks):
            if remaining <= 0 or g[r][remaining] <= 1e-15:
                break
            # The smallest subtree size that attains the optimum for this rank.
            s = np.arange(1, remaining + 1)
            options = marginal[r] * child[s] + g[r + 1][remaining - s]
            best = float(options.max())
            if best <= 1e-15:
                break
            size = int(np.flatnonzero(options >= best - 1e-12)[0]) + 1
            parents.append(node)
            ranks.append(r)
            queue.append((len(parents) - 1, depth - 1, size))
            remaining -= size
    return _breadth_first(TreeShape(parents, ranks))


def _breadth_first(shape: TreeShape) -> TreeShape:
    """Renumber so that parents precede children level by level, siblings by rank."""
    order: list[int] = []
    frontier = [ROOT]
    while frontier:
        nxt = []
        for node in frontier:
            kids = sorted((i for i, p in enumerate(shape.parents) if p == node), key=lambda i: shape.ranks[i])
            order.extend(kids)
            nxt.extend(kids)
        frontier = nxt
    index = {old: new for new, old in enumerate(order)}
    return TreeShape(
        [ROOT if shape.parents[o] == ROOT else index[shape.parents[o]] for o in order],
        [shape.ranks[o] for o in order],
    )
