"""Which weight format a model runs in when the caller does not say.

A GGUF file runs by default in a format that represents its own quantization
exactly, as llama.cpp runs the file it is given, when the engine runs on a CPU, one
rank, and ``dtype="auto"``. Everything else keeps its dtype: a safetensors model, a
GGUF file given an explicit ``dtype`` (dequantized to it), a GPU run, a
tensor-parallel run (its shards load from safetensors).

A single stream (``workload="stream"``, what ``LLM`` builds) runs in ``"ggml"``: the
file's blocks multiplied by ggml's kernels, llama.cpp's own, the 4-bit ones repacked
into the layout llama.cpp uses on the CPU, and each step's whole forward one ggml
graph (``worker/models/ggml_graph.py``). On the AVX-512 machine that runs one
stream at llama.cpp's speed (28-29 tokens/s for the Qwen2.5 1.5B on prose and code,
0.99-1.01x llama.cpp) in less memory than llama.cpp (1.6-1.7 GB), where q4 ran at 17
tokens/s and held 2.6 GB with the draft (benchmarks/RESULTS.md, "Prompts through
ggml 0.25's tiled GEMM" and "One stream as one ggml graph"). Without ggml
installed, a stream runs in ``"q4"`` (``gguf_blocks``: the file's 4-bit blocks as
4-bit codes, its 5- to 8-bit blocks as 8-bit codes, through ONNX Runtime's MLAS
kernels) where the memory for it is there (about ``Q4_BYTES_PER_FILE_BYTE`` times
the file).

A server is built for another load (``workload="batch"``): steps of 16 to 32
requests, which are compute bound. ggml's products grow with rows (each row's dot
products in the file's layout), q4's int8-activation products grow more slowly, and
a CPU with native bf16 runs them 1.5-1.8 times as fast in dense bf16. For that load
the default is dense weights (``"none"``) where a measured product of the model's
shape at the batch's rows says they win clearly and the memory for them is there
(``batch_format``); q4 otherwise (dense losing, as it may on a CPU without native
bf16 where dense means fp32), and ggml on a machine short of memory for q4.

``quantization="none"`` forces dense weights; ``"q4"``, ``"q8"``, ``"ggml"``,
``"int4"``, ``"int8"`` force those formats (``EngineConfig``; resolved in
``resolve.py``).
"""

from __future__ import annotations

import logging

import torch

from pagedtree.loading.loader import gguf_source

logger = logging.getLogger("pagedtree")


def block_quant_available() -> bool:
    """Whether the q4/q8 formats' libraries import (ONNX Runtime and onnx)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


# A q4 engine's resident bytes per byte of its GGUF file at the peak of its load (the
# Qwen2.5 1.5B's 1.1 GB Q4_K_M file: 2.4 GB beyond the runtime's own, 2.2 GB after it):
# ONNX Runtime's packed blocks hold about 1.9x the file's bytes (the offsets of K-quant
# blocks and 6-bit blocks widened to 8 bits included).
Q4_BYTES_PER_FILE_BYTE = 2.2


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's ``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_quantization(model: str | None, dtype: object, device: torch.device, tensor_parallel_size: int,
                         workload: str = "stream", max_num_seqs: int = 64,
                         dense_dtype: torch.dtype = torch.bfloat16) -> str:
    """The format a target runs in when ``quantization`` is unset (``"none"``: dense).
    A stream runs a GGUF in ggml where it is installed; ``workload="batch"`` weighs
    dense ``dense_dtype`` weights against q4 at ``min(max_num_seqs, BATCH_ROWS)`` rows
    (measured once per CPU, cached)."""
    if not (dtype == "auto" and tensor_parallel_size == 1 and device.type == "cpu"):
        return "none"
    gguf_file = gguf_source(model)
    if gguf_file is None:
        return "none"
    from pagedtree.worker.models.ggml_matmul import ggml_available

    if workload != "batch" and ggml_available():
        return "ggml"
    if workload == "batch" and block_quant_available() and _dense_serves_batches(model, gguf_file, max_num_seqs, dense_dtype):
        return "none"

    try:
        size = gguf_file.stat().st_size
    except OSError:  # a packaged model not assembled yet: its load says what is missing
        size = 0
    available = available_memory()
    fits = available is None or available >= Q4_BYTES_PER_FILE_BYTE * size
    if block_quant_available() and (fits or not ggml_available()):
        return "q4"
    return "ggml" if ggml_available() else "none"


def _dense_serves_batches(model: str | None, gguf_file, max_num_seqs: int, dense_dtype: torch.dtype) -> bool:
    """Whether dense ``dense_dtype`` weights fit in memory and run a batch's products
    clearly faster than q4 on this CPU (``batch_format``); logged either way. Sizes
    come from the model's config (the folder the load reads too), not a parse of the
    file."""
    from transformers import AutoConfig

    from pagedtree.loading import batch_format
    from pagedtree.loading.loader import gguf_config_folder
    from pagedtree.loading.offload_sizing import estimate_weight_bytes

    try:
        hf_config = AutoConfig.from_pretrained(str(gguf_config_folder(model, gguf_file)))
    except (OSError, ValueError):  # a file the load will report on
        return False
    if not batch_format.dense_fits(estimate_weight_bytes(hf_config, dense_dtype), available_memory()):
        logger.info("workload 'batch': q4 weights (dense %s weights would need more memory than is available)",
                    str(dense_dtype).removeprefix("torch."))
        return False
    timing = batch_format.batch_format_timing(batch_format.ModelShape.of(hf_config),
                                              min(max_num_seqs, batch_format.BATCH_ROWS), dense_dtype)
    logger.info("workload 'batch': %s weights (a %d-row product of this model's MLP: %.2f ms dense %s, %.2f ms q4)",
                "dense" if timing.dense_wins else "q4", timing.rows, timing.dense_seconds * 1e3,
                timing.dense_dtype, timing.q4_seconds * 1e3)
    return timing.dense_wins
