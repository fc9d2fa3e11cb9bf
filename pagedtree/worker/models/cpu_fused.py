"""The decoder's forward on CPU with its element-wise work fused (numba kernels).

Same model, same weights, same linear layers and attention as
``DecoderForCausalLM.forward``; what changes is the glue between them. Each layer's
two residual adds + RMSNorms become two ``add_rms_norm_kernel`` calls that keep the
residual stream in one buffer updated in place (as vLLM's fused add-norm does), and
the rotary embedding of every query and key head is one ``rotary_kernel`` call in
place in the q/k/v projection's output. That replaces about 30 eager ops per layer
with 3 calls (benchmarks/RESULTS.md, "Fused element-wise ops on CPU").

Used for fp32 and bf16 models on CPU unless ``EngineConfig.enforce_eager`` is set;
quantized models run their activations in these dtypes too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pagedtree.host_memory import MMAP_THRESHOLD
from pagedtree.kernels.cpu_elementwise import add_rms_norm_kernel, add_rms_norm_serial, rotary_kernel, rotary_serial
from pagedtree.kernels.numba_arrays import as_kernel_array

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Steps of at most this many tokens run the element-wise kernels on the calling thread:
# waking the parallel pool between the linear layers' calls costs 60-100 us a call,
# more than the rows up to about 64 of them (2 cores, bf16, hidden 1536: the norm
# took 73 us serially and 110 in parallel at 32 rows, 116 and 132 at 64, 218 and 164
# at 128; the rotary kernel likewise). Decode batches and trees of up to 64 tokens.
SERIAL_MAX_TOKENS = 64
# A long step's MLP runs in slices of rows whose widest intermediate (the gate/up
# output, counted at 4 bytes a value: block-quantized layers produce fp32) stays under
# malloc's mmap threshold. Above it every such tensor is a fresh mapping that is
# page-faulted in and unmapped again, layer after layer: a 2048-token prefill of the
# 1.5B in bf16 spent 1.2 of its 8.4 s so (the SiLU and the product at a fifth of
# their speed, the gate/up product slowed by its output's faults). oneDNN's products
# cost the same per row from 256 rows up, so slicing costs nothing.
MLP_SLICE_BYTES = MMAP_THRESHOLD
MIN_MLP_SLICE_ROWS = 256


def _is_silu(act) -> bool:
    """Whether ``act`` computes ``F.silu`` (torch's module or transformers' ``ACT2FN["silu"]``,
    looked for only where something imported transformers' activations)."""
    activations = sys.modules.get("transformers.activations")
    return isinstance(act, (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU)))


def _norm_weight(norm) -> np.ndarray:
    """An RMSNorm's weight widened to fp32 (exact for bf16)."""
    return norm.weight.detach().float().contiguous().numpy()


@dataclass(slots=True, frozen=True)
class _LayerParts:
    """One decoder layer as the fused forward calls it: its linear layers' and the
    activation's ``forward`` bound once (no ``nn.Module.__call__`` or attribute
    lookups per step; pagedtree registers no hooks), and its shapes."""

    layer_index: int
    input_norm: np.ndarray
    post_norm: np.ndarray
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    silu: bool  # the activation is SiLU (applied in place)
    mlp_slice_rows: int  # rows per MLP slice (see MLP_SLICE_BYTES)
    qkv_sizes: tuple[int, int, int]
    num_heads: int
    num_kv_heads: int
    head_dim: int


