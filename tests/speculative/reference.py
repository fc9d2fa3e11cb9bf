"""The oracle of one tree step: a model alone verifies a token tree greedily.

One request, no paging, no batching, no KV cache: each node's token is checked
against the model's argmax after the request's tokens and the node's path, computed
from scratch. Whatever the engine does (paged caches, tree masks, slot moves,
batching, drafting), a greedy tree step must commit exactly these tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedtree.speculative.tree import ROOT


@torch.no_grad()
def reference_tree_step(model, prefix: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The tokens a greedy verification of the tree (``tokens`` with ``parents``, -1 =
    a child of the root, the root being ``prefix[-1]``) commits after ``prefix``: the
    accepted path, then the model's own next token."""
    path = list(prefix)
    node = ROOT
    committed: list[int] = []
    while True:
        best = int(model(torch.tensor([path])).logits[0, -1].argmax())
        committed.append(best)
        children = [i for i, p in enumerate(parents) if p == node and tokens[i] == best]
        if not children:
            return committed
        node = children[0]
        path.append(best)
