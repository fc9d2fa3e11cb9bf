"""A Llama-family decoder written against a paged KV cache.

Llama, Qwen2, Mistral and their relatives differ only in a few switches (biases on
the projections, tied embeddings, the rotary scaling), so one implementation serves
them all and each architecture file only states its switches. Parameter names
mirror Hugging Face's so checkpoints load without renaming.

Numerics follow transformers' implementation step for step (RMSNorm in fp32, rotary
tables computed in fp32) so greedy outputs match it token for token.

Under tensor parallelism (``pagedtree.distributed``) the same classes hold one rank's
slice (``ShardLayout``): fewer heads, MLP features and vocabulary rows, an
all-reduce after each row-parallel projection (o_proj, down_proj) and after the
vocabulary-parallel embedding lookup, and the logits gathered on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedtree.distributed.group import TensorParallelGroup
from pagedtree.distributed.layout import ShardLayout
from pagedtree.worker.models.linear import Linear
from pagedtree.worker.models.row_blocks import in_row_blocks

Reduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


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
        # Reduce in blocks of exactly this many rows (``row_blocks``; set by
        # ``make_rows_consistent`` on CUDA, where the reduction's strategy follows the
        # row count).
        self.row_block: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_block is not None:
            rows = in_row_blocks(x.reshape(-1, x.shape[-1]), self.row_block, self._normalize)
            return rows.view(x.shape)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
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
            # Computed on the CPU even while a model is built on the meta device (the
            # loader builds the table again once the weights are in): a meta arange runs
            # through torch's reference implementations, which import TorchDynamo and
            # Triton (about 94 MiB resident) for nothing.
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            if torch.get_default_device().type != "meta":
                inv_freq = inv_freq.to(torch.get_default_device())
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


def head_dim_of(config) -> int:
    """The attention head size of a Llama-family ``config``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    """Multi-head (grouped-query) self-attention over the paged cache (this rank's heads)."""

    def __init__(self, config, spec: DecoderSpec, layer_index: int, layout: ShardLayout):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = len(layout.q_heads)
        self.num_kv_heads = len(layout.kv_heads)
        self.head_dim = head_dim_of(config)
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
    """Gated feed-forward block: ``down(act(gate(x)) * up(x))`` (this rank's features)."""

    def __init__(self, config, spec: DecoderSpec, layout: ShardLayout):
        super().__init__()
        hidden, inner = config.hidden_size, len(layout.intermediate)
        # gate and up fused into one projection, like q/k/v (see ``FUSED_SHARDS``).
        self.gate_up_proj = Linear(hidden, 2 * inner, bias=spec.mlp_bias)
        self.down_proj = Linear(inner, hidden, bias=spec.mlp_bias)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


# transformers' activations by name, as torch modules that compute the same values:
# ``transformers.activations`` imports its kernel hub and, through it, torch's DTensor
# and sympy (52 MiB resident in an engine that uses none of them).
_TORCH_ACTIVATIONS = {
    "silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU,
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
}


