"""Merging the trees of several draft models into one tree to verify."""

from __future__ import annotations

from collections.abc import Sequence

from pagedtree.spec.tree import ROOT, TokenTree


def merge_trees(trees: Sequence[TokenTree], max_nodes: int, dedupe: bool) -> TokenTree:
    """The union of ``trees`` (same root token), at most ``max_nodes`` nodes.

    With ``dedupe`` (greedy requests, deterministic top-k children) equal token paths
    become one node, and when the union is too large the nodes with the highest
    cumulative draft probability are kept. Without it (randomly drawn children) each
    draft's draws stay separate siblings — verification must see every draw exactly
    as it was made — so the caller must size the drafts' budgets to fit.
    """
    if not trees:
        raise ValueError("merge_trees needs at least one tree")
    root = trees[0].root_token
    out = TokenTree(root)
    child_of: dict[tuple[int, int], int] = {}
    for tree in trees:
        if tree.root_token != root:
            raise ValueError("trees to merge must hang off the same root token")
        draw_offset = len(out.draws)
        out.draws.extend(tree.draws)
        mapping = {ROOT: ROOT}
        for i in range(tree.num_nodes):
            parent = mapping[tree.parents[i]]
            key = (parent, tree.tokens[i])
            existing = child_of.get(key) if dedupe else None
            if existing is not None:
                mapping[i] = existing
                out.scores[existing] = max(out.scores[existing], tree.scores[i])
                continue
            mapping[i] = out.add(parent, tree.tokens[i], draw_offset + tree.draw_of[i], tree.scores[i])
            child_of.setdefault(key, mapping[i])
    if out.num_nodes <= max_nodes:
        return out
    if not dedupe:
        raise ValueError(f"merged tree has {out.num_nodes} nodes > max_nodes {max_nodes} and cannot be pruned")
    scores = out.scores
    keep = sorted(range(out.num_nodes), key=lambda i: (-scores[i], i))[:max_nodes]
    return out.subtree(keep)
