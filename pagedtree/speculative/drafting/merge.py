"""Merging the trees of several draft models into one tree to verify."""

from __future__ import annotations

from collections.abc import Sequence

from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree


def merge_trees(trees: Sequence[TokenTree], max_nodes: int, preferred: int = 0) -> TokenTree:
    """The union of ``trees`` (same root token), with equal token paths as one node.

    Every draw is kept, after the draws of the trees before it, so a node proposed by
    several drafts is verified once per proposal, each against its own draft's
    distribution (SpecInfer's multi-step speculative sampling over merged trees).

    When the union has more than ``max_nodes`` nodes, the nodes with the highest
    cumulative draft log-probability are kept (a child never outscores its parent,
    so the kept set is closed under parents); the nodes of the first ``preferred``
    trees are kept before any other's (a draft model's tree, which the budget priced,
    stays whole, and the suffix drafter's proposals fill the nodes left: scored by
    counts, a continuation seen a few times outranks the deeper nodes of a confident
    chain, and let in first they cut it short). Only deterministic proposals can be
    pruned; trees of random draws must be sized by the caller so that their union
    fits (their node counts add up to at most ``max_nodes``), and a ``ValueError``
    says so otherwise.
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].root_token
    out = TokenTree(root)
    preferred_nodes: set[int] = set()
    for position, tree in enumerate(trees):
        if tree.root_token != root:
            raise ValueError("trees to merge must hang off the same root token")
        mapping = {ROOT: ROOT}
        for i in range(tree.num_nodes):
            mapping[i] = out.add(mapping[tree.parents[i]], tree.tokens[i], tree.scores[i])
            if position < preferred:
                preferred_nodes.add(mapping[i])
        for draw in tree.draws:
            out.draws.append(ChildDraw(draw.rule, mapping[draw.parent], list(draw.tokens), draw.probs))
    if out.num_nodes <= max_nodes:
        return out
    if not out.deterministic:
        raise ValueError(
            f"merged tree of random draws has {out.num_nodes} nodes > max_nodes {max_nodes}; "
            "random draws cannot be pruned, so each draft's share of the budget must fit"
        )
    scores = out.scores
    # A preferred node's parent is preferred and scores at least as high; an index
    # breaks ties parent first (parents are added before their children).
    keep = sorted(range(out.num_nodes), key=lambda i: (i not in preferred_nodes, -scores[i], i))[:max_nodes]
    return out.subtree(keep)
