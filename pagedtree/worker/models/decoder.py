"""A Llama-family decoder written against a paged KV cache.

Llama, Qwen2, Mistral and their relatives differ only in a few switches (biases on
the projections, tied embeddings, the rotary scaling), so one implementation serves
them all and each architecture file only states its switches. Parameter names
mirror Hugging Face's so checkpoints load without renaming.

Numerics follow transformers' implementation step for step (RMSNorm in fp32, rotary
tables computed in fp32) so greedy outputs match it token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedtree.worker.models.linear import Linear


@dataclass(slots=True, frozen=True)
class DecoderSpec:
    """The switches that tell one Llama-family architecture from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


class AttentionFn(Protocol):
    """Stores a layer's new keys/values in the paged cache and attends over it."""

    def __call__(
        self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """``query [T, H, D]``, ``key/value [T, H_kv, D]`` -> output ``[T, H, D]``."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 like transformers does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for arbitrary (e.g. tree-depth) positions."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK rope scaling depends on sequence length; not supported")
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, D]`` cos and sin tables for ``positions`` ``[T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by the tables ``cos/sin [T, D]`` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DecoderAttention(nn.Module):
    """Multi-head (grouped-query) self-attention over the paged cache."""

    def __init__(self, config, spec: DecoderSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        # One fused projection: a single larger GEMV per layer instead of three small
        # ones (checkpoints' q/k/v_proj load into its row blocks, see ``FUSED_SHARDS``).
        self.qkv_proj = Linear(hidden, sum(self.qkv_sizes), bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, hidden, bias=spec.o_bias)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attention(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class DecoderMLP(nn.Module):
    """Gated feed-forward block: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config, spec: DecoderSpec):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        # gate and up fused into one projection, like q/k/v (see ``FUSED_SHARDS``).
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=spec.mlp_bias)
        self.down_proj = Linear(inner, hidden, bias=spec.mlp_bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config, spec: DecoderSpec, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, spec)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderBody(nn.Module):
    """Embeddings, the stack of layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Checkpoint projections that this implementation stores fused: name -> (fused
# module, index of its row block).
FUSED_SHARDS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderForCausalLM(nn.Module):
    """A Llama-family causal LM over a flat (varlen) batch of tokens.

    Subclasses set ``spec_for(config)``; everything else is shared.
    """

    @classmethod
    def spec_for(cls, config) -> DecoderSpec:
        """The architecture switches for ``config`` (overridden per architecture)."""
        return DecoderSpec()

    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
        self.config = config
        spec = self.spec_for(config)
        self.model = DecoderBody(config, spec)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = self.model.layers[0].self_attn
        self.rotary = RotaryEmbedding(config, attn.head_dim)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        # Set by ``enable_fused_cpu_ops``: the forward with fused element-wise work.
        self.fused_forward = None

    def checkpoint_target(self, name: str) -> tuple[str, slice | None]:
        """Where checkpoint tensor ``name`` (Hugging Face naming) goes in this model.

        Returns the parameter name and, for the projections fused here, the block of
        rows the tensor fills (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` ->
        ``gate_up_proj``); ``None`` rows means the whole parameter.
        """
        module_path, _, leaf = name.rpartition(".")
        parent_path, _, proj = module_path.rpartition(".")
        if proj not in FUSED_SHARDS:
            return name, None
        fused, index = FUSED_SHARDS[proj]
        parent = self.get_submodule(parent_path)
        sizes = parent.qkv_sizes if fused == "qkv_proj" else (parent.down_proj.in_features,) * 2
        start = sum(sizes[:index])
        return f"{parent_path}.{fused}.{leaf}", slice(start, start + sizes[index])

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for flat ``input_ids [T]``."""
        if self.fused_forward is not None:
            return self.fused_forward.forward(input_ids, positions, attention)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, attention)
        return self.model.norm(hidden)

    def enable_fused_cpu_ops(self) -> bool:
        """Run the forward with numba-fused element-wise ops (``cpu_fused``) from now on.

        Returns whether it could: an fp32 or bf16 model on CPU with numba installed.
        """
        weight = self.model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        try:
            from pagedtree.worker.models.cpu_fused import FusedCpuForward
        except ImportError:  # numba is optional
            return False
        self.fused_forward = FusedCpuForward(self)
        return True

    def make_rows_consistent(self) -> int:
        """Make every token's result independent of how many tokens share its forward:
        one-row products of the oneDNN-packed layers run as two rows
        (``Linear.pad_single_rows``). Tree speculation needs it for greedy outputs equal
        to plain decoding in every dtype; returns how many layers it switched."""
        layers = [m for m in self.modules() if isinstance(m, Linear) and m.packed_weight is not None]
        for layer in layers:
            layer.pad_single_rows = True
        return len(layers)

    def quantize_weights(self, mode: str) -> int:
        """Weight-only ``mode`` ("int8"/"int4") for every linear layer; returns how many.

        A head tied to the embedding gets its own quantized copy (the embedding table
        stays dense for the lookups).
        """
        count = 0
        for module in self.modules():
            if isinstance(module, Linear) and module.weight is not None:
                module.quantize(mode)
                count += 1
        return count

    def pack_weights_for_cpu(self) -> int:
        """Prepack every dense linear layer's fp32/bf16 CPU weight for oneDNN (``Linear.pack_for_cpu``).

        Returns how many layers were packed (0 on other devices and dtypes).
        """
        return sum(module.pack_for_cpu() for module in self.modules() if isinstance(module, Linear))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for hidden states ``[N, hidden]``."""
        return self.lm_head(hidden)
