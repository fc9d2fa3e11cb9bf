"""Model architectures, looked up by the ``architectures`` entry of a HF config.

Adding a Llama-family architecture is one small file that states its
``DecoderSpec`` switches, plus a line here.
"""

from __future__ import annotations

from pagedtree.worker.models.decoder import DecoderForCausalLM
from pagedtree.worker.models.llama import LlamaForCausalLM
from pagedtree.worker.models.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class_for(config) -> type[DecoderForCausalLM]:
    """The implementation for ``config.architectures[0]`` (or its ``model_type``)."""
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    by_type = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    model_type = getattr(config, "model_type", None)
    if model_type in by_type:
        return by_type[model_type]
    raise ValueError(
        f"unsupported architecture {names or model_type!r}; supported: {sorted(MODEL_REGISTRY)}"
    )
