"""The whole decoder forward as one ggml graph: llama.cpp's way of running a step.

A model whose products all run in ggml (``quantization="ggml"``: a GGUF file's
blocks as they are) spends a batch-1 step mostly waiting: 113 separate calls into
ggml a token, each waking ggml's threads, with torch's element-wise ops, the numba
attention and Python in between. llama.cpp runs the same kernels as one graph per
step, its threads spinning from one operation to the next. This module builds that
graph for the decoder, over the engine's own paged KV cache:

- embedding lookup in the file's blocks (``get_rows``), RMSNorm, the q/k/v, output
  and MLP products in the file's blocks, biases, rotary (``rope_ext``, the half-split
  layout the loaded weights use), SwiGLU, residuals and the final norm;
- the new keys and values written into the paged cache at the step's slots
  (``set_rows`` on the cache's own memory);
- attention as ``flash_attn_ext`` over each request's context gathered from its
  blocks (``get_rows`` by slot), with a mask that is causal, or follows the request's
  token tree, and hides padding: one attention node per request, its context padded
  to a multiple of ``CONTEXT_BUCKET`` (a long prompt beside short decodes pads none of
  them to its length).

The 4-bit weights are repacked into llama.cpp's interleaved x86 layout
(``ggml_repack``), whose one-row kernel reads them faster than the file's layout.

**Rows independent of their batch.** Tree verification needs a token's bits to be
the same alone and beside others, and a prompt's to be the same however a step
budget cut it. A step runs as two graphs when it holds both kinds of rows:

- Decoded and verified tokens: every product through the one-row kernel on its own
  (ggml's "planes": a batch of one-row products), whatever else shares the step, and
  ggml's reference kernels (``cplan.use_ref``): its faster attention paths split a
  lone query's context across threads or tile 64 queries, which rounds a lone row
  differently from a row among others (the reference setting also turns off its
  fusions).
- Prompt chunks: each chunk's rows a product of their own, with ggml's fast paths.
  A product's kernel depends on how many rows it gets (the repacked GEMM takes them
  4 at a time from the first, ggml's tiled K-quant GEMM for the file's layout takes
  a product of 8 rows or more, the rest go one at a time), so a product over the
  file's layout takes a chunk's first multiple of ``ROW_GROUP`` rows and the rest
  apart, and the scheduler cuts prompts at multiples of ``ROW_GROUP``: a prompt's
  row then meets the same kernel however the prompt was chunked. A chunk's attention
  runs in pieces of fewer than 64 queries (``ATTENTION_PIECE``), below ggml's tiled
  attention, so each query row visits its context alone, as a decoded row does.

Norms and rotary work row by row, and the attention of a row visits the unmasked
entries of its own context in order (masked entries, padding included, are skipped,
not added as zeros).

Rotary scalings that divide each frequency by a factor (Llama 3's, linear) pass
those factors to ``rope_ext``. Models this does not cover run layer by layer
(``unsupported`` says why): a rotary embedding that scales attention (YaRN's),
activations other than SiLU, sharded or streamed weights, a product outside ggml.

Graphs are cached by their shape (each request's tokens and padded context):
decoding one stream reuses one graph for ``CONTEXT_BUCKET`` tokens.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedtree.attention.cpu_backend import check_step
from pagedtree.attention.torch_backend import ancestor_mask
from pagedtree.host_memory import file_mapping, release_file_mapping
from pagedtree.step_data import AttentionMetadata
from pagedtree.worker.models.ggml_matmul import GgmlContext, GgmlMatMul, GgmlRuntime, shared_runtime
from pagedtree.worker.models.ggml_repack import RepackedWeights

# A prompt chunk's products take its first multiple of this many rows together (the
# repacked GEMM groups 4, ggml's tiled K-quant GEMM takes 8 or more) and the rest
# apart: the scheduler ends a chunk that stops mid-prompt at a multiple of it
# (``SchedulerConfig.prompt_chunk_multiple``).
ROW_GROUP = 8
# A prompt chunk's attention runs in pieces of at most this many queries: ggml tiles
# 64 queries or more (another rounding than one query at a time).
ATTENTION_PIECE = 63
# Contexts are padded up to a multiple of this many entries (masked): a decoded
# stream builds a new graph once per this many tokens.
CONTEXT_BUCKET = 256
# Graph shapes kept (least recently used dropped), and the most their buffers of
# intermediate results may hold together (a graph builds in about 2 ms; its buffer
# takes 0.5 MiB for a decode of the 1.5B, 58 MiB for a 512-token prompt chunk).
GRAPH_CACHE = 24
GRAPH_CACHE_BYTES = 256 * 2**20
# Tensor headers per decoder layer in a graph (40-80 are used, the most with fused
# projections and prompt chunks beside single rows; the rest is room).
_TENSORS_PER_LAYER = 96

_CACHE_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def unsupported(model) -> str | None:
    """Why ``model`` cannot run as one ggml graph (None: it can)."""
    body = model.model
    if model.group is not None:
        return "a sharded model"
    if model.layer_streamer is not None:
        return "streamed layers"
    if model.rotary.attention_scaling != 1.0:
        return "a rotary embedding that scales attention (YaRN's)"
    if model.config.hidden_act not in ("silu", "swish"):
        return f"activation {model.config.hidden_act!r}"
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(linear.block_matmul, GgmlMatMul):
                return "a product outside ggml"
        if not _stored_as(attn.qkv_proj, attn.qkv_sizes):
            return "q/k/v stored in parts of other sizes"
        if not _stored_as(mlp.gate_up_proj, (mlp.down_proj.in_features,) * 2):
            return "gate/up stored in parts of other sizes"
        for linear in (attn.o_proj, mlp.down_proj):
            if len(linear.block_matmul._weights) != 1:
                return "an output product in several tensors"
    return None


def _stored_as(linear, sizes: tuple[int, ...]) -> bool:
    """Whether a fused projection is stored as one tensor per output of ``sizes``, or
    as one tensor for all of them (the two layouts the graph splits)."""
    rows = [w.n for w in linear.block_matmul._weights]
    return rows == list(sizes) or len(rows) == 1


def _rope_base(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _frequency_factors(model, base: float) -> np.ndarray | None:
    """What the model's rotary frequencies are divided by against the plain ones at
    ``base`` (ggml's ``freq_factors``: Llama 3's and linear scaling are such a
    division per frequency); None where they are the plain ones."""
    inv_freq = model.rotary.inv_freq.detach().float().cpu()
    dim = 2 * inv_freq.numel()
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factors = (plain / inv_freq).numpy().astype(np.float32)
    return None if np.allclose(factors, 1.0, rtol=1e-6, atol=0) else factors


def _f32(values: torch.Tensor | None) -> np.ndarray | None:
    return None if values is None else values.detach().float().contiguous().numpy().copy()


@dataclass
class _Projection:
    """A (fused) projection's stored tensors and bias, and the outputs it splits into."""

    weights: list[Any]
    bias: np.ndarray | None
    sizes: tuple[int, ...]


