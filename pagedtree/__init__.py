"""pagedtree: an LLM inference engine with paged KV cache and tree speculative decoding."""

# Before any oneDNN operation runs in this process: bound its primitive caches.
from pagedtree.worker.host_allocator import bound_onednn_caches

bound_onednn_caches()

from pagedtree.config import EngineConfig, SpeculativeConfig  # noqa: E402
from pagedtree.engine.llm import LLM
from pagedtree.engine.llm_engine import LLMEngine
from pagedtree.outputs import CompletionOutput, RequestOutput
from pagedtree.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SpeculativeConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
