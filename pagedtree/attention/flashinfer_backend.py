"""The FlashInfer attention backend: FlashInfer's paged decode and prefill kernels
over the engine's own KV cache, beside the Triton kernels.

Attention per step: a step of one query per request runs FlashInfer's batch decode
(on tensor cores when a KV head serves ``TENSOR_CORE_GROUP`` query heads or more,
as FlashInfer advises for grouped-query attention); a step of prompt chunks runs its
causal batch prefill; a step with token trees its prefill with a custom mask (every
node sees the prefix, itself and its ancestors). The prefill is FlashInfer's FA2
kernel (backend "fa2"), which takes custom masks on every GPU FlashInfer supports;
the tensor-core decode is that kernel with one query a request. The indices are planned
once per step (``flashinfer_layout.paged_layout``), at the first layer, when the
query head count is known; every layer reuses the plan.

Stores and copies are the Triton backend's kernels (this class extends it): the new
keys and values go to their slots with the same store launch, and copy-on-write
block copies and the compaction of accepted tree paths are the same one-launch
copies, so the cache is the same bytes whichever backend attends.

What it does not do: CUDA graphs (its steps run eagerly; the engine captures graphs
for the Triton backend only) and batch invariance (FlashInfer picks its split-KV by
the batch, so a row's bits may differ between a decode and a verify step, and bf16
greedy speculation may then differ from plain decoding at a near-tie). It is chosen
by name (``attention_backend="flashinfer"``), never by "auto".
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from pagedtree.attention.triton_backend import TritonPagedAttention
from pagedtree.kernels import triton_ops
from pagedtree.kernels.attention_plan import validate_slots
from pagedtree.kernels.flashinfer_layout import DECODE, MASKED, PagedLayout, paged_layout

if TYPE_CHECKING:
    from pagedtree.step_data import AttentionMetadata, StaticShape

__all__ = ["FlashInferPagedAttention", "TENSOR_CORE_GROUP"]

# Query heads per KV head from which decode runs FlashInfer's tensor-core kernel
# (its prefill kernel with one query a request), which FlashInfer advises for
# grouped-query attention; below, its CUDA-core decode kernel.
TENSOR_CORE_GROUP = 4
# FlashInfer's float workspace (split-KV partials), the size its documentation advises.
WORKSPACE_BYTES = 128 << 20
_HEAD_DIMS = (64, 128, 256)


class FlashInferPagedAttention(TritonPagedAttention):
    """Paged (tree) attention through FlashInfer; stores and copies through Triton."""

    name = "flashinfer"

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """A CUDA device, a 16-bit cache and FlashInfer installed."""
        if device.type != "cuda":
            return "FlashInfer's kernels run on CUDA devices only"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"FlashInfer's kernels take float16 and bfloat16 caches, not {dtype}"
        if importlib.util.find_spec("flashinfer") is None:
            return "FlashInfer is not installed (pip install flashinfer-python)"
        return None

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
                 flashinfer_module=None, decode_tensor_cores: bool | None = None):
        """``flashinfer_module``: the module to call (default: ``import flashinfer``);
        ``decode_tensor_cores``: decode on tensor cores or not (None: from
        ``TENSOR_CORE_GROUP`` query heads per KV head)."""
        super().__init__(kv_caches, scale)
        if self.head_dim not in _HEAD_DIMS:
            raise ValueError(f"FlashInfer's kernels take head dims {_HEAD_DIMS}, not {self.head_dim}")
        if flashinfer_module is None:
            import flashinfer as flashinfer_module
        self._fi = flashinfer_module
        self.decode_tensor_cores = decode_tensor_cores
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode_wrappers: dict[bool, object] = {}
        self._prefill = flashinfer_module.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        self._layout: PagedLayout | None = None
        self._slot_mapping: torch.Tensor | None = None
        self._wrapper = None  # the step's planned wrapper (None: not planned yet)
        self._planned_heads = 0
        self.num_planned = 0
        self.kinds_planned: set[str] = set()  # which of FlashInfer's paths steps took

    def _decode_wrapper(self, tensor_cores: bool):
        wrapper = self._decode_wrappers.get(tensor_cores)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD",
                                                                  use_tensor_cores=tensor_cores, backend="fa2")
            self._decode_wrappers[tensor_cores] = wrapper
        return wrapper

    def begin_step(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0,
                   row_keys=None) -> None:
        """Check the step and lay it out for FlashInfer; the plan waits for the first
        layer (the query head count). A static (CUDA-graph) shape is refused."""
        if static is not None:
            raise ValueError("the FlashInfer backend runs steps eagerly; static (CUDA-graph) shapes are the "
                             "Triton backend's")
        if meta.block_size != self.block_size:
            raise ValueError(f"metadata block_size {meta.block_size} != KV cache block size {self.block_size}")
        layout = paged_layout(meta)
        if layout.kv_indices and (min(layout.kv_indices) < 0 or max(layout.kv_indices) >= self.num_blocks):
            raise ValueError(f"block tables hold blocks outside [0, {self.num_blocks})")
        validate_slots(meta.slot_mapping, layout.qo_indptr[-1], self.num_blocks * self.block_size, self.device,
                       meta.slot_bounds)
        self._layout, self._slot_mapping, self._wrapper = layout, meta.slot_mapping, None

    def build_plan(self, *args, **kwargs):
        """Refused: Triton plans of static (CUDA-graph) steps are the Triton backend's."""
        raise NotImplementedError("the FlashInfer backend plans its own steps; static plans are the Triton backend's")

    use_plan = plan_buffers = build_plan

    def _planned(self, num_heads: int):
        """The step's wrapper, planned for ``num_heads`` query heads (once a step)."""
        if self._wrapper is not None and self._planned_heads == num_heads:
            return self._wrapper
        layout = self._layout
        if layout is None:
            raise RuntimeError("begin_step must be called before attention")
        if num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {self.num_kv_heads} KV heads")
        dtype = self.kv_caches[0][0].dtype

        def ints(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        kv_indptr, last = ints(layout.kv_indptr), ints(layout.kv_last_page_len)
        kv_indices = ints(layout.kv_indices, self.device)
        if layout.kind == DECODE:
            tensor_cores = self.decode_tensor_cores
            if tensor_cores is None:
                tensor_cores = num_heads // self.num_kv_heads >= TENSOR_CORE_GROUP
            wrapper = self._decode_wrapper(tensor_cores)
            wrapper.plan(kv_indptr, kv_indices, last, num_heads, self.num_kv_heads, self.head_dim, self.block_size,
                         q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        else:
            wrapper = self._prefill
            mask, qo_indptr = None, ints(layout.qo_indptr)
            if layout.kind == MASKED:
                # FlashInfer packs a custom mask to bits on the GPU, from the index
                # pointers: they must sit on the mask's device (its plan reads them back).
                mask = torch.from_numpy(layout.custom_mask).to(self.device)
                qo_indptr, kv_indptr, last = (t.to(self.device) for t in (qo_indptr, kv_indptr, last))
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, num_heads, self.num_kv_heads,
                         self.head_dim, self.block_size, custom_mask=mask, causal=mask is None,
                         q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        self._wrapper, self._planned_heads = wrapper, num_heads
        self.num_planned += 1
        self.kinds_planned.add(layout.kind)
        return wrapper

    def __call__(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Store ``key``/``value`` ``[T, H_kv, D]`` and return attention of ``query`` ``[T, H, D]``."""
        key_cache, value_cache, slots = self.store_target(layer_index)
        triton_ops.store_kv(key, value, key_cache, value_cache, slots, slots_checked=True)
        return self.attend(layer_index, query)

    def store_target(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer_index``'s caches and the step's slots (range-checked in ``begin_step``)."""
        if self._slot_mapping is None:
            raise RuntimeError("begin_step must be called before attention")
        if not 0 <= layer_index < len(self.kv_caches):
            raise ValueError(f"layer_index {layer_index} outside [0, {len(self.kv_caches)})")
        key_cache, value_cache = self.kv_caches[layer_index]
        return key_cache, value_cache, self._slot_mapping

    def attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        """Attention of ``query`` ``[T, H, D]`` over layer ``layer_index``'s cache, the
        step's keys and values already stored."""
        key_cache, value_cache, _ = self.store_target(layer_index)
        if query.dim() != 3 or query.shape[2] != self.head_dim or query.dtype != key_cache.dtype:
            raise ValueError(f"query must be [T, H, {self.head_dim}] of {key_cache.dtype}, got "
                             f"{list(query.shape)} of {query.dtype}")
        wrapper = self._planned(query.shape[1])
        return wrapper.run(query.contiguous(), (key_cache, value_cache))
