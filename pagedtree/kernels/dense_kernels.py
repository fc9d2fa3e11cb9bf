"""Triton kernels for a decoder layer's dense work, each a row's result whatever the batch.

A token's logits must be the same bits whether a one-token decode or a 65-token tree
computed them (greedy with speculation == without, in 16-bit types too). A library
GEMM picks its tiling and split-K by the row count, so the same row can round
differently in two batches. These kernels fix everything a row's arithmetic depends
on per layer, never per batch:

- ``_invariant_matmul_kernel`` (``x @ W.T`` + bias, optionally SiLU(gate) * up):
  every output element is a sum over the input features in *K-groups* of a fixed
  width (``GROUP_K``, chosen per layer from its shape alone). Within a group the
  products accumulate in one chained ``tl.dot`` loop from zero; the groups' sums are
  added to an fp32 total in group order, starting from zero. One program can walk
  all the groups (``SPLIT=False``, wide batches), or each program takes one group
  and writes its sum to a workspace, and the last program of an output tile to
  finish adds the groups in order (``SPLIT=True``, small batches: a decode's GEMV
  needs many programs to stream the weights). Both give the same fp32 total, hence
  the same rounded result, for any row count: the tile shape, the instruction and
  the order of every addition are the layer's, not the batch's. With ``ROTARY`` (the
  q/k/v projection, one head a column tile) the epilogue also rotates the query and
  key heads and, with ``STORE``, writes keys and values to their paged-cache slots:
  the rotary kernel's work and roundings, without its launch.
- ``_add_rms_norm_kernel``: one program per row, the residual add and the norm.
- ``_rotary_store_kernel``: one program per token, the rotary embedding of its query
  and key heads (in place in the q/k/v projection's output) and its keys and values
  written to their paged-cache slot.

Arithmetic follows transformers' eager order where it rounds: a sum in the model's
dtype, the norm in fp32 cast back before the weight, rotary products rounded one by
one, SiLU(gate) * up on the rounded projections, so the fused layer's tokens stay the
eager layer's tokens up to the GEMM's own summation order.

Like ``triton_kernels``, the module must be imported after ``TRITON_INTERPRET`` is
set when it should run on CPU tensors; every load and store is masked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedtree.kernels.triton_kernels import _cast, _wait_previous_grid


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (no result, no fault: every pointer
    is inside a tensor)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_weights(w_ptr, cols, col_ok, k0, K, stride_wn, STEPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Prefetch the first ``STEPS`` K steps of this program's weight rows into L2, a
    line a row a step (a lane outside the layer asks for the weight's first line)."""
    for step in tl.static_range(STEPS):
        k = k0 + step * BLOCK_K
        ok = col_ok & (k < K)
        _prefetch_l2(tl.where(ok, w_ptr + cols * stride_wn + k, w_ptr))


