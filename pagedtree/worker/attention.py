"""Per-step attention metadata and the choice of attention backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedtree.kernels import reference

if TYPE_CHECKING:
    from pagedtree.kernels.triton_attention import TritonPagedAttention

ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    """How the step's flat run of query tokens maps onto requests and the paged cache."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B] KV entries each request sees after this step's writes
    block_tables: list[list[int]]  # [B][num_blocks of the request]
    tree_parents: list[list[int] | None]  # [B] None = causal among the new tokens


class TorchPagedAttention:
    """The pure-torch backend: one gather + SDPA per attention group and layer."""

    name = "torch"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.kv_caches = kv_caches
        self.scale = scale
        self._meta: AttentionMetadata | None = None
        self._plan: reference.ReferencePlan | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        """Build the gathers and masks shared by every layer of this step."""
        self._meta = meta
        self._plan = reference.build_reference_plan(
            meta.query_start_loc,
            meta.context_lens,
            meta.block_tables,
            meta.tree_parents,
            meta.block_size,
            device=meta.slot_mapping.device,
        )

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        assert self._meta is not None and self._plan is not None, "begin_step first"
        key_cache, value_cache = self.kv_caches[layer_index]
        reference.store_kv(key, value, key_cache, value_cache, self._meta.slot_mapping)
        return reference.paged_attention(query, key_cache, value_cache, self._plan, self.scale)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (copy-on-write) in every layer."""
        device = self.kv_caches[0][0].device
        reference.copy_blocks(
            self.kv_caches,
            torch.as_tensor(src, dtype=torch.long, device=device),
            torch.as_tensor(dst, dtype=torch.long, device=device),
        )

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy single token slots in every layer (compacting an accepted tree path)."""
        device = self.kv_caches[0][0].device
        reference.copy_slots(
            self.kv_caches,
            torch.as_tensor(src, dtype=torch.long, device=device),
            torch.as_tensor(dst, dtype=torch.long, device=device),
        )


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The concrete backend for ``name``: "auto" is Triton on CUDA, torch elsewhere.

    "triton" on CPU runs the kernels in Triton's interpreter (slow; for tests), which
    must be switched on with ``TRITON_INTERPRET=1`` before pagedtree is imported.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" and _triton_kernels_available() else "torch"
    if name == "triton":
        if not _triton_kernels_available():
            raise ValueError(
                "attention_backend='triton' needs Triton (pip install triton); "
                "it could not be imported, use attention_backend='torch'"
            )
        from pagedtree.kernels.triton_ops import check_device

        check_device(device)  # on CPU: a clear error unless TRITON_INTERPRET=1 was set in time
    return name


def _triton_kernels_available() -> bool:
    """Whether the Triton kernels import (Triton installed)."""
    try:
        import pagedtree.kernels.triton_attention  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(
    name: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float
) -> TorchPagedAttention | TritonPagedAttention:
    """Instantiate the backend called ``name`` ("auto" is resolved by the caches' device)."""
    if name == "auto" and kv_caches:
        name = resolve_backend_name(name, kv_caches[0][0].device)
    if name == "torch":
        return TorchPagedAttention(kv_caches, scale)
    if name != "triton":
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    from pagedtree.kernels.triton_attention import TritonPagedAttention

    return TritonPagedAttention(kv_caches, scale)
