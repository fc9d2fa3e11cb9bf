"""Which weight format a model runs in when the caller does not say.

A GGUF file runs by default in the format that represents its own quantization
exactly, as llama.cpp runs the file it is given: ``"q4"`` (``gguf_blocks``: the
file's 4-bit blocks as 4-bit codes, its 5- to 8-bit blocks as 8-bit codes, through
ONNX Runtime's MLAS kernels) when the engine runs on a CPU with ONNX Runtime
installed, one rank, and ``dtype="auto"``. Everything else keeps its dtype: a
safetensors model, a GGUF file given an explicit ``dtype`` (dequantized to it), a GPU
run, a tensor-parallel run (its shards load from safetensors).

``quantization="none"`` forces dense weights; ``"q4"``, ``"q8"``, ``"int4"``,
``"int8"`` force those formats (``EngineConfig``; resolved in ``resolve.py``).
"""

from __future__ import annotations

import torch

from pagedtree.loading.loader import gguf_source


def block_quant_available() -> bool:
    """Whether the q4/q8 formats' libraries import (ONNX Runtime and onnx)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def default_quantization(model: str | None, dtype: object, device: torch.device, tensor_parallel_size: int) -> str:
    """The format a target runs in when ``quantization`` is unset (``"none"``: dense)."""
    gguf = (dtype == "auto" and tensor_parallel_size == 1 and device.type == "cpu"
            and gguf_source(model) is not None)
    return "q4" if gguf and block_quant_available() else "none"