def activation(name: str) -> nn.Module:
    """The MLP activation a config names (``hidden_act``): torch's module where it
    computes what transformers' does, transformers' own otherwise."""
    if name in _TORCH_ACTIVATIONS:
        return _TORCH_ACTIVATIONS[name]()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class DecoderLayer(nn.Module):
    """Pre-norm transformer block; ``reduce`` sums the row-parallel outputs over the ranks."""

    def __init__(self, config, spec: DecoderSpec, layer_index: int, layout: ShardLayout, reduce: Reduce):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, layer_index, layout)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, spec, layout)
        self.reduce = reduce

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        hidden = hidden + self.reduce(self.self_attn(self.input_layernorm(hidden), cos, sin, attention))
        return hidden + self.reduce(self.mlp(self.post_attention_layernorm(hidden)))


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding, or one rank's rows ``vocab`` of it: ids outside them look
    up zeros and the all-reduce (``reduce``) fills each row from the rank that holds it."""

    # The table in a GGUF's own blocks (``ggml_rows``; unsharded "ggml" models): then
    # ``weight`` is an empty ``[0, hidden]`` tensor that only names the model's dtype.
    quantized_rows = None

    def __init__(self, vocab: range, hidden_size: int, reduce: Reduce | None):
        super().__init__(len(vocab), hidden_size)
        self.first = vocab.start
        self.reduce = reduce

    def reset_parameters(self) -> None:
        # A table built on the meta device is loaded next: its random initialisation
        # would run through torch's reference kernels, whose first use imports
        # TorchDynamo and Triton (about 94 MiB resident) for nothing.
        if not self.weight.is_meta:
            super().reset_parameters()

    def set_quantized_rows(self, rows, dtype: torch.dtype) -> None:
        """Look rows up in ``rows`` (a ``GgmlRows`` table) instead of a dense table,
        returned in ``dtype`` (drops the dense weight)."""
        if self.reduce is not None:
            raise ValueError("a quantized embedding needs an unsharded model")
        if (rows.n, rows.k) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"an embedding table of {(rows.n, rows.k)} for {(self.num_embeddings, self.embedding_dim)}")
        self.quantized_rows = rows
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_rows is not None:
            return self.quantized_rows(input_ids).to(self.weight.dtype)
        if self.reduce is None:
            return super().forward(input_ids)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.reduce(rows.masked_fill_(outside[:, None], 0))


class DecoderBody(nn.Module):
    """Embeddings, the stack of layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config, spec: DecoderSpec, layout: ShardLayout, reduce: Reduce):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            layout.vocab, config.hidden_size, reduce if layout.is_sharded else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, layout, reduce) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass(frozen=True, slots=True)
