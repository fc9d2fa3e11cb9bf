"""The decoder's forward on a GPU with batch-invariant, fused Triton kernels.

Same model, same weights, same attention as ``DecoderForCausalLM.forward``; every
product (the LM head too) goes through ``dense_ops.invariant_linear``, whose
per-layer ``MatmulConfig`` fixes each row's summation order, and the glue is fused:

- the residual add and the RMSNorm: one ``add_rms_norm`` call, the residual stream
  one buffer updated in place (one program a row: a row's norm never depends on the
  batch);
- the rotary embedding of every query and key head and the keys' and values' store
  into the paged cache: in the q/k/v product's epilogue, which takes one head a
  column tile (head dims of 16 to 128; others take a ``rotary_store`` launch after
  the product, the same bits); the attention backend then only attends;
- SiLU(gate) * up: in the gate/up product's epilogue.

A layer is 5 launches plus attention's (about 50 eager ops before), and a token's
result is the same bits in a one-token decode, a 65-token tree or a batch of
either, without padding: what greedy speculation needs to equal plain decoding in
16-bit types, at the cost of one row rather than a padded block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedtree.kernels import dense_ops
from pagedtree.kernels.dense_ops import MatmulConfig

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(slots=True, frozen=True)
class _Product:
    """One linear layer as the fused forward calls it."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    config: MatmulConfig

    def __call__(self, x: torch.Tensor, rotary: dense_ops.RotaryEpilogue | None = None) -> torch.Tensor:
        return dense_ops.invariant_linear(x, self.weight, self.bias, self.config, rotary=rotary)


def product(linear, device_kind: tuple[int, int], gated: bool = False,
            config: MatmulConfig | None = None) -> _Product:
    """``linear`` (a dense ``Linear``) as a batch-invariant product on a GPU of
    ``device_kind`` (SMs, compute capability); ``config``: a shape other than the
    layer's default (the q/k/v projection's, ``dense_ops.qkv_config``)."""
    weight = linear.weight
    if weight is None or weight.dim() != 2:
        raise ValueError("the fused GPU forward needs dense linear weights")
    n_out = weight.shape[0] // 2 if gated else weight.shape[0]
    if config is None:
        config = dense_ops.matmul_config(n_out, weight.shape[1], gated, weight.dtype, *device_kind)
    bias = linear.bias.detach() if linear.bias is not None else None
    return _Product(weight.detach(), bias, config)


def qkv_product(attn, device_kind: tuple[int, int]) -> _Product:
    """The q/k/v projection of attention module ``attn``, one head a column tile where
    its epilogue can rotate (``dense_ops.qkv_config``)."""
    plain = product(attn.qkv_proj, device_kind)  # (checks the weight)
    config = dense_ops.qkv_config(attn.num_heads, attn.num_kv_heads, attn.head_dim, plain.config.k,
                                  plain.weight.dtype, *device_kind)
    return _Product(plain.weight, plain.bias, config)


@dataclass(slots=True, frozen=True)
class _LayerParts:
    """One decoder layer's weights and shapes, bound once."""

    layer_index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: _Product
    o: _Product
    gate_up: _Product
    down: _Product
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotates: bool  # the q/k/v product's epilogue rotates and stores (else a rotary_store launch)


