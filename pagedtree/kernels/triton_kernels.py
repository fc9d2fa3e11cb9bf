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
try:  # grid dependency control (programmatic dependent launch), Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: launches never overlap (``launch_overlap``)
    gdc_launch_dependents = gdc_wait = None

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
def _wait_previous_grid(PDL: tl.constexpr):
    """Under programmatic dependent launch (``launch_overlap``): wait until the kernel
    before has finished and its writes are visible, then let the next one launch.
    Called first in every program that may run early, before any load of what an
    earlier kernel wrote and before any store."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, MANUAL_BF16: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per new token: its ``[H_kv, D]`` keys and values into its slot."""
    _wait_previous_grid(PDL)
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
    acc, m_i, l_i, q, k, v, start, pos, key_valid, prefix, tok, q_idx, row_valid, is_tree,
    tree_mask_ptr, tree_words, scale_log2, TILE_N: tl.constexpr, DOT_FP32: tl.constexpr, MASKED: tl.constexpr,
):
    """Online-softmax update of the query tile with one K/V tile (keys from ``start``).

    ``MASKED`` tiles reach into the request's new tokens and apply the causal or
    tree mask; tiles wholly inside the prefix are visible to every query.
    """
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    if MASKED:
        if is_tree != 0:  # a branch, not a select: causal tiles need no mask words
            rel = tl.maximum(pos - prefix, 0)
            in_new = (pos >= prefix) & key_valid
            if TILE_N <= 32:
                # A tile of at most 32 keys spans at most two mask words of a row:
                # load those two per row (not one per row and key, which costs a
                # pointer register per element) and pick per key.
                w0 = tl.maximum(start - prefix, 0) // 32
                row_words = tree_mask_ptr + tok * tree_words + w0
                lo = tl.load(row_words, mask=row_valid, other=0)
                hi = tl.load(row_words + 1, mask=row_valid & (w0 + 1 < tree_words), other=0)
                word = tl.where(((rel // 32) == w0)[None, :], lo[:, None], hi[:, None])
            else:  # the interpreter's wide tiles: one word per row and key
                word = tl.load(tree_mask_ptr + tok[:, None] * tree_words + (rel // 32)[None, :],
                               mask=row_valid[:, None] & in_new[None, :], other=0)
            ancestor = (((word >> (rel % 32)[None, :]) & 1) != 0) & in_new[None, :]
            allowed = ((pos < prefix)[None, :] | ancestor) & key_valid[None, :]
        else:
            allowed = (pos[None, :] <= (prefix + q_idx)[:, None]) & key_valid[None, :]
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
def _query_rows(q_ptr, q_begin, q_len, q_start, kv_head, stride_qt, stride_qh,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, DOT_FP32: tl.constexpr):
    """The program's query tile from query ``q_start`` on: ``BLOCK_Q`` tokens of
    ``GROUP_P`` rows each (``GROUP_P`` is the group itself, rows packed, or padded
    to a power of two), token-major, each token with the ``GROUP`` query heads of
    the KV head, in ``BLOCK_M`` rows (the rows past ``BLOCK_Q * GROUP_P`` are
    padding). Returns its queries, the rows' query indices, validity, token ids
    (int32: the host keeps ``num_tokens * tree_words`` below 2**31) and heads."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_start + rows // GROUP_P
    head_in_group = rows % GROUP_P
    row_valid = (rows < BLOCK_Q * GROUP_P) & (q_idx < q_len) & (head_in_group < GROUP)
    tok = q_begin + q_idx
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_P)
    q_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_rows = q_ptr + tok.to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_rows[:, None] + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q, q_idx, row_valid, tok, head


@triton.jit
def _finish_rows(acc, m_i, l_i, split, tok, head, row_valid, out_ptr, part_acc_ptr, part_ml_ptr,
                 num_tokens, num_heads, stride_ot, stride_oh,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 MANUAL_BF16: tl.constexpr):
    """Write the tile's output (or, with split-KV, its unnormalised partials)."""
    dims = tl.arange(0, HEAD_DIM_P)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_rows = out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_rows[:, None] + dims[None, :], _cast(out, out_ptr.dtype.element_ty, MANUAL_BF16),
                 mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :])
    else:
        part_row = (split * num_tokens + tok.to(tl.int64)) * num_heads + head  # [BLOCK_M] int64
        # All HEAD_DIM_P columns (padding ones are 0) so the reduce reads no unwritten memory.
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_DIM_P + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_valid)


# Integers that change from step to step are not specialised on (Triton would
# otherwise compile a variant for 1, for multiples of 16 and for the rest, and a
# server would recompile mid-run); the others are fixed per model and cache.
@triton.jit(do_not_specialize=["num_tokens", "stride_bt", "tree_words"])
def _unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_ptr, context_lens_ptr, is_tree_ptr, tree_mask_ptr,
    tile_req_ptr, tile_q_ptr, part_acc_ptr, part_ml_ptr, kv_loads_ptr, splits_ptr,
    scale_log2, num_tokens, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, tree_words,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    ROOT_SIDE: tl.constexpr, ROOT_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, MANUAL_BF16: tl.constexpr,
    COUNT_LOADS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Paged attention for a whole mixed batch in one launch.

    Grid ``(num_tiles, num_kv_heads, NUM_SPLITS)``. A program takes ``BLOCK_Q``
    consecutive new tokens of one request and all ``GROUP`` query heads that share
    one KV head (``BLOCK_M`` rows, up to 256, spread over the program's warps) and
    walks that request's keys up to its last query, so a token tree whose nodes fit
    one program reads its KV prefix once, as a decode does. With ``ROOT_SIDE`` the
    first program of a request starts at query 1 and takes query 0 (a tree's root)
    in ``ROOT_M`` rows of their own, against the same key tiles: a root and 64
    nodes fit a program sized for 64 tokens. Keys
    before the request's prefix end are seen by everyone; among the new tokens the
    mask is causal, or ancestors-only for a tree request. With ``NUM_SPLITS > 1``
    each program takes one segment of the keys and writes unnormalised partial
    results for :func:`_reduce_splits_kernel`; the step uses the first
    ``splits_ptr[0]`` of the ``NUM_SPLITS`` segment programs (a CUDA graph's grid
    is fixed, the split its step calls for is not), the others return at once.
    ``PDL``: every program waits for the kernel before first (``launch_overlap``).
    """
    _wait_previous_grid(PDL)
    BLOCK_ALIGNED: tl.constexpr = BLOCK_SIZE % TILE_N == 0
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    if req < 0:  # padding tile (a captured grid larger than this step)
        return
    if NUM_SPLITS > 1:
        num_splits = tl.load(splits_ptr)
        if split >= num_splits:
            return
    else:
        num_splits = 1
    q_tile_start = tl.load(tile_q_ptr + tile)
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    ctx = tl.load(context_lens_ptr + req)
    is_tree = tl.load(is_tree_ptr + req)
    prefix = ctx - q_len
    q, q_idx, row_valid, tok, head = _query_rows(q_ptr, q_begin, q_len, q_tile_start, kv_head, stride_qt, stride_qh,
                                                 GROUP, GROUP_P, BLOCK_Q, BLOCK_M, HEAD_DIM, HEAD_DIM_P, DOT_FP32)

    # Keys this tile needs: the prefix and the new tokens up to its last query
    # (tree parents precede their children, so a tree needs no more than causal).
    kv_end = prefix + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, TILE_N), num_splits)
    seg_start = split * tiles_per_split * TILE_N
    seg_end = tl.minimum(seg_start + tiles_per_split * TILE_N, kv_end)
    unmasked_end = (prefix // TILE_N) * TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    if ROOT_SIDE:  # query 0, in the request's first program only (its tile starts at query 1)
        r_q, r_idx, r_valid, r_tok, r_head = _query_rows(q_ptr, q_begin, q_len, 0, kv_head, stride_qt, stride_qh,
                                                         GROUP, GROUP, 1, ROOT_M, HEAD_DIM, HEAD_DIM_P, DOT_FP32)
        r_valid = r_valid & (q_tile_start == 1)
        r_m = tl.full([ROOT_M], float("-inf"), dtype=tl.float32)
        r_l = tl.zeros([ROOT_M], dtype=tl.float32)
        r_acc = tl.zeros([ROOT_M, HEAD_DIM_P], dtype=tl.float32)
    # Two stages, unrolled at compile time: tiles wholly inside the prefix (no mask),
    # then the tiles that reach into the new tokens (causal or tree mask).
    for stage in tl.static_range(2):
        if stage == 0:
            lo, hi = seg_start, tl.minimum(seg_end, unmasked_end)
        else:
            lo, hi = tl.maximum(seg_start, unmasked_end), seg_end
        for start in range(lo, hi, TILE_N):
            k, v, pos, key_valid = _load_kv_tile(
                start, kv_end, req, kv_head, block_tables_ptr, k_cache_ptr, v_cache_ptr, kv_loads_ptr,
                stride_bt, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE_N, BLOCK_ALIGNED, COUNT_LOADS,
            )
            acc, m_i, l_i = _attend_rows(acc, m_i, l_i, q, k, v, start, pos, key_valid, prefix, tok, q_idx,
                                         row_valid, is_tree, tree_mask_ptr, tree_words, scale_log2, TILE_N,
                                         DOT_FP32, stage == 1)
            if ROOT_SIDE:
                if q_tile_start == 1:  # uniform per program: other programs skip the root's products
                    r_acc, r_m, r_l = _attend_rows(r_acc, r_m, r_l, r_q, k, v, start, pos, key_valid, prefix,
                                                   r_tok, r_idx, r_valid, is_tree, tree_mask_ptr, tree_words,
                                                   scale_log2, TILE_N, DOT_FP32, stage == 1)

    _finish_rows(acc, m_i, l_i, split, tok, head, row_valid, out_ptr, part_acc_ptr, part_ml_ptr, num_tokens,
                 num_heads, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)
    if ROOT_SIDE:
        _finish_rows(r_acc, r_m, r_l, split, r_tok, r_head, r_valid, out_ptr, part_acc_ptr, part_ml_ptr,
                     num_tokens, num_heads, stride_ot, stride_oh, HEAD_DIM, HEAD_DIM_P, NUM_SPLITS, MANUAL_BF16)


@triton.jit(do_not_specialize=["num_tokens"])
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, splits_ptr, num_tokens, num_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, MANUAL_BF16: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per (token, head): merge the split-KV partial softmax results of
    the first ``splits_ptr[0]`` segments (of at most ``NUM_SPLITS``). ``PDL``: waits
    for the kernel before first (``launch_overlap``)."""
    _wait_previous_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    s_mask = (splits < NUM_SPLITS) & (splits < tl.load(splits_ptr))
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
