"""Shared by the attention tests: dense float64 attention and random mixed batches.

A batch is a list of ``(kind, new tokens, prefix length)``; kinds "prefill"/"chunk"/
"decode" are causal, "chain", "star" and "tree" are token trees.
"""

from __future__ import annotations

import math
import random

import torch


def dense_attention(q, k, v, mask, scale):
    """Naive attention in float64: q [Q,H,D], k/v [K,Hkv,D], mask [Q,K] -> [Q,H,D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def random_parents(n: int, rng: random.Random) -> list[int]:
    """A random tree of ``n`` nodes (parents precede children)."""
    return [-1] + [rng.randrange(-1, j) for j in range(1, n)]


def batch_layout(rng: random.Random, block_size: int, num_blocks: int, kinds):
    """``(query_start_loc, context_lens, block_tables, tree_parents)`` for ``kinds``, with
    blocks drawn at random (non-contiguous tables)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    qsl, ctx, tables, parents = [0], [], [], []
    for kind, n, prefix in kinds:
        total = prefix + n
        tables.append([free.pop() for _ in range(-(-total // block_size))])
        ctx.append(total)
        qsl.append(qsl[-1] + n)
        if kind in ("prefill", "chunk", "decode"):
            parents.append(None)
        elif kind == "chain":
            parents.append(list(range(-1, n - 1)))
        elif kind == "star":
            parents.append([-1] + [0] * (n - 1))
        else:
            parents.append(random_parents(n, rng))
    return qsl, ctx, tables, parents


def visibility_mask(n: int, total: int, parents: list[int] | None) -> torch.Tensor:
    """``[n, total]`` bool: the prefix, then causal or ancestors-and-self among the new tokens."""
    prefix = total - n
    mask = torch.zeros(n, total, dtype=torch.bool)
    mask[:, :prefix] = True
    if parents is None:
        mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
    else:
        for j in range(n):  # walk up the tree
            node = j
            while node != -1:
                mask[j, prefix + node] = True
                node = parents[node]
    return mask


def sequence_rows(cache: torch.Tensor, table: list[int], context_len: int, block_size: int) -> torch.Tensor:
    """The cache rows ``[context_len, H_kv, D]`` of one request, in sequence order."""
    pos = torch.arange(context_len)
    slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
    return cache.view(-1, *cache.shape[2:])[slots]
