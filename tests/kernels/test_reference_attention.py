"""The torch paged attention equals dense attention over the gathered sequence."""

from __future__ import annotations

import random

import pytest
import torch

from pagedtree.attention import torch_backend as reference
from pagedtree.step_data import AttentionMetadata
from tests.kernels.dense_attention import batch_layout, dense_attention, sequence_rows, visibility_mask


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
    qsl, ctx, tables, parents = batch_layout(rng, block_size, num_blocks, kinds)
    q = torch.randn(qsl[-1], heads, dim)
    slots = torch.zeros(qsl[-1], dtype=torch.long)
    plan = reference.build_reference_plan(AttentionMetadata(block_size, slots, qsl, ctx, tables, parents))
    out = reference.paged_attention(q, k_cache, v_cache, plan, scale=dim**-0.5)
    for i, (kind, n, prefix) in enumerate(kinds):
        k = sequence_rows(k_cache, tables[i], ctx[i], block_size)
        v = sequence_rows(v_cache, tables[i], ctx[i], block_size)
        mask = visibility_mask(n, ctx[i], parents[i])
        expected = dense_attention(q[qsl[i]:qsl[i + 1]], k, v, mask, dim**-0.5).float()
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], expected, atol=1e-4, rtol=1e-4)


def test_store_kv_and_copy_blocks():
    k_cache = torch.zeros(4, 2, 1, 3)
    v_cache = torch.zeros(4, 2, 1, 3)
    key = torch.arange(6.0).view(2, 1, 3)
    reference.store_kv_reference(key, -key, k_cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(k_cache[2, 1, 0], key[0, 0]) and torch.equal(v_cache[0, 0, 0], -key[1, 0])
    reference.copy_blocks([(k_cache, v_cache)], torch.tensor([2]), torch.tensor([3]))
    assert torch.equal(k_cache[3], k_cache[2]) and torch.equal(v_cache[3], v_cache[2])


def test_ancestor_mask_rejects_bad_parents():
    with pytest.raises(ValueError, match="parents must precede"):
        reference.ancestor_mask([-1, 2, 0])


def test_plan_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table too short"):
        reference.build_reference_plan(AttentionMetadata(4, torch.zeros(3, dtype=torch.long), [0, 3], [9], [[0]], [None]))
