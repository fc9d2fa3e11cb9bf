"""Attention over the paged KV cache: per-step metadata and the backends.

- ``AttentionMetadata`` (in ``pagedtree.step_data``): what a forward tells its backend;
- ``torch_backend``: gathers + SDPA with causal and tree masks (the reference, and
  CPU caches the kernel does not take);
- ``cpu_backend``: a numba kernel that reads KV blocks in place (the CPU backend for
  fp32 and bf16 caches);
- ``triton_backend``: the Triton kernels of ``pagedtree.kernels`` (CUDA, or the
  interpreter in tests);
- ``flashinfer_backend``: FlashInfer's paged decode and prefill kernels (CUDA, by
  name only: eager steps, not batch-invariant), stores and copies through Triton.

Every backend implements ``AttentionBackend`` (``backend.py``): ``begin_step(meta)``
once per forward, then ``backend(layer, q, k, v)`` per layer, plus ``copy_blocks``
and ``copy_slots``, and says where it cannot run (``unavailable``). ``BACKENDS``
names each one's class and where "auto" may choose it, in the order "auto" prefers
them; a new backend is one file and one entry there.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from pagedtree.attention.backend import AttentionBackend
from pagedtree.attention.torch_backend import TorchPagedAttention


@dataclass(frozen=True, slots=True)
class BackendEntry:
    """Where a backend's class is, imported when first asked about (Triton and numba
    are optional), where "auto" may choose it, and what to install when it does not
    import."""

    target: str  # "module:class"
    auto_devices: tuple[str, ...]  # device types on which it is the default
    requires: str = ""


# "auto" takes the first, in this order, that may run on the device by default,
# imports and takes the cache.
BACKENDS = {
    "triton": BackendEntry("pagedtree.attention.triton_backend:TritonPagedAttention", ("cuda",),
                           "Triton (pip install triton)"),
    "cpu": BackendEntry("pagedtree.attention.cpu_backend:CpuPagedAttention", ("cpu",), "numba (pip install numba)"),
    "torch": BackendEntry("pagedtree.attention.torch_backend:TorchPagedAttention", ("cpu", "cuda")),
    "flashinfer": BackendEntry("pagedtree.attention.flashinfer_backend:FlashInferPagedAttention", (),
                               "Triton and FlashInfer (pip install flashinfer-python)"),
}
ATTENTION_BACKENDS = ("auto", *BACKENDS)


def backend_class(name: str) -> type[AttentionBackend] | None:
    """The backend class called ``name``, or None when its module does not import."""
    module, cls = BACKENDS[name].target.split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError:
        return None


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The concrete backend for ``name`` and a KV cache of ``dtype`` on ``device``:
    "auto" is the first of ``BACKENDS`` that may run there by default (Triton on
    CUDA; on CPU the in-place kernel for fp32/bf16 caches when numba imports; else
    torch); a named backend is checked, with an error that says what is missing.

    "triton" on CPU runs the kernels in Triton's interpreter (slow; for tests), which
    must be switched on with ``TRITON_INTERPRET=1`` before pagedtree is imported.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        for candidate, entry in BACKENDS.items():
            if device.type not in entry.auto_devices:
                continue  # not imported: Triton stays out of a CPU process
            cls = backend_class(candidate)
            if cls is not None and cls.unavailable(device, dtype) is None:
                return candidate
        raise ValueError(f"no attention backend runs a {dtype} KV cache on {device}")
    cls = backend_class(name)
    if cls is None:
        raise ValueError(f"attention_backend={name!r} needs {BACKENDS[name].requires}; it could not be imported, "
                         "use attention_backend='torch'")
    reason = cls.unavailable(device, dtype)
    if reason is not None:
        raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
    return name


def make_backend(name: str, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> AttentionBackend:
    """Instantiate the backend called ``name`` ("auto" is resolved by the caches' device and dtype)."""
    if name == "auto" and kv_caches:
        name = resolve_backend_name(name, kv_caches[0][0].device, kv_caches[0][0].dtype)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    cls = backend_class(name)
    if cls is None:
        raise ValueError(f"attention_backend={name!r} needs {BACKENDS[name].requires}; it could not be imported")
    return cls(kv_caches, scale)


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "BACKENDS", "TorchPagedAttention", "backend_class",
           "make_backend", "resolve_backend_name"]
