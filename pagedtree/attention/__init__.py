"""Attention over the paged KV cache: per-step metadata and the two backends.

- ``AttentionMetadata`` (in ``pagedtree.step_data``): what a forward tells its backend;
- ``torch_backend``: gathers + SDPA with causal and tree masks (the reference, and
  CPU caches the kernel does not take);
- ``cpu_backend``: a numba kernel that reads KV blocks in place (the CPU backend for
  fp32 and bf16 caches);
- ``triton_backend``: the Triton kernels of ``pagedtree.kernels`` (CUDA, or the
  interpreter in tests).

Every backend implements ``AttentionBackend`` (``backend.py``): ``begin_step(meta)``
once per forward, then ``backend(layer, q, k, v)`` per layer, plus ``copy_blocks``
and ``copy_slots``. ``BACKENDS`` names each one's class; a new backend is one file
and one line there.
"""

from __future__ import annotations

import importlib

import torch

from pagedtree.attention.backend import AttentionBackend
from pagedtree.attention.torch_backend import TorchPagedAttention

# name -> "module:class" of its backend, imported when first made (Triton and numba
# are optional).
BACKENDS = {
    "torch": "pagedtree.attention.torch_backend:TorchPagedAttention",
    "cpu": "pagedtree.attention.cpu_backend:CpuPagedAttention",
    "triton": "pagedtree.attention.triton_backend:TritonPagedAttention",
}
ATTENTION_BACKENDS = ("auto", *BACKENDS)


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The concrete backend for ``name`` and a KV cache of ``dtype``: "auto" is Triton on
    CUDA; on CPU the in-place kernel ("cpu") for fp32/bf16 when numba imports, else torch.

    "triton" on CPU runs the kernels in Triton's interpreter (slow; for tests), which
    must be switched on with ``TRITON_INTERPRET=1`` before pagedtree is imported.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type == "cuda":
            return "triton" if _triton_kernels_available() else "torch"
        return "cpu" if _cpu_kernel_available(dtype) else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPU only, not {device}")
        if not _cpu_kernel_available(dtype):
            raise ValueError(
                f"attention_backend='cpu' needs numba (pip install numba) and an fp32 or bf16 KV cache, got {dtype}"
            )
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


def _cpu_kernel_available(dtype: torch.dtype) -> bool:
    """Whether the numba kernel imports (numba installed) and takes ``dtype`` caches."""
    try:
        import pagedtree.kernels.cpu_attention  # noqa: F401  (imports numba)
    except ImportError:
        return False
    from pagedtree.attention.cpu_backend import supports_dtype

    return supports_dtype(dtype)


def make_backend(name: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> AttentionBackend:
    """Instantiate the backend called ``name`` ("auto" is resolved by the caches' device and dtype)."""
    if name == "auto" and kv_caches:
        name = resolve_backend_name(name, kv_caches[0][0].device, kv_caches[0][0].dtype)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(kv_caches, scale)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "BACKENDS", "TorchPagedAttention", "make_backend",
           "resolve_backend_name"]
