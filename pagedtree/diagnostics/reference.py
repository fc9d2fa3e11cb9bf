"""Dense attention over a paged KV cache in float64: what the kernels are held to.

Each request's keys and values are gathered from the cache through its block table
into sequence order, every query sees the request's prefix and, among its new
tokens, either the earlier ones (causal) or, in a token tree, its ancestors and
itself; the softmax and the weighted sum run in float64 on the inputs as given
(16-bit values are exact in float64), so any difference is the kernel's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def visibility_mask(num_new: int, context_len: int, parents: Sequence[int] | None) -> torch.Tensor:
    """``[num_new, context_len]`` bool: the prefix, then causal (``parents`` None) or
    ancestors-and-self among the new tokens (``parents[j]`` precedes ``j``; -1 = none)."""
    prefix = context_len - num_new
    mask = torch.zeros(num_new, context_len, dtype=torch.bool)
    mask[:, :prefix] = True
    if parents is None:
        mask[:, prefix:] = torch.ones(num_new, num_new, dtype=torch.bool).tril()
        return mask
    for j, parent in enumerate(parents):
        if parent >= j or parent < -1:
            raise ValueError(f"tree node {j} has parent {parent}: parents must precede children")
        if parent >= 0:
            mask[j, prefix:] = mask[parent, prefix:]
        mask[j, prefix + j] = True
    return mask


def sequence_rows(cache: torch.Tensor, table: Sequence[int], context_len: int) -> torch.Tensor:
    """The rows ``[context_len, H_kv, D]`` of one request, in sequence order, from a
    ``[num_blocks, block_size, H_kv, D]`` cache."""
    block_size = cache.shape[1]
    pos = torch.arange(context_len, device=cache.device)
    blocks = torch.tensor(list(table), dtype=torch.long, device=cache.device)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    return cache.reshape(-1, *cache.shape[2:])[slots]


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Attention in float64: ``query [Q, H, D]``, ``keys``/``values [K, H_kv, D]``,
    ``mask [Q, K]`` (True = visible) -> ``[Q, H, D]`` float64."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    scores = scores.masked_fill(~mask.to(scores.device)[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: Sequence[int], context_lens: Sequence[int],
                    block_tables: Sequence[Sequence[int]], tree_parents: Sequence[Sequence[int] | None],
                    scale: float) -> torch.Tensor:
    """Every request's attention over its paged context, float64 ``[T, H, D]``, in the
    layout the kernels use (a flat run of new tokens, request after request)."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    for i, context_len in enumerate(context_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end == start:
            continue
        keys = sequence_rows(key_cache, block_tables[i], context_len)
        values = sequence_rows(value_cache, block_tables[i], context_len)
        mask = visibility_mask(end - start, context_len, tree_parents[i])
        out[start:end] = dense_attention(query[start:end], keys, values, mask, scale)
    return out
