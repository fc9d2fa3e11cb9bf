"""Pure-torch paged attention: the production CPU backend, and the reference the
Triton kernels are tested against.

KV cache layout (one pair per layer): ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token slot ``s`` lives at ``cache.view(-1, H_kv, D)[s]``.

A step's queries are a flat run of tokens, request after request (varlen). Request
``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]`` and sees
``context_lens[i]`` KV entries through its block table: a prefix of
``context_len - q_len`` entries, then its own new tokens, among which it attends
causally, or, for a token tree, only to each node's ancestors and itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedtree.attention.backend import AttentionBackend
from pagedtree.kernels.tree_masks import ancestor_matrix
from pagedtree.step_data import AttentionMetadata

if TYPE_CHECKING:
    from pagedtree.step_data import StaticShape

# Requests with at most this many new tokens (decode steps, token trees) are padded
# into one batched attention call; longer prefill chunks each get their own call so
# that padding never multiplies their cost.
SMALL_QUERY_LEN = 64


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``[T, T]`` bool: entry ``[j, k]`` is True when node ``k`` is ``j`` or its ancestor.

    ``parents[j]`` is the index of node ``j``'s parent among the nodes, or -1 for a
    root (a node attached directly to the prefix). Parents precede their children.
    """
    return torch.from_numpy(ancestor_matrix(parents))


@dataclass(slots=True)
class AttentionGroup:
    """Requests whose queries are padded into one ``[B, Q, K]`` attention call."""

    query_index: torch.Tensor  # [B, Q] flat token index of each padded query (0 for padding)
    kv_slots: torch.Tensor  # [B, K] cache slot of each key (0 for padding)
    mask: torch.Tensor  # [B, 1, Q, K] bool, True = may attend
    valid_rows: torch.Tensor  # flat indices into [B * Q] of the real queries
    valid_tokens: torch.Tensor  # their flat token indices (query_index at valid_rows)
    # When the group's queries are tokens first..first+B*Q-1 in order with no padding
    # (a batch of decodes, one prefill chunk), gathers become views.
    contiguous_from: int | None
    # One request's first chunk (no cached prefix, no tree): plain causal attention,
    # which SDPA computes without the mask, skipping the blocks above the diagonal
    # (a 2048-token chunk of the 1.5B: 84 ms a layer on 2 cores against 147).
    causal: bool = False


@dataclass(slots=True)
class ReferencePlan:
    """Per-step gather indices and masks, built once and reused by every layer."""

    groups: list[AttentionGroup]
    num_tokens: int


def build_reference_plan(meta: AttentionMetadata, small_queries: bool = True) -> ReferencePlan:
    """Group the step's requests and precompute their gathers and masks.

    With ``small_queries=False`` the requests of at most ``SMALL_QUERY_LEN`` new tokens
    are left out (the CPU kernel serves them in place).
    """
    query_start_loc, context_lens = meta.query_start_loc, meta.context_lens
    block_tables, tree_parents, block_size = meta.block_tables, meta.tree_parents, meta.block_size
    device = meta.slot_mapping.device
    num_requests = len(context_lens)
    if len(query_start_loc) != num_requests + 1:
        raise ValueError("query_start_loc must have one more entry than context_lens")
    small = [i for i in range(num_requests) if _qlen(query_start_loc, i) <= SMALL_QUERY_LEN]
    large = [i for i in range(num_requests) if _qlen(query_start_loc, i) > SMALL_QUERY_LEN]
    groups = [[i] for i in large] + ([small] if small and small_queries else [])
    built = [
        _build_group(g, query_start_loc, context_lens, block_tables, tree_parents, block_size, device)
        for g in groups
    ]
    return ReferencePlan(groups=built, num_tokens=query_start_loc[-1])


def _qlen(query_start_loc: Sequence[int], i: int) -> int:
    return query_start_loc[i + 1] - query_start_loc[i]