@triton.jit
def _matmul_group(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k0, K, stride_xm, stride_wn,
                  BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_FP32: tl.constexpr, ROW_EXACT_DOT: tl.constexpr):
    """The fp32 sum ``x[rows, k0:k0+GROUP_K] @ w[cols, k0:k0+GROUP_K].T`` from zero,
    one chained ``tl.dot`` over ``BLOCK_K`` steps (features past ``K`` are zeros)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for step in range(0, GROUP_K, BLOCK_K):
        k = k0 + step + ks
        k_ok = k < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if ROW_EXACT_DOT:
            # The interpreter's tl.dot is a BLAS call whose kernel treats a row by its
            # place in the tile; a broadcast sum adds every element's products alike.
            acc += tl.sum(a.to(tl.float32)[:, :, None] * tl.trans(b.to(tl.float32))[None, :, :], axis=1)
        elif DOT_FP32:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc


@triton.jit
def _rotate(x, x_swapped, cos, sin, HALF_SIGN, DTYPE: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """``x * cos + rotate_half(x) * sin`` with each product rounded to ``DTYPE``, as eager does."""
    first = _cast(x * cos, DTYPE, MANUAL_BF16).to(tl.float32)
    second = _cast(x_swapped * HALF_SIGN * sin, DTYPE, MANUAL_BF16).to(tl.float32)
    return _cast(first + second, DTYPE, MANUAL_BF16)


@triton.jit
def _rotary_rows(out, out_ptr, rows, row_ok, head, stride_om, pos_ptr, cos_sin_ptr, num_positions, stride_cs,
                 HEAD_DIM: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """Head ``head`` of the product's rows ``rows`` (``out``, rounded, ``[R, HEAD_DIM]``)
    rotated by each row's position: stored as it is, read back half-swapped (another
    thread's elements), then returned rotated (half-split layout, as the rotary
    kernel does)."""
    dims = tl.arange(0, HEAD_DIM)
    half: tl.constexpr = HEAD_DIM // 2
    at = out_ptr + rows[:, None] * stride_om + head * HEAD_DIM
    tl.store(at + dims[None, :], out, mask=row_ok[:, None])
    tl.debug_barrier()  # every thread's elements stored before any is read as another's half
    swapped = tl.load(at + ((dims + half) % HEAD_DIM)[None, :], mask=row_ok[:, None], other=0.0)
    tl.debug_barrier()  # every half read before the rotated values overwrite it
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pos_ok = row_ok & (pos >= 0) & (pos < num_positions)  # checked on the host; never read outside the table
    cos = tl.load(cos_sin_ptr + pos[:, None] * stride_cs + dims[None, :], mask=pos_ok[:, None],
                  other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos[:, None] * stride_cs + HEAD_DIM + dims[None, :], mask=pos_ok[:, None],
                  other=0.0).to(tl.float32)
    sign = tl.where(dims < half, -1.0, 1.0)
    return _rotate(out.to(tl.float32), swapped.to(tl.float32), cos, sin, sign[None, :], out_ptr.dtype.element_ty,
                   MANUAL_BF16)


@triton.jit
def _store_cache_rows(out, rows, row_ok, kv_head, cache_ptr, slot_ptr, stride_cb, stride_cblk, stride_ch,
                      HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """KV head ``kv_head`` of the rows ``rows`` (``out``, ``[R, HEAD_DIM]``) written to
    their cache slots (``[blocks, CACHE_BLOCK, H_kv, D]``; a negative slot stores nothing)."""
    dims = tl.arange(0, HEAD_DIM)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    ok = row_ok & (slot >= 0)
    at = (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_cblk + kv_head * stride_ch
    tl.store(cache_ptr + at[:, None] + dims[None, :], _cast(out.to(tl.float32), cache_ptr.dtype.element_ty,
                                                             MANUAL_BF16), mask=ok[:, None])


@triton.jit
def _matmul_epilogue(total, total_up, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, n_out, stride_om,
                     head, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, num_positions, stride_cs,
                     stride_cb, stride_cblk, stride_ch,
                     HAS_BIAS: tl.constexpr, GATED: tl.constexpr, MANUAL_BF16: tl.constexpr,
                     ROTARY: tl.constexpr, STORE: tl.constexpr, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    """Bias, rounding to the output dtype and, ``GATED``, SiLU(gate) * up, stored.
    ``ROTARY``: the columns are head ``head`` of a q/k/v projection (``HEAD_DIM`` of
    them); a query or key head is rotated by its rows' positions before the store,
    and with ``STORE`` a key or value head also goes to the rows' cache slots."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            total_up += tl.load(bias_ptr + n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = _cast(total, dtype, MANUAL_BF16)
    if GATED:
        # Eager's roundings: the projections, SiLU of the gate, then the product.
        gate = out.to(tl.float32)
        up = _cast(total_up, dtype, MANUAL_BF16).to(tl.float32)
        act = _cast(gate * tl.sigmoid(gate), dtype, MANUAL_BF16).to(tl.float32)
        out = _cast(act * up, dtype, MANUAL_BF16)
    if ROTARY:
        if head < NUM_HEADS + NUM_KV_HEADS:  # a query or key head (program-uniform)
            out = _rotary_rows(out, out_ptr, rows, row_ok, head, stride_om, pos_ptr, cos_sin_ptr, num_positions,
                               stride_cs, HEAD_DIM, MANUAL_BF16)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])
    if STORE:
        if head >= NUM_HEADS + NUM_KV_HEADS:
            _store_cache_rows(out, rows, row_ok, head - NUM_HEADS - NUM_KV_HEADS, v_cache_ptr, slot_ptr, stride_cb,
                              stride_cblk, stride_ch, HEAD_DIM, CACHE_BLOCK, MANUAL_BF16)
        elif head >= NUM_HEADS:
            _store_cache_rows(out, rows, row_ok, head - NUM_HEADS, k_cache_ptr, slot_ptr, stride_cb, stride_cblk,
                              stride_ch, HEAD_DIM, CACHE_BLOCK, MANUAL_BF16)