class CheckpointTarget:
    """Where a checkpoint tensor goes in this model (one rank's model under tensor
    parallelism).

    ``rows`` is the block of the parameter's rows it fills (None: the whole
    parameter); ``source`` what this rank reads of the checkpoint tensor (``()``:
    all of it; a tuple of slices per dimension otherwise; None: nothing, the
    destination is zeros: a row-parallel bias is added by rank 0 alone).
    """

    param: str
    rows: slice | None = None
    source: tuple[slice, ...] | None = ()


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

    def __init__(self, config, layout: ShardLayout | None = None, group: TensorParallelGroup | None = None):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
        self.config = config
        self.layout = layout or ShardLayout.whole(config)
        if self.layout.is_sharded and (group is None or group.size != self.layout.size):
            raise ValueError("a sharded model needs its tensor-parallel group")
        self.group = group if self.layout.is_sharded else None
        # Sums the row-parallel layers' partial outputs over the ranks.
        self.reduce: Reduce = self.group.all_reduce if self.group is not None else _no_reduce
        spec = self.spec_for(config)
        self.model = DecoderBody(config, spec, self.layout, self.reduce)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, len(self.layout.vocab), bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Token ids the head computes (None: all); see ``keep_head_rows``.
        self.head_rows: torch.Tensor | None = None
        attn = self.model.layers[0].self_attn
        self.rotary = RotaryEmbedding(config, attn.head_dim)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        # Set by ``enable_fused_cpu_ops`` / ``enable_fused_gpu_ops``: the forward with
        # fused element-wise work (and, on a GPU, its batch-invariant LM head).
        self.fused_forward = None
        self.fused_head = None
        # Set where some layers' weights live in host memory (``worker/layer_streaming``):
        # every forward loops over ``layer_streamer.layers(...)``, which brings each
        # streamed layer's weights in before it computes.
        self.layer_streamer = None

    def checkpoint_target(self, name: str) -> CheckpointTarget:
        """Where checkpoint tensor ``name`` (Hugging Face naming) goes in this model.

        The projections fused here fill a block of rows of the fused parameter
        (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``); a
        sharded model reads only its slice of each tensor (``ShardLayout``).
        """
        module_path, _, leaf = name.rpartition(".")
        parent_path, _, proj = module_path.rpartition(".")
        source = self._shard_source(proj, leaf)
        if proj not in FUSED_SHARDS:
            return CheckpointTarget(name, None, source)
        fused, index = FUSED_SHARDS[proj]
        parent = self.get_submodule(parent_path)
        sizes = parent.qkv_sizes if fused == "qkv_proj" else (parent.down_proj.in_features,) * 2
        start = sum(sizes[:index])
        return CheckpointTarget(f"{parent_path}.{fused}.{leaf}", slice(start, start + sizes[index]), source)

    def _shard_source(self, proj: str, leaf: str) -> tuple[slice, ...] | None:
        """This rank's slice of a checkpoint tensor of module ``proj`` (see ``layout.py``)."""
        layout = self.layout
        if not layout.is_sharded:
            return ()
        d = self.head_dim
        heads = {"q_proj": layout.q_heads, "k_proj": layout.kv_heads, "v_proj": layout.kv_heads}
        if proj in heads:  # column-parallel: output rows
            return (slice(heads[proj].start * d, heads[proj].stop * d),)
        if proj in ("gate_proj", "up_proj"):
            return (slice(layout.intermediate.start, layout.intermediate.stop),)
        if proj in ("o_proj", "down_proj"):  # row-parallel: input columns; the bias once
            if leaf != "weight":
                return () if layout.rank == 0 else None
            cols = layout.q_heads if proj == "o_proj" else layout.intermediate
            scale = d if proj == "o_proj" else 1
            return (slice(None), slice(cols.start * scale, cols.stop * scale))
        if proj in ("embed_tokens", "lm_head"):
            return (slice(layout.vocab.start, layout.vocab.stop),)
        return ()  # norms: replicated

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for flat ``input_ids [T]``."""
        if self.fused_forward is not None:
            return self.fused_forward.forward(input_ids, positions, attention)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        layers = self.model.layers
        if self.layer_streamer is not None:
            layers = self.layer_streamer.layers(layers, range(len(layers)))
        for layer in layers:
            hidden = layer(hidden, cos, sin, attention)
        return self.model.norm(hidden)

    def enable_fused_cpu_ops(self) -> bool:
        """Run the forward with numba-fused element-wise ops (``cpu_fused``) from now on,
        or, where every product runs in ggml, as one ggml graph a step (``ggml_graph``).

        Returns whether it could: an fp32 or bf16 model on CPU with numba installed
        (or ggml's products).
        """
        weight = self.model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        from pagedtree.worker.models import ggml_graph

        if ggml_graph.unsupported(self) is None:
            # Every product in ggml: the whole forward as one ggml graph a step.
            self.fused_forward = ggml_graph.GgmlGraphForward(self)
            return True
        try:
            from pagedtree.worker.models.cpu_fused import FusedCpuForward
        except ImportError:  # numba is optional
            return False
        self.fused_forward = FusedCpuForward(self)
        return True

    def enable_fused_gpu_ops(self) -> bool:
        """Run the forward and the LM head through the batch-invariant, fused Triton
        kernels (``gpu_fused``) from now on: a token's bits then do not depend on the
        batch or tree beside it, without padding. Returns whether it could: Triton
        installed, a dense fp16/bf16/fp32 model whose shapes the kernels take, on CUDA
        (or on CPU tensors under the Triton interpreter)."""
        try:
            from pagedtree.worker.models.gpu_fused import FusedGpuForward, supports
        except ImportError:  # no Triton
            return False
        if supports(self) is not None:
            return False
        fused = FusedGpuForward(self)
        self.fused_forward = fused
        self.fused_head = fused.logits
        return True

    def make_rows_consistent(self, row_block: int | None = None) -> int:
        """Make every token's result independent of how many tokens share its forward.

        On CPU (``row_block`` None): one-row products of the oneDNN-packed and the q4/q8
        layers (a GGUF's 5- to 8-bit tensors, its head often among them) run as two
        rows (``Linear.pad_single_rows``) where the library sends one
        row through another kernel than several rows, whose rows are independent
        (``Linear.lone_row_needs_padding``: always for 16-bit outputs, measured per
        shape for fp32 ones; MLAS's 4-bit kernels send it elsewhere on an AVX2 CPU and
        not on the AVX-512 one), and where oneDNN runs AMX kernels, 16-bit products
        of more than 32 rows run in chunks of at most 32 (``Linear.row_chunk``). With
        ``row_block`` (CUDA, ``row_blocks.row_block_for``): every
        dense product and RMSNorm runs in blocks of exactly that many rows, one
        kernel on one shape whatever the batch. Tree speculation needs it for greedy
        outputs equal to plain decoding in every dtype; returns how many layers it
        switched (on CPU: how many pad or chunk)."""
        if row_block is not None:
            layers = [m for m in self.modules() if (isinstance(m, Linear) and m.weight is not None
                                                     and m.quantization is None) or isinstance(m, RMSNorm)]
            for layer in layers:
                layer.row_block = row_block
            return len(layers)
        layers = [m for m in self.modules() if isinstance(m, Linear)
                  and (m.packed_weight is not None or m.quantization in ("q4", "q8"))]
        # Padding costs 1.1-1.5x a one-row product and chunking reads the weights once
        # a chunk: each only where the library needs it.
        return sum(layer.make_rows_consistent() for layer in layers)

    def quantize_weights(self, mode: str) -> int:
        """``mode`` (one of ``linear.QUANTIZATIONS``) for every linear layer; returns how many.

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

    def weight_bytes(self) -> int:
        """Bytes of this model's (or shard's) weights in their current forms on its
        device (tied tensors counted once; packed and quantized layers by what they
        hold; streamed layers by the slots they share, not the host copies)."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        packed = sum(m.weight_bytes for m in self.modules() if isinstance(m, Linear) and m.weight is None)
        rows = self.model.embed_tokens.quantized_rows
        total = dense + packed + (rows.nbytes if rows is not None else 0)
        if self.layer_streamer is not None:  # the streamed views were counted above as if resident
            total += self.layer_streamer.slot_bytes - self.layer_streamer.bytes_per_pass
        return total

    def keep_head_rows(self, rows: torch.Tensor) -> None:
        """Compute logits for the token ids ``rows`` only (a draft's cut vocabulary,
        ``loading/draft_vocab.py``): the head keeps those rows of its weight, and
        ``compute_logits`` still returns every id, ``-inf`` outside ``rows``. Call it
        before the weights are packed or quantized (on a meta model: before loading)."""
        if self.group is not None:
            raise ValueError("a sharded model keeps its whole vocabulary")
        weight = self.lm_head.weight
        with torch.device("meta" if weight is None or weight.is_meta else "cpu"):
            head = Linear(self.config.hidden_size, len(rows), bias=False)
        if weight is not None and not weight.is_meta:
            head.weight = nn.Parameter(weight.detach()[rows].clone(), requires_grad=False)
        self.lm_head = head
        on = weight.device if weight is not None and not weight.is_meta else torch.device("cpu")
        self.head_rows = rows.to(device=on, dtype=torch.long)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits for hidden states ``[N, hidden]``.

        Sharded: each rank computes its vocabulary slice and rank 0 gathers them
        into ``[N, V]``; the other ranks get their own slice back."""
        logits = self.fused_head(hidden) if self.fused_head is not None else self.lm_head(hidden)
        if self.head_rows is not None:
            full = logits.new_full((logits.shape[0], len(self.layout.vocab)), float("-inf"))
            return full.index_copy_(1, self.head_rows, logits)
        if self.group is None:
            return logits
        layout = self.layout
        pad = layout.vocab_rows - logits.shape[-1]
        parts = self.group.gather_to_first(F.pad(logits, (0, pad)) if pad else logits)
        if parts is None:
            return logits
        last = layout.vocab_size - (layout.size - 1) * layout.vocab_rows
        return torch.cat(parts[:-1] + [parts[-1][:, :last]], dim=-1)
