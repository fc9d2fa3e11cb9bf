"""Proposals a grammar makes for free: the tokens it forces, and pruning the ones it forbids.

Under a constraint the next characters are sometimes certain: a schema's object
opens with ``{"name": "`` whatever the model thinks. ``forced_chain`` proposes those
tokens (the grammar's jump-forward string, tokenized) as a chain that costs no draft
pass, only verify rows; the target still verifies them, under its mask, so the
output stays exactly what plain constrained decoding gives (a model that would
have tokenized the span otherwise simply rejects the chain). ``prune_to_grammar``
drops the deterministic proposals of other sources (the suffix drafter's) that the
grammar forbids, which could never be accepted.
"""

from __future__ import annotations

from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree
from pagedtree.structured.matcher import RequestGrammar


def forced_chain(grammar: RequestGrammar, root_token: int, max_nodes: int) -> TokenTree | None:
    """The chain of tokens the grammar forces after the committed end (at most
    ``max_nodes``), as a tree of deterministic proposals; None when nothing is forced."""
    tokens = grammar.forced_tokens(max_nodes)
    if not tokens:
        return None
    tree = TokenTree(root_token)
    parent = ROOT
    for token in tokens:
        # Score 0 (probability 1): when trees are merged and pruned, forced tokens stay.
        node = tree.add(parent, token, 0.0)
        tree.draws.append(ChildDraw("topk", parent, [token]))
        parent = node
    return tree


def prune_to_grammar(tree: TokenTree, grammar: RequestGrammar) -> TokenTree:
    """``tree`` without the nodes on paths the grammar rejects (deterministic trees
    only: a random draw cannot be pruned without biasing its siblings)."""
    if not tree.deterministic or not tree.num_nodes:
        return tree
    keep = []
    paths: list[tuple[int, ...]] = []
    alive: list[bool] = []
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        path = (paths[parent] if parent != ROOT else ()) + (token,)
        paths.append(path)
        ok = (parent == ROOT or alive[parent]) and grammar.bitmask_after(path) is not None
        alive.append(ok)
        if ok:
            keep.append(node)
    return tree if len(keep) == tree.num_nodes else tree.subtree(keep)