# The row count changes from step to step: no specialisation on it (a server would
# otherwise compile again mid-run for 1, multiples of 16 and the rest).
@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    M, K, n_out, stride_xm, stride_wn, stride_om,
    pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, num_positions, stride_cs,
    stride_cb, stride_cblk, stride_ch,
    NUM_GROUPS: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REDUCE_M: tl.constexpr, REDUCE_UNROLL: tl.constexpr,
    SPLIT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr, ROW_EXACT_DOT: tl.constexpr, MANUAL_BF16: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 0,
    ROTARY: tl.constexpr = False, STORE: tl.constexpr = False, NUM_HEADS: tl.constexpr = 0,
    NUM_KV_HEADS: tl.constexpr = 0, CACHE_BLOCK: tl.constexpr = 1,
):
    """``out[M, n_out] = x[M, K] @ w.T (+ bias)``; ``GATED``: ``w`` holds the gate rows
    then the up rows (``2 * n_out``) and ``out = SiLU(x @ gate.T) * (x @ up.T)``.

    Grid ``(row tiles * column tiles, NUM_GROUPS if SPLIT else 1)``, row tiles
    fastest (neighbouring programs share a weight tile in L2). ``SPLIT``: program
    ``(t, g)`` writes K-group ``g``'s sum to ``part[g]`` (``[NUM_GROUPS, 1 + GATED,
    M, n_out]`` fp32), then counts itself in ``count[t]``; the tile's last program
    adds the groups in order (``REDUCE_M`` rows at a time, ``REDUCE_UNROLL`` groups'
    loads in flight at once), finishes the tile and puts the counter back to 0.

    ``ROTARY``: ``out`` is a q/k/v projection whose column tiles are its heads
    (``BLOCK_N`` = the head dim; ``NUM_HEADS`` query heads, then ``NUM_KV_HEADS`` key
    heads, then as many value heads). The epilogue rotates query and key heads by
    ``cos_sin[pos[row]]`` (``[cos | sin]`` rows, the model's dtype) and, ``STORE``,
    writes keys and values to cache slot ``slot[row]`` (``[blocks, CACHE_BLOCK, H_kv,
    D]`` caches): ``_rotary_store_kernel``'s arithmetic on the same rounded values.

    ``PDL``: launched to overlap the kernel before (``launch_overlap``); a split
    program first prefetches ``PREFETCH_STEPS`` K steps of its weights (which no
    kernel writes) into L2, then waits for that kernel.
    """
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tile_m = tile % tiles_m
    tile_n = tile // tiles_m
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok = rows < M
    col_ok = cols < n_out
    if PDL and SPLIT and PREFETCH_STEPS > 0:
        k0 = tl.program_id(1) * GROUP_K
        _prefetch_weights(w_ptr, cols, col_ok, k0, K, stride_wn, PREFETCH_STEPS, BLOCK_K)
        if GATED:
            _prefetch_weights(w_ptr + n_out * stride_wn, cols, col_ok, k0, K, stride_wn, PREFETCH_STEPS, BLOCK_K)
    _wait_previous_grid(PDL)
    if SPLIT:
        group = tl.program_id(1)
        part = _matmul_group(x_ptr, w_ptr, rows, cols, row_ok, col_ok, group * GROUP_K, K, stride_xm, stride_wn,
                             BLOCK_K, GROUP_K, BLOCK_M, BLOCK_N, DOT_FP32, ROW_EXACT_DOT)
        cell = rows[:, None] * n_out + cols[None, :]
        cell_ok = row_ok[:, None] & col_ok[None, :]
        plane = tl.cast(M, tl.int64) * n_out  # one group's (one half's) sums
        halves = 2 if GATED else 1
        tl.store(part_ptr + (group * halves) * plane + cell, part, mask=cell_ok)
        if GATED:
            part_up = _matmul_group(x_ptr, w_ptr + n_out * stride_wn, rows, cols, row_ok, col_ok, group * GROUP_K,
                                    K, stride_xm, stride_wn, BLOCK_K, GROUP_K, BLOCK_M, BLOCK_N, DOT_FP32, ROW_EXACT_DOT)
            tl.store(part_ptr + (group * 2 + 1) * plane + cell, part_up, mask=cell_ok)
        # Every thread's sums are written before one thread counts the program in:
        # the barrier orders them within the program, the counter's release (and the
        # last program's acquire) across programs.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_GROUPS - 1:
            # The tile's rows that exist, REDUCE_M at a time (a decode's rows in one
            # pass); each pass issues REDUCE_UNROLL groups' loads together, so the
            # reduction waits about one L2 round trip per REDUCE_UNROLL groups rather
            # than one per group. The adds stay in group order from zero: the same
            # bits as the one-program path, whatever the row chunk.
            tile_rows = tl.minimum(M - tile_m * BLOCK_M, BLOCK_M)
            for r0 in range(0, tile_rows, REDUCE_M):
                sub_rows = (tile_m * BLOCK_M + r0 + tl.arange(0, REDUCE_M)).to(tl.int64)
                sub_ok = sub_rows < M  # REDUCE_M divides BLOCK_M: the chunk stays in the tile
                sub_cell = sub_rows[:, None] * n_out + cols[None, :]
                sub_cell_ok = sub_ok[:, None] & col_ok[None, :]
                sub_total = tl.zeros([REDUCE_M, BLOCK_N], dtype=tl.float32)
                sub_up = tl.zeros([REDUCE_M, BLOCK_N], dtype=tl.float32)
                for g0 in range(0, NUM_GROUPS, REDUCE_UNROLL):
                    for j in tl.static_range(REDUCE_UNROLL):
                        # A group past the last adds 0.0 (masked): exact, as a sum
                        # from +0.0 is never -0.0.
                        g_ok = sub_cell_ok & (g0 + j < NUM_GROUPS)
                        # .cg: from L2, never a stale line of this SM's L1.
                        sub_total += tl.load(part_ptr + ((g0 + j) * halves) * plane + sub_cell, mask=g_ok,
                                             other=0.0, cache_modifier=".cg")
                        if GATED:
                            sub_up += tl.load(part_ptr + ((g0 + j) * 2 + 1) * plane + sub_cell, mask=g_ok,
                                              other=0.0, cache_modifier=".cg")
                _matmul_epilogue(sub_total, sub_up, bias_ptr, out_ptr, sub_rows, cols, sub_ok, col_ok, n_out,
                                 stride_om, tile_n, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                                 num_positions, stride_cs, stride_cb, stride_cblk, stride_ch, HAS_BIAS, GATED,
                                 MANUAL_BF16, ROTARY, STORE, NUM_HEADS, NUM_KV_HEADS, BLOCK_N, CACHE_BLOCK)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for group in range(NUM_GROUPS):
            total += _matmul_group(x_ptr, w_ptr, rows, cols, row_ok, col_ok, group * GROUP_K, K, stride_xm,
                                   stride_wn, BLOCK_K, GROUP_K, BLOCK_M, BLOCK_N, DOT_FP32, ROW_EXACT_DOT)
            if GATED:
                total_up += _matmul_group(x_ptr, w_ptr + n_out * stride_wn, rows, cols, row_ok, col_ok,
                                          group * GROUP_K, K, stride_xm, stride_wn, BLOCK_K, GROUP_K, BLOCK_M,
                                          BLOCK_N, DOT_FP32, ROW_EXACT_DOT)
        _matmul_epilogue(total, total_up, bias_ptr, out_ptr, rows, cols, row_ok, col_ok, n_out, stride_om,
                         tile_n, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, num_positions, stride_cs,
                         stride_cb, stride_cblk, stride_ch, HAS_BIAS, GATED, MANUAL_BF16, ROTARY, STORE, NUM_HEADS,
                         NUM_KV_HEADS, BLOCK_N, CACHE_BLOCK)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, MANUAL_BF16: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per row. ``HAS_RESIDUAL``: ``residual += x`` (rounded to its dtype,
    in place), then ``out = weight * rmsnorm(residual)``; else ``out = weight *
    rmsnorm(x)``. The norm in fp32, cast to the dtype before the weight (transformers'
    order). ``PDL``: waits for the kernel before first (``launch_overlap``)."""
    _wait_previous_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        s = _cast(h + r, residual_ptr.dtype.element_ty, MANUAL_BF16)
        tl.store(residual_ptr + row * stride_r + cols, s, mask=ok)
        h = s.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n
    normed = _cast(h * tl.rsqrt(variance + eps), dtype, MANUAL_BF16).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _cast(w * normed, dtype, MANUAL_BF16), mask=ok)


@triton.jit
def _rotary_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    num_positions, stride_t, stride_cs, stride_cb, stride_cblk, stride_ch,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    STORE: tl.constexpr, MANUAL_BF16: tl.constexpr, PDL: tl.constexpr = False,
):
    """One program per token of the q/k/v projection's output ``[T, (H + 2 H_kv) * D]``:
    its query and key heads rotated in place (half-split layout, ``cos_sin[pos]`` =
    the position's ``[cos | sin]`` table row in the model's dtype), and with ``STORE``
    its rotated keys and its values written to cache slot ``slot[t]`` (``[blocks,
    block_size, H_kv, D]`` caches; a negative slot stores nothing). ``PDL``: waits
    for the kernel before first (``launch_overlap``)."""
    _wait_previous_grid(PDL)
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    swapped = (dims + half) % HEAD_DIM
    sign = tl.where(dims < half, -1.0, 1.0)
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < num_positions)  # checked on the host; never read outside the table
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims, mask=pos_ok & (dims < HEAD_DIM), other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM + dims, mask=pos_ok & (dims < HEAD_DIM),
                  other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_t

    heads = tl.arange(0, HEADS_P)
    q_ok = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    q_at = row + heads[:, None] * HEAD_DIM
    q = tl.load(q_at + dims[None, :], mask=q_ok, other=0.0).to(tl.float32)
    q_sw = tl.load(q_at + swapped[None, :], mask=q_ok, other=0.0).to(tl.float32)
    kv_heads = tl.arange(0, KV_HEADS_P)
    kv_ok = (kv_heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k_at = row + (NUM_HEADS + kv_heads[:, None]) * HEAD_DIM
    k = tl.load(k_at + dims[None, :], mask=kv_ok, other=0.0).to(tl.float32)
    k_sw = tl.load(k_at + swapped[None, :], mask=kv_ok, other=0.0).to(tl.float32)
    # Another thread's element is read as the swapped half: every load before any
    # store writes the row in place.
    tl.debug_barrier()
    q_rot = _rotate(q, q_sw, cos[None, :], sin[None, :], sign[None, :], dtype, MANUAL_BF16)
    tl.store(q_at + dims[None, :], q_rot, mask=q_ok)
    k_rot = _rotate(k, k_sw, cos[None, :], sin[None, :], sign[None, :], dtype, MANUAL_BF16)
    tl.store(k_at + dims[None, :], k_rot, mask=kv_ok)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        store_ok = kv_ok & (slot >= 0)
        cache_at = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cblk
        cache_at = cache_at + kv_heads[:, None] * stride_ch + dims[None, :]
        cache_ty = k_cache_ptr.dtype.element_ty
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_heads[:, None]) * HEAD_DIM + dims[None, :], mask=kv_ok,
                    other=0.0)
        tl.store(k_cache_ptr + cache_at, _cast(k_rot.to(tl.float32), cache_ty, MANUAL_BF16), mask=store_ok)
        tl.store(v_cache_ptr + cache_at, _cast(v.to(tl.float32), cache_ty, MANUAL_BF16), mask=store_ok)
