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
def _load_kv_tile(
    start, kv_end, req, kv_head, block_tables_ptr, k_cache_ptr, v_cache_ptr, kv_loads_ptr,
    stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_ALIGNED: tl.constexpr, COUNT_LOADS: tl.constexpr,
):
    """Keys and values ``start .. start + TILE_N`` of a request's KV head.

    ``BLOCK_ALIGNED`` tiles lie inside one cache block (``BLOCK_SIZE`` a multiple of
    ``TILE_N``, ``start`` a multiple of ``TILE_N``): one block id, then regular loads
    the compiler can pipeline. Otherwise keys are gathered one by one through the
    block table, so any block size works.
    """
    pos = start + tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_P)
    key_valid = pos < kv_end
    kv_mask = key_valid[:, None] & (dims < HEAD_DIM)[None, :]
    if BLOCK_ALIGNED:
        blk = tl.load(block_tables_ptr + req * stride_bt + start // BLOCK_SIZE).to(tl.int64)
        off = (start % BLOCK_SIZE + tl.arange(0, TILE_N)).to(tl.int64)
        k_rows = k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh
        v_rows = v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh
    else:
        blk = tl.load(block_tables_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        off = (pos % BLOCK_SIZE).to(tl.int64)
        k_rows = k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh
        v_rows = v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh
    k = tl.load(k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if COUNT_LOADS:  # tests count K/V tile loads per request
        tl.atomic_add(kv_loads_ptr + req, 1)
    return k, v, pos, key_valid


@triton.jit
def _attend_rows(
    acc, m_i, l_i, q, k, v, pos, key_valid, prefix, tok, q_idx, row_valid, is_tree,
    tree_mask_ptr, tree_words, scale_log2, DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
):
    """Online-softmax update of one query sub-tile with one K/V tile.

    ``MASKED`` tiles reach into the request's new tokens and apply the causal or
    tree mask; tiles wholly inside the prefix are visible to every query.
    """
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
def _sub_tile_rows(q_ptr, q_begin, q_len, q_start, kv_head, stride_qt, stride_qh,
                   GROUP: tl.constexpr, GROUP_P: tl.constexpr, SUB_M: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, DOT_FP32: tl.constexpr):
    """A query sub-tile from query ``q_start`` on: ``SUB_M`` rows, token-major, each
    token with the ``GROUP`` query heads of the KV head. Returns its queries, the
    rows' query indices, validity, token ids and heads."""
    rows = tl.arange(0, SUB_M)
    q_idx = q_start + rows // GROUP_P
    head_in_group = rows % GROUP_P
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    tok = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_P)
    q_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q, q_idx, row_valid, tok, head


@triton.jit
def _finish_rows(acc, m_i, l_i, split, tok, head, row_valid, out_ptr, part_acc_ptr, part_ml_ptr,
                 num_tokens, num_heads, stride_ot, stride_oh,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 MANUAL_BF16: tl.constexpr):
    """Write a sub-tile's output (or, with split-KV, its unnormalised partials)."""
    dims = tl.arange(0, HEAD_DIM_P)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            _cast(out, out_ptr.dtype.element_ty, MANUAL_BF16), mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :],
        )
    else:
        part_row = (split * num_tokens + tok) * num_heads + head  # [SUB_M] int64
        # All HEAD_DIM_P columns (padding ones are 0) so the reduce reads no unwritten memory.
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _attend_kv_tile(
    start, kv_end, prefix, req, kv_head, is_tree,
    acc0, m0, l0, acc1, m1, l1, acc2, m2, l2, acc3, m3, l3,
    q0, q1, q2, q3, qi0, qi1, qi2, qi3, ok0, ok1, ok2, ok3, tok0, tok1, tok2, tok3,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr, kv_loads_ptr,
    stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, tree_words, scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_ALIGNED: tl.constexpr, COUNT_LOADS: tl.constexpr, NUM_SUB: tl.constexpr,
    DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
):
    """One K/V tile, loaded once, against every query sub-tile of the program."""
    k, v, pos, key_valid = _load_kv_tile(
        start, kv_end, req, kv_head, block_tables_ptr, k_cache_ptr, v_cache_ptr, kv_loads_ptr,
        stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, BLOCK_ALIGNED, COUNT_LOADS,
    )
    acc0, m0, l0 = _attend_rows(acc0, m0, l0, q0, k, v, pos, key_valid, prefix, tok0, qi0, ok0, is_tree,
                                tree_mask_ptr, tree_words, scale_log2, DOT_FP32, MASKED)
    if NUM_SUB > 1:
        acc1, m1, l1 = _attend_rows(acc1, m1, l1, q1, k, v, pos, key_valid, prefix, tok1, qi1, ok1, is_tree,
                                    tree_mask_ptr, tree_words, scale_log2, DOT_FP32, MASKED)
    if NUM_SUB > 2:
        acc2, m2, l2 = _attend_rows(acc2, m2, l2, q2, k, v, pos, key_valid, prefix, tok2, qi2, ok2, is_tree,
                                    tree_mask_ptr, tree_words, scale_log2, DOT_FP32, MASKED)
        acc3, m3, l3 = _attend_rows(acc3, m3, l3, q3, k, v, pos, key_valid, prefix, tok3, qi3, ok3, is_tree,
                                    tree_mask_ptr, tree_words, scale_log2, DOT_FP32, MASKED)
    return acc0, m0, l0, acc1, m1, l1, acc2, m2, l2, acc3, m3, l3


