"""The torch paged attention equals dense attention over the gathered sequence."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedtree.attention import torch_backend as reference
from pagedtree.attention.metadata import AttentionMetadata


def _dense(q, k, v, mask, scale):
    """Naive attention per request: q [Q,H,D], k/v [K,Hkv,D], mask [Q,K]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask[None], -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


def _random_parents(n, rng):
    return [-1] + [rng.randrange(-1, j) for j in range(1, n)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_matches_dense(block_size, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    heads, kv_heads, dim = 4, 2, 16
    num_blocks = 256
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    # A prefill chunk, decodes, a chain, a star, a random tree; ragged prefixes
    # including 0 and exact block boundaries.
    kinds = [("prefill", 70, 0), ("decode", 1, 5), ("decode", 1, block_size * 2),
             ("chain", 6, 3), ("star", 5, block_size), ("tree", 9, 0), ("tree", 17, 11)]
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)  # non-contiguous block tables
    qsl, ctx, tables, parents = [0], [], [], []
    for kind, n, prefix in kinds:
        total = prefix + n
        need = -(-total // block_size)
        tables.append([free_blocks.pop() for _ in range(need)])
        ctx.append(total)
        qsl.append(qsl[-1] + n)
        if kind in ("prefill", "decode"):
            parents.append(None)
        elif kind == "chain":
            parents.append(list(range(-1, n - 1)))
        elif kind == "star":
            parents.append([-1] + [0] * (n - 1))
        else:
            parents.append(_random_parents(n, rng))
    q = torch.randn(qsl[-1], heads, dim)
    slots = torch.zeros(qsl[-1], dtype=torch.long)
    plan = reference.build_reference_plan(AttentionMetadata(block_size, slots, qsl, ctx, tables, parents))
    out = reference.paged_attention(q, k_cache, v_cache, plan, scale=dim**-0.5)
    for i, (kind, n, prefix) in enumerate(kinds):
        pos = torch.arange(ctx[i])
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        k = k_cache.view(-1, kv_heads, dim)[slots]
        v = v_cache.view(-1, kv_heads, dim)[slots]
        mask = torch.zeros(n, ctx[i], dtype=torch.bool)
        mask[:, :prefix] = True
        if parents[i] is None:
            mask[:, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            for j in range(n):  # walk up the tree
                node = j
                while node != -1:
                    mask[j, prefix + node] = True
                    node = parents[i][node]
        expected = _dense(q[qsl[i]:qsl[i + 1]], k, v, mask, dim**-0.5)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expected, atol=1e-4, rtol=1e-4)


def test_store_kv_and_copy_blocks():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(6.0).view(2, 1, 3)
    reference.store_kv(key, -key, k_cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(k_cache[2, 1, 0], key[0, 0]) and torch.equal(v_cache[0, 0, 0], -key[1, 0])
    reference.copy_blocks([(k_cache, v_cache)], torch.tensor([2]), torch.tensor([3]))
    assert torch.equal(k_cache[3], k_cache[2]) and torch.equal(v_cache[3], v_cache[2])


def test_ancestor_mask_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents must precede"):
        reference.ancestor_mask([-1, 2, 0])


def test_plan_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table too short"):
        reference.build_reference_plan(AttentionMetadata(4, torch.zeros(3, dtype=torch.long), [0, 3], [9], [[0]], [None]))