def supports(model) -> str | None:
    """Why the fused GPU forward cannot run ``model`` (None: it can)."""
    weight = model.model.embed_tokens.weight
    if weight.dtype not in SUPPORTED_DTYPES:
        return f"a {weight.dtype} model"
    if model.config.hidden_act not in ("silu", "swish"):
        return f"the {model.config.hidden_act} activation (the gated product fuses SiLU)"
    head_dim = model.head_dim
    if head_dim & (head_dim - 1) or head_dim < 16:
        return f"head dim {head_dim} (the rotary kernel takes powers of two)"
    linears = [model.lm_head] + [m for layer in model.model.layers
                                 for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if any(m.weight is None or m.quantization is not None for m in linears):
        return "quantized or packed linear layers"
    return None


class FusedGpuForward:
    """``model.forward`` and its logits through the batch-invariant kernels (see module docstring)."""

    def __init__(self, model):
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"the fused GPU forward cannot run {reason}")
        body = model.model
        device = body.embed_tokens.weight.device
        dense_ops.check_kernel_device(device)
        kind = dense_ops.device_kind(device)
        self.model = model
        self.reduce = model.reduce  # the row-parallel partial sums over the ranks (tensor parallelism)
        self.eps = float(body.norm.eps)
        self.layers = [
            _LayerParts(
                layer_index=layer.self_attn.layer_index,
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=qkv_product(layer.self_attn, kind),
                o=product(layer.self_attn.o_proj, kind),
                gate_up=product(layer.mlp.gate_up_proj, kind, gated=True),
                down=product(layer.mlp.down_proj, kind),
                num_heads=layer.self_attn.num_heads,
                num_kv_heads=layer.self_attn.num_kv_heads,
                head_dim=layer.self_attn.head_dim,
                rotates=dense_ops.rotates_in_epilogue(layer.self_attn.head_dim),
            )
            for layer in body.layers
        ]
        self.final_norm = body.norm.weight.detach()
        self.head = product(model.lm_head, kind)
        # Every position's [cos | sin] row, made by the eager forward's own function
        # (the same values), looked up by the rotary kernel.
        positions = int(getattr(model.config, "max_position_embeddings", 4096))
        cos, sin = model.rotary.cos_sin(torch.arange(positions, device=device), body.embed_tokens.weight.dtype)
        self.cos_sin = torch.cat((cos, sin), dim=-1).contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, as ``DecoderForCausalLM.forward``."""
        residual = self.model.model.embed_tokens(input_ids).contiguous()  # a fresh buffer, updated in place
        x: torch.Tensor | None = None
        parts = self.layers
        if self.model.layer_streamer is not None:  # layers whose weights are streamed in
            parts = self.model.layer_streamer.layers(parts, [part.layer_index for part in parts])
        for part in parts:
            normed = dense_ops.add_rms_norm(x, part.input_norm, self.eps, residual) if x is not None else \
                dense_ops.add_rms_norm(residual, part.input_norm, self.eps)
            t = normed.shape[0]
            q_size = part.num_heads * part.head_dim
            kv_size = part.num_kv_heads * part.head_dim
            target = attention.store_target(part.layer_index)
            # The keys and values go to the cache with the rotation when the backend
            # lets the caller store them; else the backend stores them.
            rotary = dense_ops.RotaryEpilogue(positions, self.cos_sin, part.num_heads, part.num_kv_heads,
                                              part.head_dim, *((target[2], target[0], target[1]) if target else ()))
            if part.rotates:  # one head a column tile: the product's epilogue rotates
                qkv = part.qkv(normed, rotary)
            else:
                qkv = part.qkv(normed)
                dense_ops.rotary_store(qkv, rotary.positions, rotary.cos_sin, rotary.num_heads, rotary.num_kv_heads,
                                       rotary.head_dim, rotary.slot_mapping, rotary.key_cache, rotary.value_cache)
            if target is not None:
                out = attention.attend(part.layer_index, qkv[:, :q_size].view(t, part.num_heads, part.head_dim))
            else:
                q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
                out = attention(part.layer_index, q.view(t, part.num_heads, part.head_dim),
                                k.view(t, part.num_kv_heads, part.head_dim),
                                v.view(t, part.num_kv_heads, part.head_dim))
            x = self.reduce(part.o(out.reshape(t, q_size)))
            normed = dense_ops.add_rms_norm(x, part.post_norm, self.eps, residual)
            x = self.reduce(part.down(part.gate_up(normed)))
        if x is None:
            return dense_ops.add_rms_norm(residual, self.final_norm, self.eps)
        return dense_ops.add_rms_norm(x, self.final_norm, self.eps, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's product of ``hidden [N, hidden]`` (this rank's vocabulary rows)."""
        return self.head(hidden)
