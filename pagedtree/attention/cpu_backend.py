"""The CPU attention backend: the numba kernel reads KV blocks in place.

Requests with at most ``SMALL_QUERY_LEN`` new tokens (decodes, token trees, short
chunks) go to ``kernels.cpu_attention.paged_attention_kernel``, one call per layer for all of
them; longer prefill chunks go to the torch path (gather + SDPA), where the work is
dominated by the attention products that SDPA's vectorised kernels do best and the
gather is a small part (for a 16-bit cache on an AMD CPU, zentorch's SDPA where it is
installed and faster: ``kernels.zen_sdpa``). Same interface and cache layout as ``TorchPagedAttention``,
whose block and slot copies it inherits.

Supported cache dtypes: fp32 and bf16 (``supports_dtype``); ``make_backend`` falls
back to the torch backend for others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from pagedtree.step_data import AttentionMetadata
from pagedtree.attention.torch_backend import (
    SMALL_QUERY_LEN,
    ReferencePlan,
    TorchPagedAttention,
    ancestor_mask,
    build_reference_plan,
    paged_attention,
    store_kv_reference,
)
from pagedtree.kernels import zen_sdpa
from pagedtree.kernels.cpu_attention import paged_attention_kernel
from pagedtree.kernels.numba_arrays import as_kernel_array

if TYPE_CHECKING:
    from pagedtree.step_data import StaticShape

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the kernel handles a KV cache of ``dtype``."""
    return dtype in SUPPORTED_DTYPES


@dataclass(slots=True)
class CpuKernelPlan:
    """One step's validated kernel arguments, shared by every layer."""

    members: np.ndarray  # [M] int64 requests served by the kernel
    query_start_loc: np.ndarray  # [B + 1] int64
    context_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, max_blocks] int32 (rows of non-members unused)
    tree_mask_offset: np.ndarray  # [B] int64, -1 = causal
    tree_masks: np.ndarray  # flat uint8 ancestor masks of the members' trees
    slot_mapping: np.ndarray  # [T] int64 cache slot of every new token
    large: ReferencePlan  # SDPA groups of the long chunks
    num_tokens: int


@dataclass(slots=True)
class CheckedStep:
    """A step's per-request lengths and its slots, checked (``check_step``)."""

    query_start_loc: np.ndarray  # [B + 1] int64
    query_lens: np.ndarray  # [B] int64
    context_lens: np.ndarray  # [B] int64
    slot_mapping: np.ndarray  # [T] int64

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1]) if self.query_lens.size else 0


def check_step(meta: AttentionMetadata, num_blocks: int) -> CheckedStep:
    """``meta``'s request lengths and slots, checked for a cache of ``num_blocks``
    blocks (``ValueError`` naming the problem): for kernels that index without bounds
    checks. Each caller checks the block tables and trees it packs."""
    num_requests = len(meta.context_lens)
    query_start_loc = np.asarray(meta.query_start_loc, dtype=np.int64)
    context_lens = np.asarray(meta.context_lens, dtype=np.int64)
    if query_start_loc.shape != (num_requests + 1,):
        raise ValueError("query_start_loc must have one more entry than context_lens")
    if len(meta.block_tables) != num_requests or len(meta.tree_parents) != num_requests:
        raise ValueError("block_tables and tree_parents need one entry per request")
    query_lens = np.diff(query_start_loc)
    if num_requests and (query_start_loc[0] != 0 or (query_lens < 1).any()):
        raise ValueError("query_start_loc must start at 0 and give every request at least one token")
    short = np.nonzero(context_lens < query_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"request {i}: context_len {context_lens[i]} shorter than its {query_lens[i]} queries")
    checked = CheckedStep(query_start_loc, query_lens, context_lens,
                          meta.slot_mapping.numpy().astype(np.int64, copy=False))
    num_tokens, slots = checked.num_tokens, checked.slot_mapping
    if slots.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {num_tokens} tokens")
    if num_tokens and (slots.min() < 0 or slots.max() >= num_blocks * meta.block_size):
        raise ValueError(f"slot_mapping entries must lie in [0, {num_blocks * meta.block_size})")
    return checked


