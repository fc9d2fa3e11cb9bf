"""Qwen2 / Qwen2.5: a Llama with biases on the q, k and v projections."""

from __future__ import annotations

from pagedtree.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Hugging Face ``Qwen2ForCausalLM`` on the paged cache."""

    @classmethod
    def spec_for(cls, config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
