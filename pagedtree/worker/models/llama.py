"""Llama (and Mistral, SmolLM, ...): biases only where the config asks for them."""

from __future__ import annotations

from pagedtree.worker.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """Hugging Face ``LlamaForCausalLM`` on the paged cache."""

    @classmethod
    def spec_for(cls, config) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )
