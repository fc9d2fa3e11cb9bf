"""Weights straight from a GGUF file: quantized without building the dense model, or
dense without an fp32 copy of it.

llama.cpp files store most weights in 4- to 8-bit blocks. For ``quantization="int4"``
the 4-bit blocks (Q4_0, Q4_1, Q4_K: an affine grid per 32 weights) become torch's
int4 layout exactly (same codes, same scale and minimum per group of 32); the 5- to
8-bit blocks (Q5_*, Q6_K, Q8_0) and dense tensors become per-row int8, which loses
less than rounding them to 4 bits would. For ``quantization="int8"`` every linear
weight is per-row int8. For ``quantization="q4"`` every weight in one of llama.cpp's
common block formats becomes ONNX Runtime blocks that represent it exactly
(``gguf_blocks``: 4-bit formats as 4-bit codes, 5- to 8-bit ones as 8-bit codes; a
fused layer takes its widest part's codes); ``"q8"`` widens the 4-bit ones to 8-bit
codes too (still exact). Tensors in other formats are rounded to q4 or q8 blocks.
``"q4-rounded"`` (a draft's default beside a q4 target) keeps the 4-bit formats
exactly and rounds the wider ones to 4-bit blocks as well: a draft need not
reproduce its file, and the 0.5B's mostly 5- and 8-bit file then takes about
200 MiB less and reads fewer bytes a forward.
For ``quantization="ggml"`` every linear weight keeps the file's own blocks, byte for
byte, multiplied by ggml's kernels (``ggml_matmul``), and so does the token embedding
(rows looked up by ggml, ``ggml_rows``), as llama.cpp runs the file: the model holds
the file's mapped pages and nothing else of its weights but the norms and biases.
Norms and biases stay dense (bf16, or the model's dtype); so does the embedding table
where ggml is not installed (with it, the table stays in the file's blocks and each
step looks up its rows through ggml, ``ggml_rows``).

Only the tensors being converted are ever dense, one at a time: the 1.5B model needs
its quantized weights plus the embedding table, not its 6 GB of fp32. Dense weights
(``quantization=None``, the dense formats on CPU) are dequantized a chunk of rows at
a time straight into the model's dtype and each layer is prepacked as it is built: a
bf16 load peaks near the bf16 weights, where going through a converted fp32
checkpoint held the 7 GB file's pages beside them.

Names follow llama.cpp's (``blk.N.attn_q.weight``, ...); llama-architecture files
store the Q and K projections with rows permuted for llama.cpp's rotary layout, which
is undone here row by row (codes and scales alike).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedtree.host_memory import trim_heap_over
from pagedtree.loading import gguf_blocks
from pagedtree.worker.models import block_quant, ggml_matmul
from pagedtree.worker.models.decoder import DecoderForCausalLM
from pagedtree.worker.models.ggml_matmul import ggml_available
from pagedtree.worker.models.ggml_rows import GgmlRows
from pagedtree.worker.models.linear import (
    INT4_GROUP_SIZE,
    Linear,
    int4_scales_and_zeros,
    quantize_int8,
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face checkpoint name of a GGUF tensor (None: not a weight we load)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


@dataclass(slots=True)
class _Int4Rows:
    """Rows of an int4 weight: codes ``[n, K]`` (0..15), per-group ``scale`` and ``low`` ``[n, K/32]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor


def _int4_rows(tensor) -> _Int4Rows:
    """Codes and affine parameters of a Q4_0/Q4_1/Q4_K tensor, exactly as stored."""
    kind = tensor.tensor_type.name
    n, k = int(tensor.shape[1]), int(tensor.shape[0])
    blocks = np.asarray(tensor.data).reshape(-1)
    if kind == "Q4_K":
        blocks = blocks.reshape(-1, 144)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = gguf_blocks.k_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 8, 32)
        scale = d * sc
        low = -dmin * mins.astype(np.float32)
    else:  # Q4_0 / Q4_1: one group of 32 per block
        width = 18 if kind == "Q4_0" else 20
        blocks = blocks.reshape(-1, width)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        if kind == "Q4_0":
            low = -8.0 * d
            qs = blocks[:, 2:]
        else:
            low = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            qs = blocks[:, 4:]
        qs = qs.reshape(-1, 1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 1, 32)
        scale = d
    return _Int4Rows(
        codes=torch.from_numpy(codes.reshape(n, k).astype(np.int32)),
        scale=torch.from_numpy(np.ascontiguousarray(scale).reshape(n, k // INT4_GROUP_SIZE)),
        low=torch.from_numpy(np.ascontiguousarray(low).reshape(n, k // INT4_GROUP_SIZE)),
    )


# Large tensors are dequantized this many rows at a time, so that numpy's temporaries
# stay small (a whole 150k-row embedding would need several times its fp32 size).
_CHUNK_ROWS = 2048
# Free heap a load lets build up between layers before handing it back to the OS.
_LOAD_FREE_HEAP = 64 * 2**20


def _rows(tensor) -> int:
    return int(tensor.shape[1]) if len(tensor.shape) > 1 else 1


def _dense_chunks(tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, fp32 rows [n, K])`` of any GGUF tensor, a chunk at a time."""
    from gguf.quants import dequantize

    data = np.asarray(tensor.data)
    cols = int(tensor.shape[0])
    rows = _rows(tensor)
    data = data.reshape(rows, -1)
    for start in range(0, rows, _CHUNK_ROWS):
        values = np.asarray(dequantize(data[start : start + _CHUNK_ROWS], tensor.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # a dense tensor comes back as a view of the mapped file
            values = values.copy()
        yield start, torch.from_numpy(np.ascontiguousarray(values).reshape(-1, cols))


def _dense(tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any GGUF tensor in ``dtype``, shaped ``[N, K]`` (or ``[N]`` for a vector)."""
    shape = [int(s) for s in reversed(tensor.shape)]
    out = torch.empty((_rows(tensor), int(tensor.shape[0])), dtype=dtype)
    for start, chunk in _dense_chunks(tensor):
        out[start : start + chunk.shape[0]] = chunk
    return out.reshape(shape)


def _int8_rows(tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes and scales of any GGUF tensor, a chunk of rows at a time."""
    codes = torch.empty((_rows(tensor), int(tensor.shape[0])), dtype=torch.int8)
    scales = torch.empty(_rows(tensor))
    for start, chunk in _dense_chunks(tensor):
        c, sc = quantize_int8(chunk)
        codes[start : start + c.shape[0]] = c
        scales[start : start + c.shape[0]] = sc
    return codes, scales


def _blocks(pieces: list, bits: int, round_wider: bool = False) -> block_quant.BlockWeights:
    """A layer's checkpoint tensors as blocks: llama.cpp's formats exactly
    (``gguf_blocks``; 4-bit ones widened to 8 bits when ``bits`` is 8), other tensors
    rounded to ``bits``-bit blocks, and with ``round_wider`` the formats wider than
    ``bits`` too; a chunk of rows at a time."""
    parts: list[block_quant.BlockCodes] = []
    for _, tensor, heads in pieces:
        kind, rows, cols = tensor.tensor_type.name, _rows(tensor), int(tensor.shape[0])
        exact = gguf_blocks.exact_bits(kind)
        if exact is None or (round_wider and exact > bits):
            tensor_parts = [block_quant.quantize_blocks(chunk, bits).unpack() for _, chunk in _dense_chunks(tensor)]
        else:
            data = np.asarray(tensor.data).reshape(rows, -1)
            tensor_parts = [gguf_blocks.decode_blocks(data[start : start + _CHUNK_ROWS], kind,
                                                      min(_CHUNK_ROWS, rows - start), cols)
                            for start in range(0, rows, _CHUNK_ROWS)]
            if bits > gguf_blocks.exact_bits(kind):
                tensor_parts = [p.widened(bits, p.block, p.offsets is not None) for p in tensor_parts]
        if heads is not None:  # permuted rows (the small Q/K projections): whole, then reordered
            whole = block_quant.concat_blocks(tensor_parts).unpack()
            order = _unpermute_rows(torch.arange(rows), heads).numpy()
            tensor_parts = [whole.take_rows(order)]
        parts += tensor_parts
    return block_quant.concat_blocks(parts)


def _ggml_rows(tensor, heads: int | None) -> ggml_matmul.GgmlBlocks:
    """A GGUF tensor's rows as stored (a copy of the file's bytes), unpermuted for
    llama-layout Q/K projections (whole rows move: exact)."""
    rows, cols = _rows(tensor), int(tensor.shape[0])
    data = np.asarray(tensor.data).reshape(rows, -1).view(np.uint8)
    blocks = ggml_matmul.GgmlBlocks(tensor.tensor_type.name, data, cols)
    if heads is not None:
        return blocks.take_rows(_unpermute_rows(torch.arange(rows), heads).numpy())
    return blocks


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (rows are ``[heads, 2, head_dim/2]`` there)."""
    half = x.shape[0] // heads // 2
    return x.reshape(heads, half, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def load_gguf_weights(net: DecoderForCausalLM, gguf_file: Path, quantization: str | None, dtype: torch.dtype,
                      pack_weights: bool = True) -> None:
    """Fill ``net`` (built on the meta device) from ``gguf_file``: linear layers
    quantized (see module docstring), everything else dense in ``dtype``.
    ``quantization=None``: every weight dense in ``dtype`` (the values a dequantizing
    conversion gives), each linear layer prepacked for oneDNN as it is built when
    ``pack_weights``."""
    from pagedtree.loading import gguf_reader  # gguf is imported on use

    reader = gguf_reader.open_gguf(gguf_file)
    config = net.config
    permute = {"q_proj": config.num_attention_heads,
               "k_proj": getattr(config, "num_key_value_heads", config.num_attention_heads)}
    llama_layout = str(reader.fields["general.architecture"].contents()) == "llama"
    parts: dict[str, list[tuple[slice, object]]] = {}  # linear weight -> its checkpoint tensors
    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is not None:
            tensors[name] = tensor
    if net.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    # The tensors are views of the file's mapping, which they keep open; the reader's
    # metadata (a tokenizer's 150,000 strings as about 600,000 small arrays: 170 MiB
    # for Qwen2.5's) goes now rather than at the end of the load.
    mapping = reader.data
    del reader
    linears = {f"{n}.weight" for n, m in net.named_modules() if isinstance(m, Linear)}
    for name, tensor in tensors.items():
        if name == "lm_head.weight":
            target, rows = name, None
        else:
            place = net.checkpoint_target(name)  # an unsharded model: whole tensors
            target, rows = place.param, place.rows
        proj = name.rsplit(".", 2)[-2]
        unpermute = permute.get(proj) if llama_layout else None
        if target in linears:
            parts.setdefault(target, []).append((rows, tensor, unpermute))
            continue
        if target == "model.embed_tokens.weight" and (quantization == "ggml"
                                                      or (quantization is not None and ggml_available())):
            # The table stays in the file's blocks, a view of the mapping; each step
            # looks up its rows (the same values as the dense table: 131 MB for the
            # 1.5B's instead of 467 in bf16), and only the pages of rows looked up
            # become resident.
            net.model.embed_tokens.set_quantized_rows(GgmlRows(_ggml_rows(tensor, None)), dtype)
            continue
        value = _dense(tensor, dtype)
        if unpermute is not None:  # a q/k bias
            value = _unpermute_rows(value, unpermute)
        _set_dense(net, target, rows, value)
    gguf_reader.release_pages(mapping)
    # The largest layer (the head) first, while little else is built: its conversion's
    # transient arrays then add to the smallest heap of the load, not the largest.
    order = sorted(parts, key=lambda target: -sum(int(np.prod(t.shape)) for _, t, _ in parts[target]))
    for target in order:
        pieces = parts[target]
        keep = net.head_rows if target == "lm_head.weight" else None  # a draft's cut vocabulary
        layer = net.get_submodule(target.rsplit(".", 1)[0])
        if quantization is None:
            _set_dense_linear(layer, pieces, dtype, keep, pack_weights)
        else:
            _set_linear(layer, pieces, quantization, keep)
        # Each layer's file pages leave the process once its weights are built: the
        # whole file would otherwise be resident beside them at the end of the load.
        gguf_reader.release_pages(mapping)
        # So do the conversion's transients: each layer's decoding and packing leave
        # free heap that the next, differently sized layer does not reuse (the 1.5B's
        # head alone left 190 MiB, resident until the load's end without this).
        trim_heap_over(_LOAD_FREE_HEAP)
    missing = [n for n, p in net.named_parameters() if p.is_meta]
    missing += [f"{n}.weight" for n, m in net.named_modules()
                if isinstance(m, Linear) and m.weight is not None and m.weight.is_meta]
    if missing:
        raise ValueError(f"{gguf_file.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _set_dense(net: nn.Module, target: str, rows: slice | None, value: torch.Tensor) -> None:
    module_name, _, leaf = target.rpartition(".")
    module = net.get_submodule(module_name)
    param = getattr(module, leaf)
    if param.is_meta:
        param = nn.Parameter(torch.empty(param.shape, dtype=value.dtype), requires_grad=False)
        setattr(module, leaf, param)
    destination = param if rows is None else param[rows]
    with torch.no_grad():
        destination.copy_(value.reshape(destination.shape))


def _set_dense_linear(layer: Linear, pieces: list, dtype: torch.dtype, keep_rows: torch.Tensor | None,
                      pack: bool) -> None:
    """A linear layer's dense ``dtype`` weight from its checkpoint tensors (each
    dequantized a chunk of rows at a time, never whole in fp32), packed for oneDNN
    when ``pack``."""
    pieces = sorted(pieces, key=lambda p: 0 if p[0] is None else p[0].start)
    parts = []
    for _, tensor, heads in pieces:
        part = _dense(tensor, dtype)
        parts.append(_unpermute_rows(part, heads) if heads is not None else part)
    weight = parts[0] if len(parts) == 1 else torch.cat(parts)
    del parts
    if keep_rows is not None:
        weight = weight[keep_rows]
    if weight.shape != (layer.out_features, layer.in_features):
        raise ValueError(f"GGUF weights of shape {tuple(weight.shape)} for a layer of "
                         f"{(layer.out_features, layer.in_features)}")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if pack:
        layer.pack_for_cpu()


def _set_linear(layer: Linear, pieces: list, quantization: str, keep_rows: torch.Tensor | None = None) -> None:
    """Quantize a linear layer from its checkpoint tensors (several for a fused one),
    keeping only the output rows ``keep_rows`` when given."""
    pieces = sorted(pieces, key=lambda p: 0 if p[0] is None else p[0].start)
    pick = (lambda x: x) if keep_rows is None else (lambda x: x[keep_rows])
    if quantization == "ggml":
        parts = [_ggml_rows(tensor, heads) for _, tensor, heads in pieces]
        if keep_rows is not None:
            if len(parts) != 1:
                raise ValueError("a cut vocabulary needs a head of one tensor")
            parts = [parts[0].take_rows(keep_rows.numpy())]
        layer.set_ggml(parts)
        return
    if quantization in block_quant.BITS:
        blocks = _blocks(pieces, block_quant.BITS[quantization], quantization in block_quant.ROUNDS_WIDER_BLOCKS)
        if keep_rows is not None:
            blocks = block_quant.pack_blocks(blocks.unpack().take_rows(keep_rows.numpy()))
        layer.set_blocks(blocks)
        return
    exact_int4 = quantization == "int4" and all(t.tensor_type.name in _INT4_TYPES for _, t, _ in pieces)
    if exact_int4:
        rows = []
        for _, tensor, heads in pieces:
            part = _int4_rows(tensor)
            if heads is not None:
                part = _Int4Rows(*(_unpermute_rows(x, heads) for x in (part.codes, part.scale, part.low)))
            rows.append(part)
        codes = pick(torch.cat([r.codes for r in rows]))
        layer.set_int4(codes, int4_scales_and_zeros(pick(torch.cat([r.scale for r in rows])),
                                                    pick(torch.cat([r.low for r in rows]))))
    else:
        codes, scales = [], []
        for _, tensor, heads in pieces:
            c, sc = _int8_rows(tensor)
            if heads is not None:
                c, sc = _unpermute_rows(c, heads), _unpermute_rows(sc, heads)
            codes.append(c)
            scales.append(sc)
        weight = pick(torch.cat(codes))
        if weight.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"GGUF weights of shape {tuple(weight.shape)} for a layer of "
                             f"{(layer.out_features, layer.in_features)}")
        layer.set_int8(weight, pick(torch.cat(scales)))


def iter_linear_kinds(gguf_file: Path) -> Iterator[tuple[str, str]]:
    """``(name, quantization type)`` of the file's tensors (for reports and tests)."""
    from pagedtree.loading import gguf_reader

    for tensor in gguf_reader.open_gguf(gguf_file).tensors:
        yield tensor.name, tensor.tensor_type.name