# Integers that change from step to step are not specialised on (Triton would
# otherwise compile a variant for 1, for multiples of 16 and for the rest, and a
# server would recompile mid-run); the others are fixed per model and cache.
@triton.jit(do_not_specialize=["num_tokens", "stride_bt", "tree_words"])
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_ptr, context_lens_ptr, is_tree_ptr, tree_mask_ptr,
    tile_req_ptr, tile_q_ptr, part_acc_ptr, part_ml_ptr, kv_loads_ptr,
    scale_log2, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, tree_words,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, MANUAL_BF16: tl.constexpr,
    COUNT_LOADS: tl.constexpr,
):
    """Paged attention for a whole mixed batch in one launch.

    Grid ``(num_tiles, num_kv_heads, NUM_SPLITS)``. A program takes ``BLOCK_Q``
    consecutive new tokens of one request and all ``GROUP`` query heads that share
    one KV head, as ``NUM_SUB`` (1, 2 or 4) query sub-tiles of ``BLOCK_Q / NUM_SUB``
    tokens; it walks that request's keys up to its last query, and every K/V tile
    it loads serves all of its sub-tiles. A token tree whose nodes fit one program
    thus reads its KV prefix once, as a decode does. Keys before the request's
    prefix end are seen by everyone; among the new tokens the mask is causal, or
    ancestors-only for a tree request. With ``NUM_SPLITS > 1`` each program takes
    one segment of the keys and writes unnormalised partial results for
    :func:`_reduce_splits_kernel`.
    """
    SUB_Q: tl.constexpr = BLOCK_Q // NUM_SUB
    SUB_M: tl.constexpr = SUB_Q * GROUP_P
    BLOCK_ALIGNED: tl.constexpr = BLOCK_SIZE % TILE_N == 0
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

    # Sub-tiles the program does not have (NUM_SUB < 4) repeat sub-tile 0's values;
    # they are never updated or written.
    q0, qi0, ok0, tok0, head0 = _sub_tile_rows(q_ptr, q_begin, q_len, q_tile_start, kv_head, stride_qt, stride_qh,
                                               GROUP, GROUP_P, SUB_M, HEAD_DIM, HEAD_DIM_P, DOT_FP32)
    q1, qi1, ok1, tok1, head1 = q0, qi0, ok0, tok0, head0
    q2, qi2, ok2, tok2, head2 = q0, qi0, ok0, tok0, head0
    q3, qi3, ok3, tok3, head3 = q0, qi0, ok0, tok0, head0
    if NUM_SUB > 1:
        q1, qi1, ok1, tok1, head1 = _sub_tile_rows(q_ptr, q_begin, q_len, q_tile_start + SUB_Q, kv_head, stride_qt,
                                                   stride_qh, GROUP, GROUP_P, SUB_M, HEAD_DIM, HEAD_DIM_P, DOT_FP32)
    if NUM_SUB > 2:
        q2, qi2, ok2, tok2, head2 = _sub_tile_rows(q_ptr, q_begin, q_len, q_tile_start + 2 * SUB_Q, kv_head,
                                                   stride_qt, stride_qh, GROUP, GROUP_P, SUB_M, HEAD_DIM,
                                                   HEAD_DIM_P, DOT_FP32)
        q3, qi3, ok3, tok3, head3 = _sub_tile_rows(q_ptr, q_begin, q_len, q_tile_start + 3 * SUB_Q, kv_head,
                                                   stride_qt, stride_qh, GROUP, GROUP_P, SUB_M, HEAD_DIM,
                                                   HEAD_DIM_P, DOT_FP32)

    # Keys this tile needs: the prefix and the new tokens up to its last query
    # (tree parents precede their children, so a tree needs no more than causal).
    kv_end = prefix + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE_N), NUM_SPLITS)
    seg_start = split * tiles_per_split * TILE_N
    seg_end = tl.minimum(seg_start + tiles_per_split * TILE_N, kv_end)
    unmasked_end = (prefix // TILE_N) * TILE_N

    m0 = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
    l0 = tl.zeros([SUB_M], dtype=tl.float32)
    acc0 = tl.zeros([SUB_M, HEAD_DIM_P], dtype=tl.float32)
    acc1, m1, l1 = acc0, m0, l0
    acc2, m2, l2 = acc0, m0, l0
    acc3, m3, l3 = acc0, m0, l0
    # Two stages, unrolled at compile time: tiles wholly inside the prefix (no mask),
    # then the tiles that reach into the new tokens (causal or tree mask).
    for stage in tl.static_range(2):
        if stage == 0:
            lo, hi = seg_start, tl.minimum(seg_end, unmasked_end)
        else:
            lo, hi = tl.maximum(seg_start, unmasked_end), seg_end
        for start in range(lo, hi, TILE_N):
            acc0, m0, l0, acc1, m1, l1, acc2, m2, l2, acc3, m3, l3 = _attend_kv_tile(
                start, kv_end, prefix, req, kv_head, is_tree,
                acc0, m0, l0, acc1, m1, l1, acc2, m2, l2, acc3, m3, l3,
                q0, q1, q2, q3, qi0, qi1, qi2, qi3, ok0, ok1, ok2, ok3, tok0, tok1, tok2, tok3,
                k_cache_ptr, v_cache_ptr, block_tables_ptr, tree_mask_ptr, kv_loads_ptr,
                stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, tree_words, scale_log2,
                HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, BLOCK_ALIGNED, COUNT_LOADS, NUM_SUB, DOT_FP32, stage == 1,
            )

    _finish_rows(acc0, m0, l0, split, tok0, head0, ok0, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens, num_heads,
                 stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)
    if NUM_SUB > 1:
        _finish_rows(acc1, m1, l1, split, tok1, head1, ok1, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens,
                     num_heads, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)
    if NUM_SUB > 2:
        _finish_rows(acc2, m2, l2, split, tok2, head2, ok2, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens,
                     num_heads, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)
        _finish_rows(acc3, m3, l3, split, tok3, head3, ok3, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens,
                     num_heads, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)


@triton.jit(do_not_specialize=["num_tokens"])
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


@triton.jit(do_not_specialize=["row_elems"])
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