def build_cpu_plan(meta: AttentionMetadata, num_blocks: int) -> CpuKernelPlan:
    """Validate ``meta`` and pack it for the kernel (raises ``ValueError`` on bad metadata).

    The kernel indexes without bounds checks, so every block id it can read is checked
    against ``num_blocks`` here, and every table must cover its request's context.
    """
    checked = check_step(meta, num_blocks)
    num_requests = len(meta.context_lens)
    query_start_loc, query_lens, context_lens = checked.query_start_loc, checked.query_lens, checked.context_lens
    members = np.nonzero(query_lens <= SMALL_QUERY_LEN)[0].astype(np.int64)
    block_size = meta.block_size
    needed = -(-context_lens // block_size)
    max_blocks = int(needed[members].max()) if members.size else 1
    block_tables = np.zeros((num_requests, max_blocks), dtype=np.int32)
    tree_mask_offset = np.full(num_requests, -1, dtype=np.int64)
    masks: list[np.ndarray] = []
    mask_size = 0
    for i in members.tolist():
        table = meta.block_tables[i]
        if len(table) < needed[i]:
            raise ValueError(f"request {i}: block table too short for context_len {context_lens[i]}")
        block_tables[i, : needed[i]] = table[: needed[i]]
        parents = meta.tree_parents[i]
        if parents is not None:
            if len(parents) != query_lens[i]:
                raise ValueError(f"request {i}: {len(parents)} tree parents for {query_lens[i]} tokens")
            mask = ancestor_mask(parents).numpy().astype(np.uint8).ravel()
            tree_mask_offset[i] = mask_size
            masks.append(mask)
            mask_size += mask.size
    if members.size and (block_tables.min() < 0 or block_tables.max() >= num_blocks):
        raise ValueError(f"block table entries must lie in [0, {num_blocks})")
    return CpuKernelPlan(
        members=members,
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        block_tables=block_tables,
        tree_mask_offset=tree_mask_offset,
        tree_masks=np.concatenate(masks) if masks else np.zeros(1, dtype=np.uint8),
        slot_mapping=checked.slot_mapping,
        large=build_reference_plan(meta, small_queries=False),
        num_tokens=checked.num_tokens,
    )


class CpuPagedAttention(TorchPagedAttention):
    """Paged (tree) attention on CPU that reads the cache in place (numba kernel)."""

    name = "cpu"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """CPU caches of fp32 or bf16 only."""
        if device.type != "cpu":
            return f"it runs on CPU only, not {device}"
        if not supports_dtype(dtype):
            return f"it needs an fp32 or bf16 KV cache, got {dtype}"
        return None

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        super().__init__(kv_caches, scale)
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0][0]
        if first.device.type != "cpu" or not supports_dtype(first.dtype):
            raise ValueError(f"the cpu attention backend needs fp32 or bf16 CPU caches, got {first.dtype} on {first.device}")
        for key_cache, value_cache in kv_caches:
            if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
                raise ValueError("KV caches must be contiguous")
        self.num_blocks = first.shape[0]
        self.block_size = first.shape[1]
        self._bf16 = first.dtype == torch.bfloat16
        self._views = [(as_kernel_array(k), as_kernel_array(v)) for k, v in kv_caches]
        self._cpu_plan: CpuKernelPlan | None = None
        # Long prompt chunks of a 16-bit cache attend in fp32 through zentorch where it
        # is installed and faster here; an fp32 cache keeps torch's (transformers') kernel.
        # Chosen at the first long chunk: engines whose forward attends on its own (the
        # ggml graph) never load the library.
        self._sdpa = None
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the kernel for this cache dtype (or load it from numba's disk cache)
        now, at load time: compiling holds the GIL for seconds, which inside a serving
        step would stall the event loop. One query over a scratch one-block cache of
        the same type (the kernel writes the new rows it gets, and the real cache must
        stay untouched)."""
        key_view = self._views[0][0]
        num_kv_heads, head_dim = key_view.shape[2], key_view.shape[3]
        scratch = np.zeros((1, *key_view.shape[1:]), dtype=key_view.dtype)
        qkv = np.zeros((1, 3 * num_kv_heads * head_dim), dtype=key_view.dtype)
        paged_attention_kernel(
            qkv, num_kv_heads, scratch, scratch.copy(), np.zeros((1, num_kv_heads * head_dim), dtype=key_view.dtype),
            np.zeros(1, dtype=np.int64), np.array([0, 1], dtype=np.int64), np.ones(1, dtype=np.int64),
            np.zeros((1, 1), dtype=np.int32), self.block_size, np.full(1, -1, dtype=np.int64),
            np.zeros(1, dtype=np.uint8), self.scale, self._bf16, np.zeros(1, dtype=np.int64),
        )

    def begin_step(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0) -> None:
        """Take the step's metadata; it is validated and packed once for every layer
        by the first layer that attends (a forward that attends on its own, as the
        ggml graph does, reads ``meta`` and never needs the kernel's plan)."""
        if meta.block_size != self.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != KV cache block size {self.block_size}")
        self._meta = meta
        self._cpu_plan = None
        if isinstance(self._sdpa, zen_sdpa.ZenSdpa):
            self._sdpa.forget()  # the last step's mask, converted

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Store ``key``/``value`` ``[T, H_kv, D]`` and return attention of ``query`` ``[T, H, D]``."""
        assert self._meta is not None, "begin_step first"
        if self._cpu_plan is None:
            self._cpu_plan = build_cpu_plan(self._meta, self.num_blocks)
        plan = self._cpu_plan
        if query.shape[0] != plan.num_tokens:
            raise ValueError(f"{query.shape[0]} query tokens for a step of {plan.num_tokens}")
        key_cache, value_cache = self.kv_caches[layer_index]
        if plan.large.groups:  # the kernel stores only the rows of the requests it serves
            store_kv_reference(key, value, key_cache, value_cache, self._meta.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=key_cache.dtype)
        if plan.members.size:
            key_view, value_view = self._views[layer_index]
            paged_attention_kernel(
                as_kernel_array(projection_rows(query, key, value, key_cache.dtype)), num_heads, key_view,
                value_view, as_kernel_array(out), plan.members, plan.query_start_loc, plan.context_lens,
                plan.block_tables, self.block_size, plan.tree_mask_offset, plan.tree_masks, self.scale, self._bf16,
                plan.slot_mapping,
            )
        out = out.view(num_tokens, num_heads, head_dim)
        if plan.large.groups:
            if self._sdpa is None:
                zen = zen_sdpa.load() if self._bf16 else None
                self._sdpa = zen if zen is not None else F.scaled_dot_product_attention
            paged_attention(query, key_cache, value_cache, plan.large, self.scale, out=out, sdpa=self._sdpa)
        return out if query.dtype == out.dtype else out.to(query.dtype)


def projection_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The step's queries ``[T, H, D]``, keys and values ``[T, H_kv, D]`` as the one
    ``[T, (H + 2 H_kv) * D]`` row-major tensor the kernel reads, in ``dtype``.

    The fused forwards pass views of their q/k/v projection's output, laid out just so:
    that buffer is used as it is. Anything else (the eager forward's rotated copies,
    another dtype) is concatenated into a new one.
    """
    num_tokens, num_heads, head_dim = query.shape
    q_width = num_heads * head_dim
    kv_width = key.shape[1] * key.shape[2]
    width = q_width + 2 * kv_width
    views_of_one_buffer = False
    if (query.dtype == dtype and key.dtype == dtype and value.dtype == dtype
            and query.stride() == (width, head_dim, 1) and key.stride() == (width, key.shape[2], 1)
            and value.stride() == (width, value.shape[2], 1)):
        start, item = query.data_ptr(), query.element_size()
        # Then element (t, c) of the [T, width] rows is q's, k's or v's own element.
        views_of_one_buffer = (key.data_ptr() == start + q_width * item
                               and value.data_ptr() == start + (q_width + kv_width) * item)
    if views_of_one_buffer:
        try:
            return torch.as_strided(query, (num_tokens, width), (width, 1))
        except RuntimeError:  # rows beyond query's storage: k and v live elsewhere after all
            pass
    return torch.cat([query.reshape(num_tokens, -1), key.reshape(num_tokens, -1),
                      value.reshape(num_tokens, -1)], dim=1).to(dtype)
