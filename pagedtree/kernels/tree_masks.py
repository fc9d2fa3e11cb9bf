"""Token-tree masks as ancestor bitmasks.

Token ``j`` of a tree request owns ``tree_words`` int32 words whose bit ``k`` is set
when node ``k`` is ``j`` or one of its ancestors; any tree size works
(``tree_words = ceil(T / 32)``). The attention kernels test a key against its
query's words. ``ancestor_matrix`` is the same relation as a boolean matrix, for
the reference attention and FlashInfer's custom masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def tree_ancestor_words(parents: Sequence[int], num_words: int) -> list[list[int]]:
    """Per node, ``num_words`` int32 words of its ancestor bitmask (self included)."""
    masks: list[int] = []
    for j, p in enumerate(parents):
        if p >= j or p < -1:
            raise ValueError(f"tree node {j} has parent {p}: parents must precede children")
        masks.append((masks[p] if p >= 0 else 0) | (1 << j))
    rows = []
    for m in masks:
        words = []
        for w in range(num_words):
            v = (m >> (32 * w)) & 0xFFFFFFFF
            words.append(v - (1 << 32) if v >= 1 << 31 else v)  # as signed int32
        rows.append(words)
    return rows


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """``[T, T]`` bool: entry ``[j, k]`` is True when node ``k`` is ``j`` or one of its
    ancestors (``parents[j]``: the parent's index among the nodes, -1 for a node
    attached to the prefix; parents precede their children)."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for j, p in enumerate(parents):
        if p >= j or p < -1:
            raise ValueError(f"tree node {j} has parent {p}: parents must precede children")
        if p >= 0:
            mask[j] = mask[p]
        mask[j, j] = True
    return mask
