"""numba kernel: paged attention that reads the KV cache in place on CPU.

One kernel call per layer serves every decode and token-tree request of a step. Work
is split over (request, KV head) pairs (``prange``); a pair covers all of the
request's new tokens times the query heads that share the KV head (GQA), so each key
and value row of the request is read once per step and layer, whatever the tree's
size, straight from its cache block (no gather). Keys are walked in tiles with an
online softmax in fp32, so scratch memory stays bounded by the tile.

Masks: keys of the prefix (before the request's new tokens) are visible to every
query; among the new tokens a query sees causally (``key <= query``) or, for a token
tree, the nodes its ancestor mask row marks.

bf16 caches are passed as their raw 16-bit patterns (numba has no bf16): a row is
widened to fp32 exactly by shifting its bits into the high half of a float32.

The queries, keys and values come in as the fused q/k/v projection's output, one
``[T, (H + 2 H_kv) * D]`` buffer in the cache's dtype, and the output goes out in that
dtype too (bf16 rounded to nearest even, as ``Tensor.to(torch.bfloat16)`` rounds):
no fp32 copy of the queries, no contiguous copies of the keys and values, no
conversion of the output. At 32 decode rows on 2 cores each of those small torch ops
cost about 50 us a layer, mostly in waking torch's thread pool.

The kernel also stores the step's new keys and values of the requests it serves in
their cache slots (each work item writes its own request's rows for its KV head
before reading them), so a layer's attention is one call.

Every index the kernel uses is validated on the host first (``cpu_backend``):
numba does not bound-check, so a bad block id would read outside the cache.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from pagedtree.numba_cache import use_shared_cache

use_shared_cache()  # before the kernels below are decorated

# Keys per online-softmax tile: scores for a tile stay in L1/L2 while the value rows
# of the same tile are read.
KEY_TILE = 64


@njit(inline="always")
def _load_cache_row(cache, block: int, slot: int, head: int, row_f32, row_bits, bf16: bool) -> None:
    """Widen one cache row ``cache[block, slot, head, :]`` into ``row_f32``.

    ``row_bits`` is ``row_f32`` viewed as uint32; a bf16 value is the high half of the
    float32 with the same bits, so the widening is exact.
    """
    src = cache[block, slot, head]  # one contiguous row: the widening loop vectorises
    if bf16:
        for d in range(row_f32.shape[0]):
            row_bits[d] = np.uint32(src[d]) << np.uint32(16)
    else:
        for d in range(row_f32.shape[0]):
            row_f32[d] = src[d]


# ``_load_row`` and ``_store_row`` repeat ``cpu_elementwise``'s ``_load`` and
# ``_round_bf16`` + ``_store`` on purpose: numba's cache checks a kernel against its own
# source file only, so a helper inlined from another file could leave a stale kernel.
@njit(inline="always")
def _load_row(rows, token: int, start: int, row_f32, row_bits, bf16: bool) -> None:
    """Widen ``rows[token, start:start + D]`` into ``row_f32`` (exact, as above)."""
    if bf16:
        for d in range(row_f32.shape[0]):
            row_bits[d] = np.uint32(rows[token, start + d]) << np.uint32(16)
    else:
        for d in range(row_f32.shape[0]):
            row_f32[d] = rows[token, start + d]


@njit(inline="always")
def _store_row(out, token: int, start: int, row_f32, row_bits, bf16: bool) -> None:
    """``out[token, start:start + D] = row_f32``, rounded to bf16 bits (nearest even,
    NaN kept) when ``bf16``."""
    if bf16:
        for d in range(row_f32.shape[0]):
            bits = np.int64(row_bits[d])
            if (bits & 0x7FFFFFFF) > 0x7F800000:
                out[token, start + d] = np.uint16(((bits | 0x00400000) >> 16) & 0xFFFF)
            else:
                out[token, start + d] = np.uint16(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF)
    else:
        for d in range(row_f32.shape[0]):
            out[token, start + d] = row_f32[d]


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask for the cache line of element ``index`` of the C-contiguous ``array``
    (counted from its first element) to be brought in; no fault on any address."""
    sig = types.void(array, types.int64)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte_ptr = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, llvm_ir.FunctionType(llvm_ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0i8")
        # (read, high temporal locality, data cache)
        builder.call(prefetch, [builder.bitcast(builder.gep(data, [args[1]]), byte_ptr), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _prefetch_row(cache, block, slot: int, head: int) -> None:
    """Ask for the cache lines of the row ``cache[block, slot, head, :]``."""
    start = ((np.int64(block) * cache.shape[1] + slot) * cache.shape[2] + head) * cache.shape[3]
    for d in range(0, cache.shape[3], 64 // cache.itemsize):  # one per 64-byte line
        _prefetch(cache, start + d)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 ``bits``."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@njit(fastmath=True, inline="always")
def _exp_row(scores, r: int, n: int, shift) -> None:
    """``scores[r, :n] = exp(scores[r, :n] - shift)`` for arguments at most 0 (-inf
    and anything below float32's normal range give 0).

    ``math.exp`` is a scalar float64 call per score; this loop vectorises: ``e^x =
    2^k * 2^f`` with ``k`` the nearest integer to ``x log2 e``, ``2^f`` (``|f| <=
    1/2``) its degree-6 Taylor polynomial (relative error below 2e-7, about one
    float32 ulp) and ``2^k`` made from its exponent bits."""
    for j in range(n):
        t = max((scores[r, j] - shift) * np.float32(1.4426950408889634), np.float32(-127.0))
        k = np.floor(t + np.float32(0.5))
        f = t - k
        p = np.float32(1.5403530393381606e-4)
        p = p * f + np.float32(1.3333558146428443e-3)
        p = p * f + np.float32(9.6181291076284772e-3)
        p = p * f + np.float32(5.5504108664821580e-2)
        p = p * f + np.float32(2.4022650695910071e-1)
        p = p * f + np.float32(6.9314718055994531e-1)
        p = p * f + np.float32(1.0)
        power = _f32_from_bits((np.int32(k) + np.int32(127)) << np.int32(23))
        scores[r, j] = np.float32(0.0) if k < np.float32(-126.0) else p * power


@njit(fastmath=True, inline="never", cache=True)
def _tile_scores(query_rows, keys, scores, rows: int, n: int, scale) -> None:
    """``scores[r, j] = (query_rows[r] . keys[j]) * scale`` for the tile's ``n`` keys.

    Every dot is the same code whatever its key's place in the tile, so a key's score
    has the same bits in a tree node and in the same token decoded plainly."""
    head_dim = keys.shape[1]
    for j in range(n):
        for r in range(rows):
            dot = np.float32(0.0)
            for d in range(head_dim):
                dot += query_rows[r, d] * keys[j, d]
            scores[r, j] = dot * scale


@njit(fastmath=False, inline="never", cache=True)
def _add_rows_in_order(totals, scores, rows: int, n: int) -> None:
    """``totals[r] += scores[r, 0] + ... + scores[r, n - 1]`` for every row, added one
    by one in key order (no fast-math: not regrouped into vector lanes). A tree node
    and the same token decoded plainly see their visible keys at different places of a
    tile, the others weighing 0: added in order, their sums have the same bits, so
    tree verification keeps plain decoding's tokens. The rows' chains interleave, so
    their add latencies overlap."""
    for j in range(n):
        for r in range(rows):
            totals[r] += scores[r, j]


# Fast-math without ``reassoc``: the sums must stay chains in key order (see above),
# while ``contract`` still fuses each step into one multiply-add.
@njit(fastmath={"nnan", "ninf", "nsz", "arcp", "contract", "afn"}, inline="never", cache=True)
def _accumulate_values(acc, weights, values, rows: int, n: int) -> None:
    """``acc[r] += weights[r, 0] * values[0] + ... + weights[r, n - 1] * values[n - 1]``,
    one multiply-add per key in key order, as one key at a time would.

    Four keys go through a row's accumulator at once, so it is loaded and stored a
    quarter as often (the loop is otherwise bound by those stores); a key of weight 0
    adds an exact 0."""
    head_dim = acc.shape[1]
    for r in range(rows):
        j = 0
        while j + 4 <= n:
            w0 = weights[r, j]
            w1 = weights[r, j + 1]
            w2 = weights[r, j + 2]
            w3 = weights[r, j + 3]
            for d in range(head_dim):
                acc[r, d] = w3 * values[j + 3, d] + (w2 * values[j + 2, d] + (
                    w1 * values[j + 1, d] + (w0 * values[j, d] + acc[r, d])))
            j += 4
        while j < n:
            w0 = weights[r, j]
            for d in range(head_dim):
                acc[r, d] = w0 * values[j, d] + acc[r, d]
            j += 1


@njit(parallel=True, fastmath=True, cache=True, nogil=True)
def paged_attention_kernel(
    qkv,  # [T, (H + 2 H_kv) * D] queries, then keys, then values; the cache's dtype
    num_heads: int,  # H
    key_cache,  # [num_blocks, block_size, H_kv, D] float32, or uint16 bf16 bits
    value_cache,
    out,  # [T, H * D] the cache's dtype; rows of the member requests are written
    members,  # [M] int64 requests this call serves
    query_start_loc,  # [B + 1] int64
    context_lens,  # [B] int64
    block_tables,  # [B, max_blocks] int32
    block_size: int,
    tree_mask_offset,  # [B] int64: start of the request's [Q, Q] ancestor mask, -1 = causal
    tree_masks,  # flat uint8, 1 = may attend
    scale: float,
    bf16: bool,
    slot_mapping,  # [T] int64 cache slot of each new token
) -> None:
    """Store the member requests' new keys/values, then their queries' attention over
    their paged keys and values."""
    head_dim = key_cache.shape[3]
    num_kv_heads = key_cache.shape[2]
    key_start = num_heads * head_dim
    value_start = key_start + num_kv_heads * head_dim
    group = num_heads // num_kv_heads
    scale32 = np.float32(scale)
    neg_inf = np.float32(-np.inf)
    for work in prange(members.shape[0] * num_kv_heads):
        request = members[work // num_kv_heads]
        kv_head = work % num_kv_heads
        first_query = query_start_loc[request]
        num_queries = query_start_loc[request + 1] - first_query
        context = context_lens[request]
        prefix = context - num_queries
        mask_offset = tree_mask_offset[request]
        # A paged cache's blocks lie anywhere, so the hardware prefetchers meet each one
        # cold: every row is asked for a while before it is read, the tile's value rows
        # while its key rows are widened, the next tile's key rows while its value rows
        # are (16 requests x 1024 keys, the cache in memory: 1.5x faster than asking
        # for the next tile's rows all at once).
        for key in range(min(context, KEY_TILE)):  # the first tile's keys, asked for first
            _prefetch_row(key_cache, block_tables[request, key // block_size], key % block_size, kv_head)
        for q in range(num_queries):
            slot = slot_mapping[first_query + q]
            for d in range(head_dim):
                key_cache[slot // block_size, slot % block_size, kv_head, d] = \
                    qkv[first_query + q, key_start + kv_head * head_dim + d]
                value_cache[slot // block_size, slot % block_size, kv_head, d] = \
                    qkv[first_query + q, value_start + kv_head * head_dim + d]
        rows = num_queries * group  # row r = query (r // group), head kv_head * group + r % group
        row_f32 = np.empty(head_dim, dtype=np.float32)
        row_bits = row_f32.view(np.uint32)
        # The work item's query rows widened to fp32 once, contiguous for the dots.
        query_rows = np.empty((rows, head_dim), dtype=np.float32)
        for r in range(rows):
            _load_row(qkv, first_query + r // group, (kv_head * group + r % group) * head_dim, row_f32, row_bits, bf16)
            for d in range(head_dim):
                query_rows[r, d] = row_f32[d]
        running_max = np.full(rows, neg_inf, dtype=np.float32)
        running_sum = np.zeros(rows, dtype=np.float32)
        acc = np.zeros((rows, head_dim), dtype=np.float32)
        scores = np.empty((rows, KEY_TILE), dtype=np.float32)
        # One tile of key rows, then of value rows, widened to fp32.
        tile_rows = np.empty((KEY_TILE, head_dim), dtype=np.float32)
        tile_bits = tile_rows.view(np.uint32)
        for tile_start in range(0, context, KEY_TILE):
            tile_end = min(context, tile_start + KEY_TILE)
            # Scores of the tile: each key row widened once, then dotted with every
            # query row.
            for key in range(tile_start, tile_end):
                block = block_tables[request, key // block_size]
                _prefetch_row(value_cache, block, key % block_size, kv_head)
                _load_cache_row(key_cache, block, key % block_size, kv_head,
                                tile_rows[key - tile_start], tile_bits[key - tile_start], bf16)
            _tile_scores(query_rows, tile_rows, scores, rows, tile_end - tile_start, scale32)
            # Keys among the request's own new tokens: causal, or its tree's ancestor mask.
            for key in range(max(tile_start, prefix), tile_end):
                new_index = key - prefix
                for q in range(num_queries):
                    if mask_offset < 0:
                        visible = new_index <= q
                    else:
                        visible = tree_masks[mask_offset + q * num_queries + new_index] != 0
                    if not visible:
                        for h in range(group):
                            scores[q * group + h, key - tile_start] = neg_inf
            # Online softmax: rescale what came before to the new running maximum.
            for r in range(rows):
                tile_max = neg_inf
                for j in range(tile_end - tile_start):
                    if scores[r, j] > tile_max:
                        tile_max = scores[r, j]
                if tile_max == neg_inf:
                    for j in range(tile_end - tile_start):
                        scores[r, j] = 0.0
                    continue
                new_max = max(running_max[r], tile_max)
                correction = np.float32(math.exp(running_max[r] - new_max))
                running_sum[r] *= correction
                for d in range(head_dim):
                    acc[r, d] *= correction
                running_max[r] = new_max
                _exp_row(scores, r, tile_end - tile_start, new_max)
            _add_rows_in_order(running_sum, scores, rows, tile_end - tile_start)
            # Values of the tile, each row widened once.
            for key in range(tile_start, tile_end):
                ahead = key + KEY_TILE
                if ahead < context:
                    _prefetch_row(key_cache, block_tables[request, ahead // block_size], ahead % block_size, kv_head)
                block = block_tables[request, key // block_size]
                _load_cache_row(value_cache, block, key % block_size, kv_head,
                                tile_rows[key - tile_start], tile_bits[key - tile_start], bf16)
            _accumulate_values(acc, scores, tile_rows, rows, tile_end - tile_start)
        for r in range(rows):
            q = r // group
            head = kv_head * group + r % group
            inv = np.float32(1.0) / running_sum[r]
            for d in range(head_dim):
                row_f32[d] = acc[r, d] * inv
            _store_row(out, first_query + q, head * head_dim, row_f32, row_bits, bf16)
