"""Triton kernels over the paged KV cache: store, unified attention, row copies.

Raises ImportError at import when Triton is not installed. On a machine without a
GPU the kernels run in Triton's interpreter, which must be switched on with
``TRITON_INTERPRET=1`` *before* this module is imported (``@triton.jit`` decides at
definition time); :data:`INTERPRETED` records what happened.

Rules every kernel here follows, because the interpreter corrupts memory silently
on out-of-bounds accesses and a GPU reads garbage: every load and store is masked,
every index was range-checked on the host, offsets that can exceed 2**31 elements
are int64, and arithmetic happens in fp32 (bf16 arithmetic is wrong inside the
interpreter; values are converted after loading and before storing).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # the class moved between Triton releases; only its presence matters here
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - very old or very new Triton
    _InterpretedFunction = ()


@triton.jit
def _cast(x, DTYPE: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """``x`` converted to ``DTYPE`` through fp32, rounding to nearest even.

    The interpreter truncates fp32 -> bf16 (and mishandles fp16 -> bf16), where a
    GPU rounds; with ``MANUAL_BF16`` the rounding is done on the bits instead.
    """
    x = x.to(tl.float32)
    if DTYPE == tl.bfloat16 and MANUAL_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    """One program per new token: its ``[H_kv, D]`` keys and values into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :] & (slot >= 0)
    cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    cache_off = cache_off + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + cache_off, _cast(k, cache_ty, MANUAL_BF16), mask=mask)
    tl.store(v_cache_ptr + cache_off, _cast(v, cache_ty, MANUAL_BF16), mask=mask)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, start, kv_end, prefix, req, kv_head,
    tok, q_idx, row_valid, is_tree,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr,
    stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    tree_words, scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
):
    """Online-softmax update of one query tile with keys ``start .. start + TILE_N``.

    Keys are gathered one by one through the block table, so a tile may span
    several blocks or part of one: any block size works. ``MASKED`` tiles reach
    into the request's new tokens and apply the causal or tree mask; tiles wholly
    inside the prefix are visible to every query.
    """
    pos = start + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_P)
    key_valid = pos < kv_end
    blk = tl.load(block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    off = (pos % BLOCK_SIZE).to(tl.int64)
    kv_mask = key_valid[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(
        k_cache_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
        mask=kv_mask, other=0.0,
    )
    v = tl.load(
        v_cache_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
        mask=kv_mask, other=0.0,
    )
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if MASKED:
        causal = pos[None, :] <= (prefix + q_idx)[:, None]
        rel = tl.maximum(pos - prefix, 0)
        in_new = (pos >= prefix) & key_valid
        word = tl.load(
            tree_mask_ptr + tok[:, None] * tree_words + (rel // 32)[None, :],
            mask=row_valid[:, None] & in_new[None, :] & (is_tree != 0), other=0,
        )
        ancestor = ((word >> (rel % 32)[None, :]) & 1) != 0
        in_tree = (pos < prefix)[None, :] | ancestor
        allowed = tl.where(is_tree != 0, in_tree, causal) & key_valid[None, :]
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen no visible key yet (padding rows) keep m = -inf; shifting
    # by 0 instead keeps exp2 away from (-inf) - (-inf) = nan.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_ptr, context_lens_ptr, is_tree_ptr, tree_mask_ptr,
    tile_req_ptr, tile_q_ptr, part_acc_ptr, part_ml_ptr,
    scale_log2, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, tree_words,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    """Paged attention for a whole mixed batch in one launch.

    Grid ``(num_tiles, num_kv_heads, NUM_SPLITS)``. A program takes ``BLOCK_Q``
    consecutive new tokens of one request and all ``GROUP`` query heads that share
    one KV head (``BLOCK_M`` rows, token-major), and walks that request's keys up
    to its last query of the tile. Keys before the request's prefix end are seen by
    everyone; among the new tokens the mask is causal, or ancestors-only for a tree
    request. With ``NUM_SPLITS > 1`` each program takes one segment of the keys and
    writes unnormalised partial results for :func:`_reduce_splits_kernel`.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    if req < 0:  # padding tile (a captured grid larger than this step)
        return
    q_tile_start = tl.load(tile_q_ptr + tile)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    ctx = tl.load(context_lens_ptr + req)
    is_tree = tl.load(is_tree_ptr + req)
    prefix = ctx - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + rows // GROUP_P
    head_in_group = rows % GROUP_P
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    tok = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_P)
    q_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile needs: the prefix and the new tokens up to its last query
    # (tree parents precede their children, so a tree needs no more than causal).
    kv_end = prefix + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE_N), NUM_SPLITS)
    seg_start = split * tiles_per_split * TILE_N
    seg_end = tl.minimum(seg_start + tiles_per_split * TILE_N, kv_end)
    unmasked_end = (prefix // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for start in range(seg_start, tl.minimum(seg_end, unmasked_end), TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, kv_end, prefix, req, kv_head, tok, q_idx, row_valid, is_tree,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr,
            stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            tree_words, scale_log2, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, DOT_FP32, False,
        )
    for start in range(tl.maximum(seg_start, unmasked_end), seg_end, TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, start, kv_end, prefix, req, kv_head, tok, q_idx, row_valid, is_tree,
            k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr,
            stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            tree_words, scale_log2, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, DOT_FP32, True,
        )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            _cast(out, out_ptr.dtype.element_ty, MANUAL_BF16), mask=q_mask,
        )
    else:
        part_row = (split * num_tokens + tok) * num_heads + head  # [BLOCK_M] int64
        # All HEAD_DIM_P columns (padding ones are 0) so the reduce reads no unwritten memory.
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, num_tokens, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, MANUAL_BF16: tl.constexpr,
):
    """One program per (token, head): merge the split-KV partial softmax results."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    s_mask = splits < NUM_SPLITS
    row = (splits * num_tokens + t) * num_heads + h
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty segments weigh 0
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + dims[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(l * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, _cast(out, out_ptr.dtype.element_ty, MANUAL_BF16), mask=dims < HEAD_DIM)


@triton.jit
def _copy_rows_kernel(
    src_table_ptr, dst_table_ptr, src_idx_ptr, dst_idx_ptr, row_elems,
    DTYPE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Copy row ``src_idx[i]`` to row ``dst_idx[i]`` in every tensor of a pointer table.

    Grid ``(num_pairs, num_tensors, cdiv(row_elems, BLOCK_E))``. The tables hold
    one base address per tensor (every layer's key and value cache), so all layers
    are copied in one launch.
    """
    pair = tl.program_id(0)
    which = tl.program_id(1)
    chunk = tl.program_id(2)
    src_base = tl.load(src_table_ptr + which).to(tl.pointer_type(DTYPE))
    dst_base = tl.load(dst_table_ptr + which).to(tl.pointer_type(DTYPE))
    s = tl.load(src_idx_ptr + pair).to(tl.int64)
    d = tl.load(dst_idx_ptr + pair).to(tl.int64)
    e = chunk.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = e < row_elems
    x = tl.load(src_base + s * row_elems + e, mask=mask)
    tl.store(dst_base + d * row_elems + e, x, mask=mask)


INTERPRETED: bool = bool(_InterpretedFunction) and isinstance(_unified_attention_kernel, _InterpretedFunction)
"""True when the kernels were defined under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
