"""Which weight format a model runs in when the caller does not say.

A GGUF file runs by default in the format that represents its own quantization
exactly, as llama.cpp runs the file it is given: ``"q4"`` (``gguf_blocks``: the
file's 4-bit blocks as 4-bit codes, its 5- to 8-bit blocks as 8-bit codes, through
ONNX Runtime's MLAS kernels) when the engine runs on a CPU with ONNX Runtime
installed, one rank, and ``dtype="auto"``. Everything else keeps its dtype: a
safetensors model, a GGUF file given an explicit ``dtype`` (dequantized to it), a GPU
run, a tensor-parallel run (its shards load from safetensors).

``quantization="none"`` forces dense weights; ``"q4"``, ``"q8"``, ``"int4"``,
``"int8"`` force those formats (``EngineConfig``).
"""

from __future__ import annotations

import dataclasses

from pagedtree.config import EngineConfig, block_quant_available
from pagedtree.loading.loader import gguf_source


def default_quantization(config: EngineConfig) -> str:
    """The quantization ``config`` runs its target in (``"none"``: dense)."""
    if config.quantization is not None:
        return config.quantization
    gguf = (config.dtype == "auto" and config.tensor_parallel_size == 1
            and config.resolve_device().type == "cpu" and gguf_source(config.model) is not None)
    return "q4" if gguf and block_quant_available() else "none"


def with_default_quantization(config: EngineConfig) -> EngineConfig:
    """``config`` with its quantization resolved (see ``default_quantization``)."""
    return dataclasses.replace(config, quantization=default_quantization(config))