@dataclass
class _Layer:
    """One decoder layer's weights as the graph reads them."""

    input_norm: np.ndarray
    post_norm: np.ndarray
    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection


@dataclass(frozen=True)
class StepShape:
    """What a graph is built for: per request, its new tokens, its context padded to a
    multiple of ``CONTEXT_BUCKET``, and whether it is a prompt chunk (a graph holds
    prompt chunks only, or decoded and verified tokens only)."""

    requests: tuple[tuple[int, int, bool], ...]

    @property
    def tokens(self) -> int:
        return sum(q for q, _, _ in self.requests)

    @property
    def chunks(self) -> tuple[int, ...]:
        """The tokens of each prompt chunk."""
        return tuple(q for q, _, chunk in self.requests if chunk)

    @property
    def prompt(self) -> bool:
        """Whether the graph's requests are prompt chunks (they all are, or none)."""
        return bool(self.requests) and self.requests[0][2]


@dataclass
class GraphInputs:
    """One graph's part of a step: its shape and its index and mask arrays."""

    shape: StepShape
    tokens: slice  # its tokens in the step's graph order
    positions: np.ndarray  # [tokens] int32
    slots: np.ndarray  # [tokens] int64 cache slot of each new token
    context_slots: np.ndarray  # int32 each request's padded context, one after another
    mask: np.ndarray  # float16 each request's [queries, padded context] mask (0 visible, -inf hidden), flat


