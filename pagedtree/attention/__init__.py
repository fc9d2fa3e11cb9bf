"""Attention over the paged KV cache: per-step metadata and the two backends.

- ``metadata.AttentionMetadata``: what a forward tells its backend (plain data);
- ``torch_backend``: gathers + SDPA with causal and tree masks (the CPU backend);
- ``triton_backend``: the Triton kernels of ``pagedtree.kernels`` (CUDA, or the
  interpreter in tests).

Both backends have the same interface: ``begin_step(meta)`` once per forward, then
``backend(layer, q, k, v)`` per layer, plus ``copy_blocks`` and ``copy_slots``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedtree.attention.metadata import AttentionMetadata
from pagedtree.attention.torch_backend import TorchPagedAttention

if TYPE_CHECKING:
    from pagedtree.attention.triton_backend import TritonPagedAttention

ATTENTION_BACKENDS = ("auto", "torch", "triton")


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
        import pagedtree.attention.triton_backend  # noqa: F401
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
    from pagedtree.attention.triton_backend import TritonPagedAttention

    return TritonPagedAttention(kv_caches, scale)


__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "TorchPagedAttention", "make_backend", "resolve_backend_name"]
