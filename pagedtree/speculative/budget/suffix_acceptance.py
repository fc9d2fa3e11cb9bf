"""How likely the suffix drafter's proposals are to be accepted, by how long a suffix
they matched.

A suffix tree's counts say little about its own acceptance: a continuation seen once
in the prompt is a guess after a one-token match (a common word) and a near
certainty after an eight-token one (the model copying the prompt, as edits and
rewrites do). Measured on the Qwen2.5-Coder 1.5B (fixed 12-node suffix trees, 6 edit,
coding and prose chats, 96 tokens each, greedy and t=0.8): a one-token match got
0.2-0.45 tokens accepted a tree in every set, two to four tokens 0.5-3.7, a match of
the longest length (nearly all on edits) 7.2-7.3 of 7.8 proposed (conditional
acceptance 0.92-1.0 at every depth); the counts' own estimate (each level's count
over its total plus one) put every one of them near one token.

``SuffixAcceptance`` keeps an ``AcceptanceTable`` (depth, rank) per request class and
match-length bucket, started from those measurements (``SUFFIX_MATCH_PRIORS``) and
moved by every verified suffix tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedtree.speculative.budget.acceptance import REQUEST_CLASSES, AcceptanceTable
from pagedtree.speculative.tree import ROOT, TokenTree, TreeShape

# Match lengths grouped as the measurements allow: 1, 2, 3-4, 5-7, 8 and longer (the
# drafter's default longest match is 8).
MATCH_BUCKETS = (1, 2, 3, 5, 8)


def match_bucket(length: int) -> int:
    """The bucket (its shortest length) of a match of ``length`` tokens (>= 1)."""
    if length < 1:
        raise ValueError(f"a suffix match has at least one token, not {length}")
    return max(b for b in MATCH_BUCKETS if b <= length)


def _rows(first_ranks: Sequence[float], second: float = 0.5, third: float = 0.25) -> list[list[float]]:
    """Prior rows by depth: the first choice's rate, later ranks a share of it."""
    return [[a, a * second, a * third] for a in first_ranks]


# Conditional acceptance of the first-ranked proposal by depth (rows; the deepest row
# holds for deeper nodes), per match bucket and class, rounded from the measurements in
# the module docstring (benchmarks/RESULTS.md, "Suffix trees priced by their match").
SUFFIX_MATCH_PRIORS: dict[str, dict[int, list[list[float]]]] = {
    "greedy": {1: _rows([0.27, 0.3]), 2: _rows([0.5, 0.55, 0.6]), 3: _rows([0.55, 0.8, 0.75, 0.85]),
               5: _rows([0.75, 0.85, 0.9]), 8: _rows([0.9, 0.95, 0.95])},
    "sampling": {1: _rows([0.25, 0.25]), 2: _rows([0.4, 0.5, 0.6]), 3: _rows([0.5, 0.75, 0.75, 0.85]),
                 5: _rows([0.7, 0.8, 0.9]), 8: _rows([0.9, 0.95, 0.95])},
}


def best_shape(tree: TokenTree, max_nodes: int | None = None) -> TreeShape:
    """The shape of ``tree``'s best ``max_nodes`` nodes by score (all with None,
    ``TokenTree.best_nodes``), siblings ranked by score as the drafter ordered them."""
    order = tree.best_nodes(max_nodes)
    position = {node: i for i, node in enumerate(order)}
    parents: list[int] = []
    ranks: list[int] = []
    siblings: dict[int, int] = {}
    for node in order:
        parent = tree.parents[node]
        shape_parent = ROOT if parent == ROOT else position[parent]
        parents.append(shape_parent)
        ranks.append(siblings.get(shape_parent, 0))
        siblings[shape_parent] = ranks[-1] + 1
    return TreeShape(parents, ranks)


class SuffixAcceptance:
    """Acceptance of suffix-drafted trees per request class and match bucket."""

    def __init__(self, priors: dict[str, dict[int, list[list[float]]]] | None = None):
        priors = priors or SUFFIX_MATCH_PRIORS
        self.tables = {(cls, bucket): AcceptanceTable(priors[cls][bucket])
                       for cls in REQUEST_CLASSES for bucket in MATCH_BUCKETS}

    def table(self, cls: str, match_length: int) -> AcceptanceTable:
        """The table of a class's proposals after a match of ``match_length`` tokens."""
        return self.tables[(cls, match_bucket(match_length))]

    def expected(self, shape: TreeShape, cls: str, match_length: int, scale: float = 1.0) -> float:
        """Expected accepted tokens of a suffix tree of ``shape`` (the bonus token not
        counted), ``scale`` a request's evidence."""
        return self.table(cls, match_length).expected_accepted(shape, scale)