def _build_group(
    members: list[int],
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    tree_parents: Sequence[Sequence[int] | None],
    block_size: int,
    device: torch.device | str,
) -> AttentionGroup:
    qlens = [_qlen(query_start_loc, i) for i in members]
    q_max = max(qlens)
    k_max = max(context_lens[i] for i in members)
    b = len(members)
    query_index = torch.zeros(b, q_max, dtype=torch.long)
    query_valid = torch.zeros(b, q_max, dtype=torch.bool)
    kv_slots = torch.zeros(b, k_max, dtype=torch.long)
    mask = torch.zeros(b, q_max, k_max, dtype=torch.bool)
    key_pos = torch.arange(k_max)
    for row, (i, q_len) in enumerate(zip(members, qlens)):
        ctx = context_lens[i]
        prefix = ctx - q_len
        if prefix < 0:
            raise ValueError(f"request {i}: context_len {ctx} shorter than its {q_len} queries")
        table = torch.as_tensor(list(block_tables[i]), dtype=torch.long)
        if len(table) * block_size < ctx:
            raise ValueError(f"request {i}: block table too short for context_len {ctx}")
        start = query_start_loc[i]
        query_index[row, :q_len] = torch.arange(start, start + q_len)
        query_valid[row, :q_len] = True
        pos = key_pos[:ctx]
        kv_slots[row, :ctx] = table[pos // block_size] * block_size + pos % block_size
        mask[row, :q_len, :prefix] = True
        parents = tree_parents[i]
        if parents is None:
            new_mask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        else:
            if len(parents) != q_len:
                raise ValueError(f"request {i}: {len(parents)} tree parents for {q_len} tokens")
            new_mask = ancestor_mask(parents)
        mask[row, :q_len, prefix:ctx] = new_mask
        # Padding queries attend to one key so that softmax stays finite; their
        # outputs are dropped.
        mask[row, q_len:, 0] = True
    valid_rows = query_valid.flatten().nonzero().flatten()
    valid_tokens = query_index.flatten()[valid_rows]
    first = query_start_loc[members[0]]
    contiguous = bool(query_valid.all()) and torch.equal(
        query_index.flatten(), torch.arange(first, first + b * q_max)
    )
    causal = b == 1 and context_lens[members[0]] == qlens[0] and tree_parents[members[0]] is None
    return AttentionGroup(
        query_index=query_index.to(device),
        kv_slots=kv_slots.to(device),
        mask=mask.unsqueeze(1).to(device),
        valid_rows=valid_rows.to(device),
        valid_tokens=valid_tokens.to(device),
        contiguous_from=first if contiguous else None,
        causal=causal,
    )


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, H_kv, D]`` into the cache slots ``slot_mapping``."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: ReferencePlan,
    scale: float,
    out: torch.Tensor | None = None,
    sdpa: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, H, D]`` over the paged cache; returns ``[T, H, D]``.

    Rows of the plan's groups are written into ``out`` when given (other rows are left
    alone: another kernel serves them), else into a new tensor. ``sdpa`` computes each
    group (torch's kernel, or one with its arguments: ``kernels.zen_sdpa``).

    The new tokens' keys and values must already be stored in the cache. 16-bit
    inputs are computed in fp32 (and rounded once at the end): then a query row's
    result does not depend on how many other rows share its call up to fp32 rounding,
    so a token verified inside a tree gets the logits it gets when decoded alone
    (bf16 SDPA takes other code paths for other shapes).
    """
    compute = torch.float32 if query.dtype in (torch.bfloat16, torch.float16) else query.dtype
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[-2]
    # One row per cache slot. ``index_select`` on a 2-D view copies whole rows and is
    # 3-4x faster on CPU than advanced indexing (``aten::index``) with the same result.
    slot_rows_k = key_cache.view(-1, num_kv_heads * head_dim)
    slot_rows_v = value_cache.view(-1, num_kv_heads * head_dim)
    if out is None:
        out = torch.empty_like(query)
    for group in plan.groups:
        b, q_len = group.query_index.shape
        k_len = group.kv_slots.shape[1]
        first = group.contiguous_from
        if first is not None:
            q = query[first : first + b * q_len].view(b, q_len, num_heads, head_dim)
        else:
            q = query.index_select(0, group.query_index.flatten()).view(b, q_len, num_heads, head_dim)
        q = q.to(compute)
        slots = group.kv_slots.flatten()
        k = slot_rows_k.index_select(0, slots).view(b, k_len, num_kv_heads, head_dim)
        v = slot_rows_v.index_select(0, slots).view(b, k_len, num_kv_heads, head_dim)
        k = k.transpose(1, 2).to(compute)  # [B, H_kv, K, D]
        v = v.transpose(1, 2).to(compute)
        o = sdpa(
            q.transpose(1, 2), k, v, attn_mask=None if group.causal else group.mask, is_causal=group.causal,
            scale=scale, enable_gqa=num_heads != num_kv_heads,
        )
        o = o.transpose(1, 2).reshape(b * q_len, num_heads, head_dim).to(out.dtype)  # [B*Q, H, D]
        if first is not None:
            out[first : first + b * q_len] = o
        else:
            out[group.valid_tokens] = o[group.valid_rows]
    return out


def copy_blocks(
    caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer's key and value cache."""
    for key_cache, value_cache in caches:
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]


def copy_slots(
    caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Copy single token slots ``src[i] -> dst[i]`` in every layer (tree compaction).

    All sources are read before any destination is written, so a destination may be
    another move's source (an accepted tree path slides down onto rejected slots).
    """
    for key_cache, value_cache in caches:
        num_kv_heads, head_dim = key_cache.shape[-2:]
        flat_k = key_cache.view(-1, num_kv_heads, head_dim)
        flat_v = value_cache.view(-1, num_kv_heads, head_dim)
        flat_k[dst] = flat_k[src]
        flat_v[dst] = flat_v[src]


class TorchPagedAttention(AttentionBackend):
    """The pure-torch backend: one gather + SDPA per attention group and layer."""

    name = "torch"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        super().__init__(kv_caches, scale)
        self._meta: AttentionMetadata | None = None
        self._plan: ReferencePlan | None = None

    def begin_step(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0) -> None:
        """Build the gathers and masks shared by every layer of this step."""
        self._meta = meta
        self._plan = build_reference_plan(meta)

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Store ``key``/``value`` and return attention of ``query`` (gathers + SDPA)."""
        assert self._meta is not None and self._plan is not None, "begin_step first"
        key_cache, value_cache = self.kv_caches[layer_index]
        store_kv_reference(key, value, key_cache, value_cache, self._meta.slot_mapping)
        return paged_attention(query, key_cache, value_cache, self._plan, self.scale)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (copy-on-write) in every layer."""
        device = self.kv_caches[0][0].device
        copy_blocks(
            self.kv_caches,
            torch.as_tensor(src, dtype=torch.long, device=device),
            torch.as_tensor(dst, dtype=torch.long, device=device),
        )

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy single token slots in every layer (compacting an accepted tree path)."""
        device = self.kv_caches[0][0].device
        copy_slots(
            self.kv_caches,
            torch.as_tensor(src, dtype=torch.long, device=device),
            torch.as_tensor(dst, dtype=torch.long, device=device),
        )
