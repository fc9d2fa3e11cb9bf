"""The numba CPU kernel (``attention/cpu_backend``) equals dense attention, reads the
cache in place for decodes and trees, and refuses metadata that would read outside it."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("numba")

from pagedtree.attention import make_backend, resolve_backend_name  # noqa: E402
from pagedtree.attention.cpu_backend import CpuPagedAttention, build_cpu_plan, projection_rows  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402
from tests.kernels.dense_attention import batch_layout, dense_attention, sequence_rows, visibility_mask  # noqa: E402


# A long prefill (served by SDPA), short causal chunks, decodes at block boundaries, a
# chain, a star and random trees (the kernel); prefixes longer than one key tile (64).
KINDS = [("prefill", 70, 0), ("chunk", 12, 0), ("chunk", 64, 90), ("decode", 1, 5), ("decode", 1, 32),
         ("decode", 1, 150),
         ("chain", 6, 3), ("star", 5, 16), ("tree", 9, 0), ("tree", 17, 11), ("tree", 64, 70)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 1, 32), (3, 3, 8)])
def test_kernel_matches_dense(dtype, block_size, heads, kv_heads, dim):
    rng = random.Random(block_size * 100 + heads)
    torch.manual_seed(block_size + heads)
    num_blocks = 600 // block_size + 40
    qsl, ctx, tables, parents = batch_layout(rng, block_size, num_blocks, KINDS)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    q = torch.randn(qsl[-1], heads, dim).to(dtype)
    # The new tokens' keys/values are stored by the backend itself: write what is
    # already in their slots, so the cache stays as built.
    slots = []
    for i, (_, n, prefix) in enumerate(KINDS):
        for pos in range(prefix, prefix + n):
            slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots)
    new_k = k_cache.view(-1, kv_heads, dim)[slot_mapping].clone()
    new_v = v_cache.view(-1, kv_heads, dim)[slot_mapping].clone()

    backend = CpuPagedAttention([(k_cache, v_cache)], scale=dim**-0.5)
    backend.begin_step(AttentionMetadata(block_size, slot_mapping, qsl, ctx, tables, parents))
    out = backend(0, q, new_k, new_v)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    for i, (_, n, prefix) in enumerate(KINDS):
        k = sequence_rows(k_cache, tables[i], ctx[i], block_size).float()
        v = sequence_rows(v_cache, tables[i], ctx[i], block_size).float()
        mask = visibility_mask(n, ctx[i], parents[i])
        expected = dense_attention(q[qsl[i]:qsl[i + 1]].float(), k, v, mask, dim**-0.5)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected.to(dtype).double(), atol=tol, rtol=tol)


def test_kernel_equals_torch_backend_on_a_decode_batch():
    """Same answer as the reference backend (fp32 rounding apart) on a plain decode batch."""
    torch.manual_seed(0)
    block_size, kv_heads, heads, dim = 16, 2, 8, 64
    caches = [(torch.randn(64, block_size, kv_heads, dim), torch.randn(64, block_size, kv_heads, dim))]
    tables = [[3, 9, 1], [7], [20, 21]]
    ctx = [40, 16, 17]
    meta = AttentionMetadata(block_size, torch.tensor([39 % 16 + 16, 7 * 16 + 15, 21 * 16]), [0, 1, 2, 3], ctx,
                             tables, [None] * 3)
    meta.slot_mapping = torch.tensor([1 * 16 + 7, 7 * 16 + 15, 21 * 16])
    q, k, v = torch.randn(3, heads, dim), torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    results, stored = [], []
    for name in ("torch", "cpu"):
        copies = [(kc.clone(), vc.clone()) for kc, vc in caches]
        backend = make_backend(name, copies, dim**-0.5)
        backend.begin_step(meta)
        results.append(backend(0, q, k, v))
        stored.append(copies[0])
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    # The kernel stores the new keys and values itself: the caches end up identical.
    assert torch.equal(stored[1][0], stored[0][0]) and torch.equal(stored[1][1], stored[0][1])
    assert not torch.equal(stored[1][0], caches[0][0])


def _projection_step(dtype: torch.dtype, heads: int = 6, kv_heads: int = 1, dim: int = 32):
    """A decode row and a 5-node tree over paged caches, with the step's queries, keys and
    values as views of one q/k/v projection output (as the fused forwards pass them)."""
    torch.manual_seed(3)
    block_size = 4
    k_cache = torch.randn(24, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(24, block_size, kv_heads, dim).to(dtype)
    tables, ctx, parents, qsl = [[2, 5, 7], [9, 1, 3, 4]], [10, 14], [None, [-1, 0, 0, 1, 2]], [0, 1, 6]
    slots = [7 * 4 + 1] + [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 4 * 4, 4 * 4 + 1]
    meta = AttentionMetadata(block_size, torch.tensor(slots), qsl, ctx, tables, parents)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return (k_cache, v_cache), meta, qkv, (q.view(6, heads, dim), k.view(6, kv_heads, dim), v.view(6, kv_heads, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_views_are_read_in_place_with_the_same_answer_as_copies(dtype):
    caches, meta, qkv, (q, k, v) = _projection_step(dtype)
    assert projection_rows(q, k, v, dtype).data_ptr() == qkv.data_ptr()  # no copy
    outs = []
    for args in ((q, k, v), (q.clone(), k.clone(), v.clone())):  # views, then separate tensors
        copies = [(caches[0].clone(), caches[1].clone())]
        backend = CpuPagedAttention(copies, scale=q.shape[-1] ** -0.5)
        backend.begin_step(meta)
        outs.append((backend(0, *args), copies[0]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1][0], outs[1][1][0]) and torch.equal(outs[0][1][1], outs[1][1][1])


def test_bf16_output_is_the_fp32_result_rounded_as_torch_rounds():
    """Widening bf16 is exact, so a bf16 cache and queries give the kernel the same fp32
    arithmetic as fp32 copies of them: its bf16 output must be that fp32 output rounded
    by ``Tensor.to(torch.bfloat16)`` (nearest even), bit for bit."""
    caches, meta, _, (q, k, v) = _projection_step(torch.bfloat16)
    outs = []
    for cast in (lambda t: t, lambda t: t.float()):
        backend = CpuPagedAttention([(cast(caches[0]).clone(), cast(caches[1]).clone())], scale=q.shape[-1] ** -0.5)
        backend.begin_step(meta)
        outs.append(backend(0, cast(q), cast(k), cast(v)))
    assert outs[0].dtype == torch.bfloat16 and outs[1].dtype == torch.float32
    assert torch.equal(outs[0], outs[1].to(torch.bfloat16))


@pytest.mark.parametrize("bad", ["block_out_of_range", "negative_block", "table_too_short", "context_short",
                                 "parents_after_child", "parents_length", "slot_out_of_range", "negative_slot",
                                 "slot_count"])
def test_bad_metadata_is_refused_before_any_read(bad):
    block_size = 4
    tables, ctx, parents, qsl = [[0, 1]], [6], [[-1, 0]], [0, 2]
    if bad == "block_out_of_range":
        tables = [[0, 8]]
    elif bad == "negative_block":
        tables = [[-1, 0]]
    elif bad == "table_too_short":
        tables = [[0]]
    elif bad == "context_short":
        ctx = [1]
    elif bad == "parents_after_child":
        parents = [[1, -1]]
    elif bad == "parents_length":
        parents = [[-1]]
    slots = torch.tensor([4, 5])
    if bad == "slot_out_of_range":
        slots = torch.tensor([4, 8 * block_size])
    elif bad == "negative_slot":
        slots = torch.tensor([-1, 5])
    elif bad == "slot_count":
        slots = torch.tensor([4])
    meta = AttentionMetadata(block_size, slots, qsl, ctx, tables, parents)
    with pytest.raises(ValueError):
        build_cpu_plan(meta, num_blocks=8)


def test_auto_picks_the_kernel_for_fp32_and_bf16_cpu_caches():
    cpu = torch.device("cpu")
    assert resolve_backend_name("auto", cpu, torch.float32) == "cpu"
    assert resolve_backend_name("auto", cpu, torch.bfloat16) == "cpu"
    assert resolve_backend_name("auto", cpu, torch.float16) == "torch"
    with pytest.raises(ValueError, match="fp32 or bf16"):
        resolve_backend_name("cpu", cpu, torch.float16)


def _write_rows(cache: torch.Tensor, table: list[int], rows: torch.Tensor, block_size: int) -> None:
    for position, row in enumerate(rows):
        cache[table[position // block_size], position % block_size] = row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [101, 120], ids=["tree-in-one-key-tile", "tree-across-key-tiles"])
def test_a_tree_node_gets_the_bits_of_its_path_decoded_plainly(dtype, prefix):
    """Greedy tree verification gives plain decoding's tokens only if a node's
    attention has the bits its path gets decoded as one sequence. In the tree the
    path's keys sit among other branches' keys (masked, weighing 0), in other places
    of a key tile than in the plain sequence: the kernel adds a row's weights in key
    order, so the zeros change nothing."""
    torch.manual_seed(5)
    block_size, kv_heads, heads, dim = 4, 2, 6, 32
    parents = [-1, 0, 0, 1, 1, 2, 4, 4, 6, 3, 8, 9, 10, 12, 13, 11]  # the root and 15 nodes
    size = len(parents)
    keys = torch.randn(prefix + size, kv_heads, dim).to(dtype)
    values = torch.randn(prefix + size, kv_heads, dim).to(dtype)
    queries = torch.randn(size, heads, dim).to(dtype)
    per_sequence = -(-(prefix + size) // block_size)
    num_blocks = per_sequence * (size + 1)
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    backend = CpuPagedAttention([(k_cache, v_cache)], scale=dim**-0.5)
    # The tree: the prefix, then the root and its nodes, one verify chunk.
    tree_table = list(range(per_sequence))
    _write_rows(k_cache, tree_table, keys, block_size)
    _write_rows(v_cache, tree_table, values, block_size)
    slots = [tree_table[p // block_size] * block_size + p % block_size for p in range(prefix, prefix + size)]
    backend.begin_step(AttentionMetadata(block_size, torch.tensor(slots), [0, size], [prefix + size], [tree_table],
                                         [parents]))
    tree_out = backend(0, queries, keys[prefix:], values[prefix:])
    # Every node as a plain decode: the prefix, then its path from the root.
    tables, contexts, slots, starts = [], [], [], [0]
    for node in range(size):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        rows = torch.cat([torch.arange(prefix), prefix + torch.tensor(path[::-1])])
        table = list(range(per_sequence * (node + 1), per_sequence * (node + 2)))
        _write_rows(k_cache, table, keys[rows], block_size)
        _write_rows(v_cache, table, values[rows], block_size)
        tables.append(table)
        contexts.append(len(rows))
        slots.append(table[(len(rows) - 1) // block_size] * block_size + (len(rows) - 1) % block_size)
        starts.append(node + 1)
    backend.begin_step(AttentionMetadata(block_size, torch.tensor(slots), starts, contexts, tables, [None] * size))
    plain_out = backend(0, queries, keys[prefix:], values[prefix:])
    assert torch.equal(tree_out, plain_out)
