"""The Triton attention backend: same interface as ``TorchPagedAttention``.

Importing this module raises ImportError when Triton is not installed. On CPU the
kernels run in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set before
the first import of this module; otherwise creating the backend on CPU raises a
ValueError that says so.

Per step: ``begin_step`` validates the metadata and uploads it once (block tables,
query offsets, context lengths, ancestor bitmasks of token trees) into reused
device buffers. Per layer: one store launch writes the new keys and values, one
attention launch serves every request of the batch (plus a small reduce launch
when split-KV is on).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from pagedtree.attention.backend import AttentionBackend
from pagedtree.devices import same_device
from pagedtree.kernels import triton_ops
from pagedtree.kernels.attention_plan import KernelPlan, PlanBuffers, build_kernel_plan
from pagedtree.kernels.triton_kernels import INTERPRETED

if TYPE_CHECKING:
    from pagedtree.step_data import AttentionMetadata, StaticShape

__all__ = ["INTERPRETED", "TritonPagedAttention"]


class TritonPagedAttention(AttentionBackend):
    """Paged (tree) attention through Triton kernels; one attention launch per layer."""

    name = "triton"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """CUDA devices, or a CPU under the interpreter (``triton_ops.check_device``)."""
        try:
            triton_ops.check_device(device)
        except ValueError as exc:
            return str(exc)
        return None

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0][0]
        for key_cache, value_cache in kv_caches:
            triton_ops.check_cache(key_cache, value_cache)
            if (key_cache.shape != first.shape or key_cache.dtype != first.dtype
                    or not same_device(key_cache.device, first.device)):
                raise ValueError("every layer's KV cache must have the same shape, dtype and device")
            if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
                raise ValueError("KV caches must be contiguous (block copies address them as rows)")
        triton_ops.check_device(first.device)
        super().__init__(kv_caches, scale)
        self.device = first.device
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = first.shape
        self._buffers = PlanBuffers(self.device)
        self._plan: KernelPlan | None = None
        # Every layer's key and value cache, for the all-layers copy launches.
        self._flat_caches = [c for pair in kv_caches for c in pair]
        self._cache_table = triton_ops.pointer_table(self._flat_caches, self.device)

    def begin_step(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0,
                   row_keys: Sequence[Hashable | None] | None = None) -> None:
        """Validate the step and upload its metadata once for every layer.

        With ``static`` (a padded decode or verify step that a CUDA graph replays), the plan
        has that fixed shape and its program tiles for ``num_heads`` query heads are
        uploaded here too, so the layers' launches upload nothing; its block tables
        live on the device between steps and only their changes go up (``row_keys``:
        the request each row holds, so rows that moved are copied on the device).
        """
        self._plan = self.build_plan(meta, static, num_heads, row_keys)

    def build_plan(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0,
                   row_keys: Sequence[Hashable | None] | None = None,
                   buffers: PlanBuffers | None = None) -> KernelPlan:
        """``begin_step``'s plan, uploaded into ``buffers`` (default: the backend's
        own) and returned without becoming the current one (``use_plan``): the
        levels of a whole-draft CUDA graph each keep a plan in buffers of their own."""
        if meta.block_size != self.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != KV cache block size {self.block_size}")
        plan = build_kernel_plan(meta, self.num_blocks, buffers or self._buffers, static, row_keys)
        if static is not None:
            if num_heads < 1:
                raise ValueError("a static step needs the number of query heads")
            tile = triton_ops.default_tile_shape(plan, num_heads, self.num_kv_heads, self.device, self.head_dim,
                                                 self._flat_caches[0].element_size())
            plan.tiles(tile.block_q, tile.first_query())
            triton_ops.step_split_count(plan, tile, num_heads // self.num_kv_heads, self.num_kv_heads, self.device,
                                        self.head_dim, self._flat_caches[0].element_size())
        return plan

    def use_plan(self, plan: KernelPlan) -> None:
        """Make ``plan`` (from ``build_plan``) the one the layers' launches read."""
        self._plan = plan

    def plan_buffers(self) -> PlanBuffers:
        """A fresh set of plan buffers on the cache's device (for ``build_plan``)."""
        return PlanBuffers(self.device)

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Store ``key``/``value`` ``[T, H_kv, D]`` and return attention of ``query`` ``[T, H, D]``."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("begin_step must be called before attention")
        if not 0 <= layer_index < len(self.kv_caches):
            raise ValueError(f"layer_index {layer_index} outside [0, {len(self.kv_caches)})")
        key_cache, value_cache = self.kv_caches[layer_index]
        triton_ops.store_kv(key, value, key_cache, value_cache, plan.slot_mapping, slots_checked=True)
        return triton_ops.unified_attention(query, key_cache, value_cache, plan, self.scale)

    def store_target(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer_index``'s caches and the step's slots (range-checked in
        ``begin_step``): the fused rotary kernel stores the new keys and values."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("begin_step must be called before attention")
        key_cache, value_cache = self.kv_caches[layer_index]
        return key_cache, value_cache, plan.slot_mapping

    def attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        """Attention of ``query`` ``[T, H, D]`` over layer ``layer_index``'s cache, the
        step's keys and values already stored (``store_target``)."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("begin_step must be called before attention")
        key_cache, value_cache = self.kv_caches[layer_index]
        return triton_ops.unified_attention(query, key_cache, value_cache, plan, self.scale)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` (copy-on-write) in every layer, one launch."""
        row = self.block_size * self.num_kv_heads * self.head_dim
        triton_ops.copy_rows(self._flat_caches, self._cache_table, self.num_blocks, row, src, dst)

    def check_block_copy(self, src: list[int], dst: list[int]) -> None:
        """Refuse block copies ``copy_blocks_on_device`` could not take: ids outside
        the cache (its scratch block included), repeated destinations, or a block
        both read and written."""
        triton_ops.check_copy(self.num_blocks, src, dst)
        if not set(src).isdisjoint(dst):
            raise ValueError(f"block copies read blocks they write: {src} -> {dst}")

    def copy_blocks_on_device(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``copy_blocks`` with the ids on the device (int64, checked on the host by
        ``check_block_copy``): one launch, no upload (a CUDA graph can hold it)."""
        row = self.block_size * self.num_kv_heads * self.head_dim
        triton_ops.copy_rows_on_device(self._flat_caches, self._cache_table, row, src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy token slots ``src[i] -> dst[i]`` in every layer (compacting an accepted tree path).

        All sources are read before any destination is written, as in the reference.
        """
        row = self.num_kv_heads * self.head_dim
        triton_ops.copy_rows(
            self._flat_caches, self._cache_table, self.num_blocks * self.block_size, row, src, dst
        )