class FusedCpuForward:
    """``model.forward`` with fused add + RMSNorm and in-place rotary (see module docstring)."""

    def __init__(self, model):
        body = model.model
        dtype = body.embed_tokens.weight.dtype
        if dtype not in SUPPORTED_DTYPES or body.embed_tokens.weight.device.type != "cpu":
            raise ValueError(f"fused CPU ops need an fp32 or bf16 model on CPU, got {dtype}")
        self.model = model
        self.reduce = model.reduce  # the row-parallel partial sums over the ranks (tensor parallelism)
        self.bf16 = dtype == torch.bfloat16
        self.eps = float(body.norm.eps)
        self.layers = [
            _LayerParts(
                layer_index=layer.self_attn.layer_index,
                input_norm=_norm_weight(layer.input_layernorm),
                post_norm=_norm_weight(layer.post_attention_layernorm),
                qkv=layer.self_attn.qkv_proj.forward,
                o=layer.self_attn.o_proj.forward,
                gate_up=layer.mlp.gate_up_proj.forward,
                down=layer.mlp.down_proj.forward,
                act=layer.mlp.act.forward,
                silu=_is_silu(layer.mlp.act),
                mlp_slice_rows=max(MIN_MLP_SLICE_ROWS, MLP_SLICE_BYTES // (4 * layer.mlp.gate_up_proj.out_features)),
                qkv_sizes=tuple(layer.self_attn.qkv_sizes),
                num_heads=layer.self_attn.num_heads,
                num_kv_heads=layer.self_attn.num_kv_heads,
                head_dim=layer.self_attn.head_dim,
            )
            for layer in body.layers
        ]
        self.final_weight = _norm_weight(body.norm)
        self._warm_up(dtype)

    def _warm_up(self, dtype: torch.dtype) -> None:
        """Compile the kernels for this dtype (or load them from numba's disk cache) at
        load time rather than inside the first step."""
        attn = self.model.model.layers[0].self_attn
        hidden = self.final_weight.shape[0]
        qkv = torch.zeros(1, sum(attn.qkv_sizes), dtype=dtype)
        table = np.zeros((1, attn.head_dim), dtype=np.float32)
        for norm, rotary in ((add_rms_norm_serial, rotary_serial), (add_rms_norm_kernel, rotary_kernel)):
            residual = torch.zeros(1, hidden, dtype=dtype)
            norm(as_kernel_array(residual.clone()), as_kernel_array(residual), self.final_weight,
                 as_kernel_array(torch.empty_like(residual)), self.eps, True, self.bf16)
            rotary(as_kernel_array(qkv), table, table, attn.num_heads + attn.num_kv_heads, attn.head_dim, self.bf16)

    def _add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
        """``residual += x`` in place (unless ``x`` is None); returns the normed residual."""
        out = torch.empty_like(residual)
        x_array = as_kernel_array(x.contiguous()) if x is not None else as_kernel_array(residual)
        kernel = add_rms_norm_serial if residual.shape[0] <= SERIAL_MAX_TOKENS else add_rms_norm_kernel
        kernel(x_array, as_kernel_array(residual), weight, as_kernel_array(out), self.eps, x is not None, self.bf16)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, as ``DecoderForCausalLM.forward``."""
        model = self.model
        residual = model.model.embed_tokens(input_ids).contiguous()  # a fresh buffer, updated in place
        cos, sin = model.rotary.cos_sin(positions, residual.dtype)
        cos32 = cos.float().contiguous().numpy()
        sin32 = sin.float().contiguous().numpy()
        x: torch.Tensor | None = None
        rotary = rotary_serial if residual.shape[0] <= SERIAL_MAX_TOKENS else rotary_kernel
        parts = self.layers
        if self.model.layer_streamer is not None:  # layers whose weights are streamed in
            parts = self.model.layer_streamer.layers(parts, [part.layer_index for part in parts])
        for part in parts:
            normed = self._add_rms_norm(x, residual, part.input_norm)
            num_tokens = normed.shape[0]
            qkv = part.qkv(normed).contiguous()
            rotary(as_kernel_array(qkv), cos32, sin32, part.num_heads + part.num_kv_heads, part.head_dim, self.bf16)
            q, k, v = qkv.split(part.qkv_sizes, dim=-1)
            out = attention(
                part.layer_index,
                q.view(num_tokens, part.num_heads, part.head_dim),
                k.view(num_tokens, part.num_kv_heads, part.head_dim),
                v.view(num_tokens, part.num_kv_heads, part.head_dim),
            )
            x = self.reduce(part.o(out.reshape(num_tokens, part.num_heads * part.head_dim)))
            normed = self._add_rms_norm(x, residual, part.post_norm)
            x = self.reduce(self._mlp(part, normed))
        return self._add_rms_norm(x, residual, self.final_weight)

    @staticmethod
    def _mlp_rows(part: _LayerParts, normed: torch.Tensor) -> torch.Tensor:
        """``down(act(gate) * up)`` of some rows; SiLU and the product in place in the
        gate/up output (no new activation-sized tensors; same values as out of place)."""
        gate, up = part.gate_up(normed).chunk(2, dim=-1)
        if part.silu:
            gate = torch.nn.functional.silu(gate, inplace=True)
        else:
            gate = part.act(gate)
        return part.down(gate.mul_(up))

    def _mlp(self, part: _LayerParts, normed: torch.Tensor) -> torch.Tensor:
        """The layer's MLP, in slices of ``part.mlp_slice_rows`` rows (see ``MLP_SLICE_BYTES``)."""
        rows, step = normed.shape[0], part.mlp_slice_rows
        if rows <= step:
            return self._mlp_rows(part, normed)
        out = torch.empty_like(normed)
        for start in range(0, rows, step):
            out[start:start + step] = self._mlp_rows(part, normed[start:start + step])
        return out
