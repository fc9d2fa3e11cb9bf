"""pagedtree: an LLM inference engine with paged KV cache and tree speculative decoding."""

import sys

# OpenMP reads its wait policy once, when torch loads it: passive (threads sleep after
# a parallel region instead of spinning) unless the environment says otherwise. The
# q4/q8 layers run on ONNX Runtime's threads between torch's OpenMP regions, and
# spinning OpenMP threads held the cores they needed (the Qwen2.5 1.5B in q4: 252 ms a
# token instead of 56 on 2 cores); tensor-parallel ranks sharing cores likewise.
# Dense fp32/bf16 batches run about 5% faster with OMP_WAIT_POLICY=ACTIVE.
from pagedtree.process_env import set_default

if "torch" not in sys.modules:
    set_default("OMP_WAIT_POLICY", "PASSIVE")

# Before any oneDNN operation runs in this process: bound its primitive caches.
from pagedtree.host_memory import bound_onednn_caches  # noqa: E402

bound_onednn_caches()

from pagedtree.config import EngineConfig, SpeculativeConfig  # noqa: E402
from pagedtree.outputs import CompletionOutput, RequestOutput
from pagedtree.sampling_params import SamplingParams
from pagedtree.structured_params import StructuredOutputLimits, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SpeculativeConfig", "SamplingParams", "StructuredOutputsParams", "StructuredOutputLimits", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# The engine (transformers' models and tokenizers, the executor) loads on first use:
# ``python -m pagedtree.<tool>`` for a tool that needs no engine starts 3 s sooner.
_LAZY = {"LLM": "pagedtree.engine.llm", "LLMEngine": "pagedtree.engine.llm_engine"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagedtree' has no attribute {name!r}")