@dataclass
class StepInputs:
    """One step's inputs in the graphs' layout: its tokens in graph order (prompt
    chunks first), the graph or two that run them, and the way back."""

    order: np.ndarray  # [T] int64 the step's flat token at each place of the graph order
    parts: list[GraphInputs]  # the prompt chunks' graph, then the other tokens' (either may be absent)
    restore: np.ndarray  # [T] int64 place in the graph order of each flat token


def step_inputs(meta: AttentionMetadata, positions: torch.Tensor, num_slots: int) -> StepInputs:
    """Pack ``meta`` for the graph (raises ``ValueError`` on metadata that would index
    outside the cache: ggml checks no bounds)."""
    bs = meta.block_size
    checked = check_step(meta, num_slots // bs)
    starts, query_lens, context_lens = (checked.query_start_loc.tolist(), checked.query_lens.tolist(),
                                        checked.context_lens.tolist())
    requests, tokens = len(context_lens), checked.num_tokens
    if requests == 0:
        raise ValueError("a step needs requests, each with at least one token")
    # Prompt chunks (several tokens, causal) first: their products may group rows;
    # decodes and trees after, a row at a time (see ``_Graph``).
    chunk = [q > 1 and meta.tree_parents[i] is None for i, q in enumerate(query_lens)]
    groups = [[i for i in range(requests) if chunk[i]], [i for i in range(requests) if not chunk[i]]]
    in_order = groups[0] + groups[1]
    order = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in in_order]).astype(np.int64)
    place = np.empty(tokens, np.int64)
    place[order] = np.arange(tokens)
    padded = {i: -(-context_lens[i] // CONTEXT_BUCKET) * CONTEXT_BUCKET for i in range(requests)}
    slots = checked.slot_mapping
    context_slots = np.zeros(sum(padded.values()), np.int32)
    mask = np.full(sum(query_lens[i] * padded[i] for i in range(requests)), -np.inf, np.float16)
    context_at = mask_at = 0
    for i in in_order:
        q, c, width = query_lens[i], context_lens[i], padded[i]
        table = np.asarray(meta.block_tables[i], np.int64)
        needed = -(-c // bs)
        if len(table) < needed:
            raise ValueError(f"request {i}: block table too short for context_len {c}")
        table = table[:needed]
        if table.size and (table.min() < 0 or table.max() * bs >= num_slots):
            raise ValueError(f"request {i}: block ids outside the cache")
        pos = np.arange(c)
        context_slots[context_at: context_at + c] = table[pos // bs] * bs + pos % bs
        own = mask[mask_at: mask_at + q * width].reshape(q, width)
        prefix = c - q
        own[:, :prefix] = 0
        parents = meta.tree_parents[i]
        if parents is None:
            visible = np.tril(np.ones((q, q), bool))
        else:
            if len(parents) != q:
                raise ValueError(f"request {i}: {len(parents)} tree parents for {q} tokens")
            visible = ancestor_mask(parents).numpy()
        own[:, prefix:c] = np.where(visible, 0, -np.inf).astype(np.float16)
        context_at += width
        mask_at += q * width
    positions = positions.numpy().astype(np.int32)[order]
    slots = slots[order]
    parts, token_at, context_at, mask_at = [], 0, 0, 0
    for group in filter(None, groups):
        tokens = sum(query_lens[i] for i in group)
        width = sum(padded[i] for i in group)
        masked = sum(query_lens[i] * padded[i] for i in group)
        parts.append(GraphInputs(
            StepShape(tuple((query_lens[i], padded[i], chunk[i]) for i in group)), slice(token_at, token_at + tokens),
            positions[token_at: token_at + tokens], slots[token_at: token_at + tokens],
            context_slots[context_at: context_at + width], mask[mask_at: mask_at + masked]))
        token_at, context_at, mask_at = token_at + tokens, context_at + width, mask_at + masked
    return StepInputs(order, parts, place)


class _Graph:
    """The forward of one ``StepShape``: input arrays it reads, the hidden states it
    writes (``out``, fp32 ``[tokens, hidden]`` in the shape's order)."""

    def __init__(self, forward: GgmlGraphForward, shape: StepShape):
        if len({chunk for _, _, chunk in shape.requests}) > 1:
            raise ValueError("a graph runs prompt chunks only or other tokens only")
        ggml = forward.ggml
        rt = forward.runtime
        n_layers = len(forward.layers)
        # Tensors of a layer: about 50, then per request its attention (14, and 8 more
        # per piece of a long prompt chunk's) and per prompt chunk its rows' products
        # (two views, products and concats each: 48).
        pieces = sum(-(-q // ATTENTION_PIECE) for q in shape.chunks)
        per_layer = _TENSORS_PER_LAYER + 14 * len(shape.requests) + 8 * pieces + 48 * len(shape.chunks)
        nodes = max(ggml.GGML_DEFAULT_GRAPH_SIZE, per_layer * n_layers + 64)
        self._context = GgmlContext(rt, tensors=per_layer * (n_layers + 2), graph_nodes=nodes)
        ctx = self._context.context
        T = shape.tokens
        D, Hq, Hkv, hidden = forward.head_dim, forward.num_heads, forward.num_kv_heads, forward.hidden
        self.shape = shape
        self._keep: list[Any] = []

        def tensor(type_id: int, *ne: int, array: np.ndarray | None = None):
            t = getattr(ggml, f"ggml_new_tensor_{len(ne)}d")(ctx, type_id, *ne)
            if array is not None:
                t.contents.data = array.ctypes.data
                self._keep.append(array)
            return t

        def const(array: np.ndarray | None):
            return None if array is None else tensor(ggml.GGML_TYPE_F32, array.shape[0], array=array)

        # Inputs, at addresses the step fills in.
        self.ids = np.zeros(T, np.int32)
        self.positions = np.zeros(T, np.int32)
        self.slots = np.zeros(T, np.int64)
        self.context_slots = np.zeros(sum(width for _, width, _ in shape.requests), np.int32)
        self.mask = np.zeros(sum(q * width for q, width, _ in shape.requests), np.float16)
        self.out = torch.empty(T, hidden, dtype=torch.float32)
        # A dense embedding table is looked up by torch; its rows come in here.
        self.embedded = None if forward.quantized_embedding else np.zeros((T, hidden), np.float32)
        t_ids = tensor(ggml.GGML_TYPE_I32, T, array=self.ids)
        t_pos = tensor(ggml.GGML_TYPE_I32, T, array=self.positions)
        t_slots = tensor(ggml.GGML_TYPE_I64, T, array=self.slots)
        t_ctx = tensor(ggml.GGML_TYPE_I32, self.context_slots.size, array=self.context_slots)
        t_mask = tensor(ggml.GGML_TYPE_F16, self.mask.size, array=self.mask)

        def product(weight, x):
            # A prompt chunk's rows as matrices of their own (see the module
            # docstring). Every other row alone (ggml's planes: a batch of one-row
            # products), through the kernel a lone row takes, so a decoded or
            # verified token gets the same bits whatever shares its step.
            k, stride = x.contents.ne[0], x.contents.nb[1]
            if not shape.prompt:
                planes = ggml.ggml_view_3d(ctx, x, k, 1, T, stride, stride, 0)
                y = ggml.ggml_mul_mat(ctx, weight, planes)
                return ggml.ggml_reshape_2d(ctx, y, y.contents.ne[0], T)
            # The repacked GEMM groups rows the same way in one product (and another
            # would stream the weight again); the tiled GEMM needs the cut.
            repacked = bool(weight.contents.extra)
            parts, start = [], 0
            for rows in shape.chunks:
                grouped = rows if repacked else rows // ROW_GROUP * ROW_GROUP
                for span in (grouped, rows - grouped):
                    if span:
                        view = x if span == T else ggml.ggml_view_2d(ctx, x, k, span, stride, start * stride)
                        parts.append(ggml.ggml_mul_mat(ctx, weight, view))
                        start += span
            return concat_rows(parts)

        def linear(projection: _Projection, x) -> list:
            """The projection's outputs ``[size, T]``, one per size."""
            bias, sizes = projection.bias, projection.sizes
            if len(projection.weights) == len(sizes):
                outputs, start = [], 0
                for weight, size in zip(projection.weights, sizes):
                    y = product(weight, x)
                    if bias is not None:
                        y = ggml.ggml_add(ctx, y, const(bias[start:start + size].copy()))
                    outputs.append(y)
                    start += size
                return outputs
            y = product(projection.weights[0], x)
            if bias is not None:
                y = ggml.ggml_add(ctx, y, const(bias))
            if len(sizes) == 1:
                return [y]
            outputs, start = [], 0
            for size in sizes:
                view = ggml.ggml_view_2d(ctx, y, size, T, y.contents.nb[1], 4 * start)
                outputs.append(ggml.ggml_cont(ctx, view))
                start += size
            return outputs

        def norm(x, weight):
            return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, forward.eps), const(weight))

        factors = None if forward.freq_factors is None else tensor(
            ggml.GGML_TYPE_F32, forward.freq_factors.size, array=forward.freq_factors)

        def rope(x, heads):
            x = ggml.ggml_reshape_3d(ctx, x, D, heads, T)
            return ggml.ggml_rope_ext(ctx, x, t_pos, factors, D, ggml.GGML_ROPE_TYPE_NEOX, forward.max_positions,
                                      forward.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)

        # Each request's attention on its own: its queries (graph order), its context
        # gathered from its blocks and padded to its bucket, its mask.
        requests, token_at, context_at, mask_at = [], 0, 0, 0
        for q, width, _ in shape.requests:
            requests.append((q, width, token_at, context_at, mask_at))
            token_at, context_at, mask_at = token_at + q, context_at + width, mask_at + q * width

        def attention(queries, key_cache, value_cache, q, width, token_at, context_at, mask_at):
            slots = ggml.ggml_view_1d(ctx, t_ctx, width, 4 * context_at)
            keys = ggml.ggml_permute(ctx, ggml.ggml_reshape_3d(
                ctx, ggml.ggml_get_rows(ctx, key_cache, slots), D, Hkv, width), 0, 2, 1, 3)
            values = ggml.ggml_permute(ctx, ggml.ggml_reshape_3d(
                ctx, ggml.ggml_get_rows(ctx, value_cache, slots), D, Hkv, width), 0, 2, 1, 3)
            nb = queries.contents.nb
            # A long prompt chunk in near-equal pieces below ggml's query tiling (a
            # decode graph's requests keep the reference kernel: see the docstring).
            count = -(-q // ATTENTION_PIECE) if shape.prompt else 1
            sizes = [q // count + (j < q % count) for j in range(count)]
            outs, first = [], 0
            for rows in sizes:
                own = ggml.ggml_view_3d(ctx, queries, D, Hq, rows, nb[1], nb[2], (token_at + first) * nb[2])
                mask = ggml.ggml_view_2d(ctx, t_mask, width, rows, 2 * width, 2 * (mask_at + first * width))
                out = ggml.ggml_flash_attn_ext(ctx, ggml.ggml_permute(ctx, own, 0, 2, 1, 3), keys, values, mask,
                                               forward.scale, 0.0, 0.0)
                outs.append(ggml.ggml_reshape_2d(ctx, out, D * Hq, rows))
                first += rows
            return concat_rows(outs)

        def concat_rows(parts):
            # Pairwise, as a balanced tree: each row is copied log2(requests) times.
            while len(parts) > 1:
                parts = [ggml.ggml_concat(ctx, parts[i], parts[i + 1], 1) if i + 1 < len(parts) else parts[i]
                         for i in range(0, len(parts), 2)]
            return parts[0]

        if self.embedded is None:
            h = ggml.ggml_get_rows(ctx, forward.embedding_table, t_ids)  # fp32 rows of the file's blocks
        else:
            h = tensor(ggml.GGML_TYPE_F32, hidden, T, array=self.embedded)
        for index, layer in enumerate(forward.layers):
            x = norm(h, layer.input_norm)
            q, k, v = linear(layer.qkv, x)
            q, k = rope(q, Hq), rope(k, Hkv)
            key_cache, value_cache = forward.cache_tensors[index]
            # The cache written before it is read: the gathers take set_rows' results.
            key_cache = ggml.ggml_set_rows(ctx, key_cache, ggml.ggml_reshape_2d(ctx, k, D * Hkv, T), t_slots)
            value_cache = ggml.ggml_set_rows(ctx, value_cache, v, t_slots)
            attended = concat_rows([attention(q, key_cache, value_cache, *request) for request in requests])
            h = ggml.ggml_add(ctx, h, linear(layer.o, attended)[0])
            x = norm(h, layer.post_norm)
            gate, up = linear(layer.gate_up, x)
            h = ggml.ggml_add(ctx, h, linear(layer.down, ggml.ggml_swiglu_split(ctx, gate, up))[0])
        result = norm(h, forward.final_norm)
        result.contents.data = self.out.data_ptr()
        self.graph = ggml.ggml_new_graph_custom(ctx, nodes, False)
        ggml.ggml_build_forward_expand(self.graph, result)
        # Intermediate results in a buffer of the graph's own, laid out once by ggml's
        # allocator (which reuses memory between layers): a tensor keeps its address
        # for as long as the graph lives.
        self._allocator = ggml.ggml_gallocr_new(rt.plain_buffer_type)
        if not ggml.ggml_gallocr_alloc_graph(self._allocator, self.graph):
            raise RuntimeError("ggml could not allocate a forward's intermediate results")
        self.buffer_bytes = int(ggml.ggml_gallocr_get_buffer_size(self._allocator, 0))
        self._ggml = ggml
        self.plan = ggml.ggml_graph_plan(self.graph, rt.threads, rt.pool(rt.threads))
        # Decoded and verified tokens take ggml's reference kernels: one row's result
        # never depends on the others (see the module docstring).
        self.plan.use_ref = not shape.prompt

    def __del__(self) -> None:
        allocator = getattr(self, "_allocator", None)
        if allocator:
            self._ggml.ggml_gallocr_free(allocator)

    def fill(self, ids: np.ndarray, embedded: np.ndarray | None, inputs: GraphInputs) -> None:
        """Copy one graph's inputs (``ids`` and ``embedded`` rows in its order) into its arrays."""
        self.ids[:] = ids
        if embedded is not None:
            self.embedded[:] = embedded
        self.positions[:] = inputs.positions
        self.slots[:] = inputs.slots
        self.context_slots[:] = inputs.context_slots
        self.mask[:] = inputs.mask


class GgmlGraphForward:
    """``DecoderForCausalLM.forward`` as one ggml graph a step (see the module
    docstring); set as the model's ``fused_forward``. The LM head stays the model's."""

    def __init__(self, model):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the model cannot run as one ggml graph: {why}")
        import ggml

        self.ggml = ggml
        self.runtime: GgmlRuntime = shared_runtime()
        body = model.model
        config = model.config
        attn0 = body.layers[0].self_attn
        self.head_dim, self.num_heads, self.num_kv_heads = attn0.head_dim, attn0.num_heads, attn0.num_kv_heads
        self.hidden = config.hidden_size
        self.eps = float(body.norm.eps)
        self.scale = self.head_dim ** -0.5
        self.rope_base = _rope_base(config)
        self.freq_factors = _frequency_factors(model, self.rope_base)
        self.max_positions = int(getattr(config, "max_position_embeddings", 4096))
        self.dtype = body.embed_tokens.weight.dtype
        self._embed = body.embed_tokens
        rows = body.embed_tokens.quantized_rows
        self.quantized_embedding = rows is not None
        self.embedding_table = rows._table.tensor if rows is not None else None
        self.vocab_size = body.embed_tokens.num_embeddings
        linears = [linear for layer in body.layers for linear in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        sources = [w for linear in linears for w in linear.block_matmul._weights if not w.repacked]
        self.repacked = RepackedWeights(self.runtime, sources)
        self.layers = [self._layer(layer) for layer in body.layers]
        # The repacked weights are copies: the file's pages they were read from leave
        # the process's resident memory (pages read again come back from the file).
        mappings = {id(m): m for m in (file_mapping(w._data) for w in sources if self.repacked.tensor(w) is not None)
                    if m is not None}
        for mapping in mappings.values():
            release_file_mapping(mapping)
        self.final_norm = _f32(body.norm.weight)
        self._graphs: OrderedDict[StepShape, _Graph] = OrderedDict()
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.cache_tensors: list[tuple[Any, Any]] = []
        self._cache_context: GgmlContext | None = None

    def _weight(self, weight) -> Any:
        """The graph's tensor for a layer's weight: its copy repacked into ggml's
        interleaved layout where this CPU has one for its type (``ggml_repack``), the
        file's blocks otherwise."""
        return self.repacked.tensor(weight) or weight.tensor

    def _projection(self, linear, sizes: tuple[int, ...]) -> _Projection:
        return _Projection([self._weight(w) for w in linear.block_matmul._weights], _f32(linear.bias), sizes)

    def _layer(self, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        inner = mlp.down_proj.in_features
        return _Layer(
            input_norm=_f32(layer.input_layernorm.weight), post_norm=_f32(layer.post_attention_layernorm.weight),
            qkv=self._projection(attn.qkv_proj, tuple(attn.qkv_sizes)),
            o=self._projection(attn.o_proj, (attn.o_proj.out_features,)),
            gate_up=self._projection(mlp.gate_up_proj, (inner, inner)),
            down=self._projection(mlp.down_proj, (mlp.down_proj.out_features,)),
        )

    def _bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """ggml tensors over the paged cache's own memory (``[slots, kv_heads * head_dim]``)."""
        if self._caches is kv_caches:
            return
        ggml = self.ggml
        first = kv_caches[0][0]
        if first.dtype not in _CACHE_TYPES:
            raise ValueError(f"a ggml graph needs an fp32, fp16 or bf16 KV cache, got {first.dtype}")
        type_id = getattr(ggml, f"GGML_TYPE_{_CACHE_TYPES[first.dtype]}")
        width = self.num_kv_heads * self.head_dim
        context = GgmlContext(self.runtime, tensors=2 * len(kv_caches) + 2)
        tensors = []
        for key_cache, value_cache in kv_caches:
            pair = []
            for cache in (key_cache, value_cache):
                if not cache.is_contiguous() or cache.device.type != "cpu" or cache.numel() % width:
                    raise ValueError("a ggml graph needs contiguous CPU KV caches")
                t = ggml.ggml_new_tensor_2d(context.context, type_id, width, cache.numel() // width)
                t.contents.data = cache.data_ptr()
                pair.append(t)
            tensors.append(tuple(pair))
        self._graphs.clear()  # built over the previous caches
        self._cache_context, self.cache_tensors, self._caches = context, tensors, kv_caches
        self._num_slots = first.numel() // width

    def _graph(self, shape: StepShape) -> _Graph:
        graph = self._graphs.get(shape)
        if graph is None:
            graph = self._graphs[shape] = _Graph(self, shape)
            while len(self._graphs) > 1 and (len(self._graphs) > GRAPH_CACHE or sum(
                    g.buffer_bytes for g in self._graphs.values()) > GRAPH_CACHE_BYTES):
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(shape)
        return graph

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (the model's dtype); writes
        the step's keys and values into ``attention``'s paged cache."""
        meta: AttentionMetadata | None = getattr(attention, "_meta", None)
        if meta is None:
            raise ValueError("the attention backend has no step metadata (begin_step first)")
        self._bind_caches(attention.kv_caches)
        input_ids = input_ids.cpu()
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise IndexError(f"token ids must be in [0, {self.vocab_size})")
        embedded = None if self.quantized_embedding else self._embed(input_ids).detach().float().contiguous()
        inputs = step_inputs(meta, positions.cpu(), self._num_slots)
        ids = input_ids.to(torch.int32).numpy()[inputs.order]
        rows = None if embedded is None else embedded.numpy()[inputs.order]
        outs = []
        with self.runtime.lock:
            # The prompt chunks' graph first, then the other tokens': the two touch
            # different requests' cache entries.
            for part in inputs.parts:
                graph = self._graph(part.shape)
                graph.fill(ids[part.tokens], None if rows is None else rows[part.tokens], part)
                self.runtime.compute(graph.graph, graph.plan)
                outs.append(graph.out)
            # Back to the step's order (a copy: the graphs' outputs are reused).
            out = (outs[0] if len(outs) == 1 else torch.cat(outs))[torch.from_numpy(inputs.restore)]
        return out if self.dtype == torch.float32 else out.to(self.dtype)

