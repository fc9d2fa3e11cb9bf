"""A step's attention metadata in FlashInfer's paged-KV layout (plain data, no GPU).

FlashInfer's batch attention reads a paged cache through four index arrays (its
"page table layout"): ``qo_indptr`` (where each request's queries start in the flat
run of queries), ``kv_indptr`` and ``kv_indices`` (each request's pages, in order,
concatenated), and ``kv_last_page_len`` (how many entries of its last page are
filled, 1 to ``page_size``). A request's keys are then the first
``(pages - 1) * page_size + last_page_len`` entries of its pages, and its queries are
the last ``q_len`` of those keys: a causal step lets query ``j`` see keys up to
``kv_len - q_len + j``.

A token tree is not causal among its nodes, so a step with trees is given as a
custom mask: per request a row-major ``[q_len, kv_len]`` boolean block (True: may
attend), the blocks concatenated in request order (FlashInfer packs each block into
bits itself). The prefix (keys before the step's new tokens) is visible to every
query; among the new tokens a tree node sees itself and its ancestors, a chunk
without a tree its causal predecessors.

The engine's pages are its KV blocks (``[blocks, block_size, H_kv, D]``, FlashInfer's
"NHD" layout with ``page_size = block_size``), so no cache is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedtree.kernels.tree_masks import ancestor_matrix

if TYPE_CHECKING:
    from pagedtree.step_data import AttentionMetadata

# What a step asks of FlashInfer: a decode kernel (one query per request), causal
# prefill, or prefill with a custom mask (some request verifies a tree).
DECODE, CAUSAL, MASKED = "decode", "causal", "masked"


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """One step's queries and pages as FlashInfer's batch attention takes them."""

    kind: str  # DECODE, CAUSAL or MASKED
    qo_indptr: list[int]  # [B + 1]
    kv_indptr: list[int]  # [B + 1]
    kv_indices: list[int]  # [kv_indptr[-1]] page (block) ids
    kv_last_page_len: list[int]  # [B], each in [1, page_size]
    # MASKED: the flat bool mask, sum(q_len * kv_len) entries; None otherwise.
    custom_mask: np.ndarray | None = None


def paged_layout(meta: AttentionMetadata) -> PagedLayout:
    """The step ``meta`` in FlashInfer's layout, checked: every request has at least
    one query, as many keys as queries or more, a block table that covers its keys,
    and a parent list as long as its queries when it verifies a tree."""
    qsl, context_lens, tables = meta.query_start_loc, meta.context_lens, meta.block_tables
    page = meta.block_size
    num_requests = len(context_lens)
    if len(qsl) != num_requests + 1 or qsl[0] != 0:
        raise ValueError("query_start_loc must start at 0 and have one more entry than context_lens")
    if len(tables) != num_requests or len(meta.tree_parents) != num_requests:
        raise ValueError("block_tables and tree_parents need one entry per request")
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    q_lens: list[int] = []
    for i, (ctx, table) in enumerate(zip(context_lens, tables)):
        q_len = qsl[i + 1] - qsl[i]
        if q_len < 1:
            raise ValueError(f"request {i}: {q_len} queries; FlashInfer's steps take at least one per request")
        if ctx < q_len:
            raise ValueError(f"request {i}: context_len {ctx} shorter than its {q_len} queries")
        pages = -(-ctx // page)
        if len(table) < pages:
            raise ValueError(f"request {i}: block table of {len(table)} blocks, {ctx} keys need {pages}")
        parents = meta.tree_parents[i]
        if parents is not None and len(parents) != q_len:
            raise ValueError(f"request {i}: {len(parents)} tree parents for {q_len} tokens")
        kv_indices.extend(table[:pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(ctx - (pages - 1) * page)
        q_lens.append(q_len)
    trees = any(p is not None for p in meta.tree_parents)
    if not trees:
        kind = DECODE if all(q == 1 for q in q_lens) else CAUSAL
        return PagedLayout(kind, list(qsl), kv_indptr, kv_indices, last_page_len)
    blocks = []
    for q_len, ctx, parents in zip(q_lens, context_lens, meta.tree_parents):
        block = np.zeros((q_len, ctx), dtype=bool)
        prefix = ctx - q_len
        block[:, :prefix] = True
        block[:, prefix:] = np.tri(q_len, dtype=bool) if parents is None else ancestor_matrix(parents)
        blocks.append(block.ravel())
    return PagedLayout(MASKED, list(qsl), kv_indptr, kv_indices, last_page_len, np.concatenate(blocks))
