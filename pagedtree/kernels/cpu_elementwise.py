"""numba kernels: a decoder layer's element-wise work on CPU, one call per piece.

Eager torch spends 30-40 small ops per layer on residual adds, RMSNorm and rotary
embeddings (about 5 us of dispatch each, whatever the size), more than the
arithmetic at decode and tree-verify sizes. These kernels do each piece in one call,
parallel over tokens:

- ``add_rms_norm_kernel``: ``residual += x`` (in place) then ``out = w * norm(residual)``;
- ``rotary_kernel``: rotary embedding of every query and key head, in place in the
  fused q/k/v projection's output.

Each has a serial twin (``add_rms_norm_serial``, ``rotary_serial``) with the same
per-row arithmetic, for steps of a few rows: waking the parallel pool for one row
cost about 100 us a call inside a decode step (the pool's threads sleep between the
linear layers' calls), against 10 us for the row itself.

They compute what the eager ops compute, rounding included: in bf16 every
intermediate that eager torch stores in bf16 is rounded to bf16 here too (round to
nearest even), and everything else is fp32. Only reduction order differs (the sum
of squares is accumulated in fp64 here).

bf16 tensors are passed as their raw 16-bit patterns (numba has no bf16) and
widened exactly, as in ``cpu_attention``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from pagedtree.numba_cache import use_shared_cache

use_shared_cache()  # before the kernels below are decorated


@njit(inline="always")
def _load(src, row: int, start: int, dst_f32, dst_bits, bf16: bool) -> None:
    """``dst_f32[:] = src[row, start:start + len(dst_f32)]`` widened to fp32."""
    if bf16:
        for i in range(dst_f32.shape[0]):
            dst_bits[i] = np.uint32(src[row, start + i]) << np.uint32(16)
    else:
        for i in range(dst_f32.shape[0]):
            dst_f32[i] = src[row, start + i]


@njit(inline="always")
def _round_bf16(bits, n: int) -> None:
    """Round the first ``n`` fp32 values behind ``bits`` to bf16 precision (nearest even),
    kept as fp32; NaNs stay NaN."""
    for i in range(n):
        b = np.int64(bits[i])
        if (b & 0x7FFFFFFF) > 0x7F800000:
            bits[i] = np.uint32((b | 0x00400000) & 0xFFFF0000)
        else:
            bits[i] = np.uint32(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16)


@njit(inline="always")
def _store(dst, row: int, start: int, src_f32, src_bits, bf16: bool) -> None:
    """``dst[row, start:...] = src_f32`` (already bf16-rounded when ``bf16``)."""
    if bf16:
        for i in range(src_f32.shape[0]):
            dst[row, start + i] = np.uint16(src_bits[i] >> np.uint32(16))
    else:
        for i in range(src_f32.shape[0]):
            dst[row, start + i] = src_f32[i]


@njit(inline="always")
def _add_rms_norm_row(x, residual, weight, out, t: int, eps32, has_x: bool, bf16: bool) -> None:
    """Row ``t`` of ``add_rms_norm_kernel``."""
    hidden = residual.shape[1]
    row = np.empty(hidden, dtype=np.float32)
    row_bits = row.view(np.uint32)
    _load(residual, t, 0, row, row_bits, bf16)
    if has_x:
        other = np.empty(hidden, dtype=np.float32)
        other_bits = other.view(np.uint32)
        _load(x, t, 0, other, other_bits, bf16)
        for e in range(hidden):
            row[e] = row[e] + other[e]
        if bf16:
            _round_bf16(row_bits, hidden)
        _store(residual, t, 0, row, row_bits, bf16)
    # Eight partial sums, so that the additions do not wait on one another (one running
    # fp64 sum made the norm latency-bound: 2 of a 1536-wide row's 2.6 us).
    partial = np.zeros(8, dtype=np.float64)
    whole = hidden - hidden % 8
    for e in range(0, whole, 8):
        for j in range(8):
            partial[j] += np.float64(row[e + j]) * np.float64(row[e + j])
    squares = 0.0
    for j in range(8):
        squares += partial[j]
    for e in range(whole, hidden):
        squares += np.float64(row[e]) * np.float64(row[e])
    variance = np.float32(squares / hidden)
    inverse = np.float32(1.0) / np.sqrt(variance + eps32)
    for e in range(hidden):
        row[e] = row[e] * inverse
    if bf16:
        _round_bf16(row_bits, hidden)
    for e in range(hidden):
        row[e] = weight[e] * row[e]
    if bf16:
        _round_bf16(row_bits, hidden)
    _store(out, t, 0, row, row_bits, bf16)


@njit(parallel=True, cache=True, nogil=True)
def add_rms_norm_kernel(
    x,  # [T, E] the sub-layer's output (fp32, or uint16 bf16 bits); ignored unless has_x
    residual,  # [T, E] the residual stream, updated in place: residual += x
    weight,  # [E] float32 norm weight (a bf16 weight widened exactly)
    out,  # [T, E] normed output, same dtype as residual
    eps: float,
    has_x: bool,
    bf16: bool,
) -> None:
    """``residual += x``; ``out = weight * (residual * rsqrt(mean(residual^2) + eps))``.

    Eager order: the sum is rounded to the model dtype, the normalised row is rounded
    to the model dtype before the weight multiplies it, and the product is rounded.
    """
    eps32 = np.float32(eps)
    for t in prange(residual.shape[0]):
        _add_rms_norm_row(x, residual, weight, out, t, eps32, has_x, bf16)


@njit(cache=True, nogil=True)
def add_rms_norm_serial(x, residual, weight, out, eps: float, has_x: bool, bf16: bool) -> None:
    """``add_rms_norm_kernel`` on the calling thread (same arithmetic, row by row): for
    a few rows, waking the parallel pool costs more than the rows."""
    eps32 = np.float32(eps)
    for t in range(residual.shape[0]):
        _add_rms_norm_row(x, residual, weight, out, t, eps32, has_x, bf16)


@njit(inline="always")
def _rotary_row(qkv, cos, sin, t: int, num_heads: int, head_dim: int, bf16: bool) -> None:
    """Row ``t`` of ``rotary_kernel``."""
    half = head_dim // 2
    head = np.empty(head_dim, dtype=np.float32)
    head_bits = head.view(np.uint32)
    # The two products per element, rounded like eager's separate tensors.
    first = np.empty(head_dim, dtype=np.float32)
    first_bits = first.view(np.uint32)
    second = np.empty(head_dim, dtype=np.float32)
    second_bits = second.view(np.uint32)
    for h in range(num_heads):
        _load(qkv, t, h * head_dim, head, head_bits, bf16)
        for i in range(half):
            first[i] = head[i] * cos[t, i]
            second[i] = -head[i + half] * sin[t, i]
            first[i + half] = head[i + half] * cos[t, i + half]
            second[i + half] = head[i] * sin[t, i + half]
        if bf16:
            _round_bf16(first_bits, head_dim)
            _round_bf16(second_bits, head_dim)
        for i in range(head_dim):
            head[i] = first[i] + second[i]
        if bf16:
            _round_bf16(head_bits, head_dim)
        _store(qkv, t, h * head_dim, head, head_bits, bf16)


@njit(parallel=True, cache=True, nogil=True)
def rotary_kernel(
    qkv,  # [T, N] projection output (fp32, or uint16 bf16 bits); heads 0..num_heads-1 rotated in place
    cos,  # [T, D] float32 table (values already in the model dtype's precision)
    sin,  # [T, D] float32
    num_heads: int,  # query heads + key heads, stored first in each row
    head_dim: int,
    bf16: bool,
) -> None:
    """Half-split rotary embedding: ``x * cos + rotate_half(x) * sin`` per head.

    Eager order: both products and the sum are rounded to the model dtype.
    """
    for t in prange(qkv.shape[0]):
        _rotary_row(qkv, cos, sin, t, num_heads, head_dim, bf16)


@njit(cache=True, nogil=True)
def rotary_serial(qkv, cos, sin, num_heads: int, head_dim: int, bf16: bool) -> None:
    """``rotary_kernel`` on the calling thread (for a few rows)."""
    for t in range(qkv.shape[0]):
        _rotary_row(qkv, cos, sin, t, num_heads, head_dim, bf16)
