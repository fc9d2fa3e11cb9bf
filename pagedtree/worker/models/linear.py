"""Linear layers for CPU inference: oneDNN-prepacked fp32/bf16, and weight-only int8/int4.

Every layer starts as a plain ``nn.Linear`` (the loader fills its dense weight); then
one of these replaces the dense weight in place:

- ``pack_for_cpu``: oneDNN's blocked layout for fp32 or bf16 weights, every product
  through oneDNN's inner product (the fastest dense path for the few-row products of
  decoding and tree verification; figures in benchmarks/RESULTS.md, "CPU linear
  layers");
- ``quantize("int8")``: symmetric per-output-channel int8 weights,
  ``torch._weight_int8pack_mm``;
- ``quantize("int4")``: asymmetric int4 weights in groups of 32 input features with a
  scale and a zero point each, ``aten._weight_int4pack_mm_for_cpu`` (the packed layout
  of ``aten._convert_weight_to_int4pack_for_cpu``);
- ``quantize("q4")`` / ``quantize("q8")``: 4- or 8-bit blocks of 32 with int8
  activations, ONNX Runtime's MLAS kernels (``block_quant``);
- ``set_ggml`` / ``quantize("ggml")``: llama.cpp's block formats (a GGUF file's own
  tensors, or Q4_K from a dense weight) multiplied by ggml's CPU kernels, llama.cpp's
  own (``ggml_matmul``).

torch's quantized kernels take bf16 activations (their fp32 paths are an order of
magnitude slower), so an int8/int4 layer computes in bf16; a q4/q8/ggml layer takes
fp32.
Either returns the input's dtype. Nothing here is hand-written GEMM: these are torch's
and ONNX Runtime's own CPU kernels.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from pagedtree.devices import cpu_flags
from pagedtree.worker.models import block_quant, ggml_matmul
from pagedtree.worker.models.row_blocks import in_row_blocks

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4", "q4", "q8", "q4-rounded", "ggml")
INT4_GROUP_SIZE = 32
# oneDNN picks its blocked layout for an expected row count: 16 serves 1-32 rows well.
_PACK_ROWS_HINT = 16
_ONEDNN_PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# The int4 kernel's packing tiles the input dimension by this many 16-element tiles.
_INT4_INNER_K_TILES = 8
# oneDNN's AMX kernels (Intel Xeon from Sapphire Rapids on) choose how they block a
# 16-bit product by its row count: a row among 33 or more gets other bits than the
# same row among 2-32 (1-ulp differences in 1-55 of 64 rows of the Qwen layers'
# shapes), while products of 2-32 rows share one kernel whose rows are independent
# (measured at 1, 2, 8 and 32 threads on 13 shapes, every row at every position).
ONEDNN_AMX_ROW_LIMIT = 32
# Row counts of the probe that checks, per shape, that chunks of up to the limit agree
# (older oneDNN releases, torch 2.11's among them, give rows other bits at nearly
# every row count on AMX).
_CHUNK_PROBE_SIZES = (2, 3, 5, 22)
# (out, in, dtype, threads) -> whether rows agree in every chunk of up to the limit.
_CHUNKS_AGREE: dict[tuple, bool] = {}
_WARNED_SHAPES: set[tuple[int, int]] = set()
# (library, out, in, threads) -> whether an fp32 row alone gets other bits than among others
# (``Linear.lone_row_needs_padding``).
_LONE_ROW_DIFFERS: dict[tuple, bool] = {}


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack (and run) ``dtype`` weights on this CPU.

    fp32 packs on any x86 CPU; oneDNN's bf16 inner product needs AVX512 (BW, VL and
    DQ) or AVX-NE-CONVERT, so on older CPUs bf16 weights stay dense and torch's own
    GEMM runs them. Probed once per dtype on a tiny weight.
    """
    if not _ONEDNN_PACKING or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), _PACK_ROWS_HINT)
    except RuntimeError:
        return False
    return True


def onednn_may_run_amx() -> bool:
    """Whether oneDNN may run its AMX kernels in this process: the CPU has AMX-BF16 and
    ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) does not cap oneDNN below them."""
    if "amx_bf16" not in cpu_flags():
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return cap in ("ALL", "DEFAULT") or "AMX" in cap


def row_chunks(rows: int, limit: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of the fewest chunks of at most ``limit`` rows covering
    ``rows``, as even as can be (so no chunk is a lone row once ``rows`` > ``limit`` >= 3)."""
    count = max(1, -(-rows // limit))
    bounds = [rows * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``(codes [N, K] int8, scales [N] fp32)``, weight ~ codes * scale."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of ``group_size`` input features.

    Returns ``(codes [N, K] int32 in 0..15, scales_and_zeros [K/group, N, 2] fp32)`` with
    weight ~ (code - 8) * scale + zero, the convention of torch's int4 CPU kernel.
    """
    w = weight.detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {k}")
    groups = w.view(n, k // group_size, group_size)
    low = groups.amin(dim=-1)
    high = groups.amax(dim=-1)
    scale = ((high - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return codes, int4_scales_and_zeros(scale, low)


def int4_scales_and_zeros(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``[K/group, N, 2]`` (scale, zero) for per-group ``scale`` and minimum ``low`` ``[N, K/group]``
    of codes 0..15 (weight = code * scale + low = (code - 8) * scale + zero)."""
    return torch.stack([scale.t(), (low + 8.0 * scale).t()], dim=-1).contiguous()


class Linear(nn.Linear):
    """``nn.Linear`` that can drop its dense weight for a faster CPU form (see module docstring)."""

    packed_weight: torch.Tensor | None = None
    # Compute one-row products as two rows (see ``forward``); set by
    # ``DecoderForCausalLM.make_rows_consistent`` for engines that verify trees.
    pad_single_rows: bool = False
    # Compute dense products in blocks of exactly this many rows (``row_blocks``); set
    # by ``make_rows_consistent`` on CUDA, where cuBLAS picks its kernel by row count.
    row_block: int | None = None
    # Compute oneDNN products of more rows than this in chunks of at most this many
    # (``row_chunks``); set by ``make_rows_consistent`` where oneDNN runs AMX kernels.
    row_chunk: int | None = None
    # Quantization: "int8"/"int4" (codes and scales for torch's kernels), "q4"/"q8"
    # (blocks multiplied through ONNX Runtime) or "ggml" (llama.cpp's blocks and kernels).
    quantization: str | None = None
    qweight: torch.Tensor | None = None
    qscales: torch.Tensor | None = None
    block_matmul: block_quant.BlockMatMul | ggml_matmul.GgmlMatMul | None = None

    def reset_parameters(self) -> None:
        # A layer built on the meta device is loaded next (see
        # ``VocabParallelEmbedding.reset_parameters``): no random initialisation.
        if not self.weight.is_meta:
            super().reset_parameters()

    def pack_for_cpu(self) -> bool:
        """Reorder an fp32 or bf16 CPU weight into oneDNN's layout and drop the dense one.

        Returns whether it packed. A weight tied to the embedding keeps living there;
        this layer then holds a packed copy of it.
        """
        weight = self.weight
        if (weight is None or not _ONEDNN_PACKING or weight.device.type != "cpu"
                or weight.dtype not in (torch.float32, torch.bfloat16)):
            return False
        if not onednn_packs(weight.dtype):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        self.weight = None
        return True

    def quantize(self, mode: str) -> None:
        """Replace the dense weight by ``mode`` (one of ``QUANTIZATIONS``) codes and scales."""
        if self.weight is None:
            raise ValueError("quantize needs the dense weight (quantize before packing)")
        if mode in block_quant.BITS:
            self.set_blocks(block_quant.quantize_blocks(self.weight, block_quant.BITS[mode]))
        elif mode == "ggml":
            self.set_ggml([ggml_matmul.quantize_rows(self.weight)])
        elif mode == "int8":
            codes, scales = quantize_int8(self.weight)
            self.set_int8(codes, scales)
        elif mode == "int4":
            codes, scales_and_zeros = quantize_int4(self.weight)
            self.set_int4(codes, scales_and_zeros)
        else:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")

    def set_int8(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Use int8 ``codes [N, K]`` with per-row ``scales [N]`` (drops the dense weight)."""
        self.quantization = "int8"
        self.qweight = codes.to(torch.int8).contiguous()
        self.qscales = scales.to(torch.bfloat16)
        self.weight = None

    def set_blocks(self, weights: block_quant.BlockWeights) -> None:
        """Use ``weights`` (q4 or q8 blocks) through ONNX Runtime (drops the dense weight)."""
        if (weights.n, weights.k) != (self.out_features, self.in_features):
            raise ValueError(f"block weights of shape {(weights.n, weights.k)} for a layer of "
                             f"{(self.out_features, self.in_features)}")
        self.quantization = "q4" if weights.bits == 4 else "q8"
        self.block_matmul = block_quant.BlockMatMul(weights)
        self.weight = None

    def set_ggml(self, parts: list[ggml_matmul.GgmlBlocks]) -> None:
        """Use llama.cpp blocks (the checkpoint tensors of this layer, stacked by rows)
        through ggml's kernels (drops the dense weight)."""
        shape = (sum(p.n for p in parts), parts[0].k if parts else 0)
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"GGUF blocks of shape {shape} for a layer of {(self.out_features, self.in_features)}")
        self.quantization = "ggml"
        self.block_matmul = ggml_matmul.GgmlMatMul(parts)
        self.weight = None

    def set_int4(self, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """Use int4 ``codes [N, K]`` (0..15) with ``scales_and_zeros [K/32, N, 2]``."""
        self.quantization = "int4"
        self.qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), _INT4_INNER_K_TILES
        )
        self.qscales = scales_and_zeros.to(torch.bfloat16).contiguous()
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_matmul is not None:
            rows = x.reshape(-1, self.in_features)
            pad = self.pad_single_rows and rows.shape[0] == 1
            out = self.block_matmul(rows.expand(2, -1) if pad else rows)
            if pad:
                out = out[:1]
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.quantization is not None:
            rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
            if self.quantization == "int8":
                out = torch._weight_int8pack_mm(rows, self.qweight, self.qscales)
            else:
                out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, INT4_GROUP_SIZE, self.qscales)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.packed_weight is None:
            if self.row_block is not None:
                rows = x.reshape(-1, self.in_features)
                out = in_row_blocks(rows, self.row_block, lambda block: F.linear(block, self.weight, self.bias))
                return out.view(*x.shape[:-1], self.out_features)
            if self.pad_single_rows and x.dim() == 2 and x.shape[0] == 1:
                return F.linear(x.expand(2, -1), self.weight, self.bias)[:1]
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2:  # the model's flat [tokens, features] rows: no reshapes to dispatch
            # oneDNN's one-row kernel accumulates in another order than its multi-row one
            # (1-ulp differences in bf16 on the Qwen 1.5B's layers), so a token decoded
            # alone would not get the logits it gets inside a verified tree; as two rows
            # it takes the multi-row kernel, whose rows are independent.
            pad = self.pad_single_rows and x.shape[0] == 1
            out = self._onednn_product((x.expand(2, -1) if pad else x).contiguous())
            return out[:1] if pad else out
        out = self._onednn_product(x.reshape(-1, self.in_features).contiguous())
        return out.view(*x.shape[:-1], self.out_features)

    def _onednn_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed weight's product with ``rows`` ([n, in_features], contiguous), in
        chunks of at most ``row_chunk`` rows where that is set."""
        if self.row_chunk is None or rows.shape[0] <= self.row_chunk:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return torch.cat([torch.ops.mkldnn._linear_pointwise(rows[start:stop], self.packed_weight, self.bias,
                                                             "none", [], "")
                          for start, stop in row_chunks(rows.shape[0], self.row_chunk)])

    def make_rows_consistent(self) -> bool:
        """Compute each row as it is computed alone (padded), whatever the row count of
        the product: pad lone rows where the library needs it
        (``lone_row_needs_padding``) and, where oneDNN runs AMX kernels, split 16-bit
        products into chunks of at most ``ONEDNN_AMX_ROW_LIMIT`` rows. Returns whether
        it pads or chunks."""
        self.pad_single_rows = self.lone_row_needs_padding()
        sixteen_bit = self.packed_weight is not None and self.packed_weight.dtype != torch.float32
        self.row_chunk = ONEDNN_AMX_ROW_LIMIT if sixteen_bit and onednn_may_run_amx() else None
        shape = (self.out_features, self.in_features)
        if self.row_chunk is not None and not self.chunks_agree() and shape not in _WARNED_SHAPES:
            _WARNED_SHAPES.add(shape)  # once a shape: a model repeats its layers' shapes
            logger.warning(
                "oneDNN's AMX kernels give a %dx%d layer's rows other bits by row count even in chunks of up to "
                "%d rows (torch %s): greedy speculation in bf16 may leave plain decoding's tokens at near-ties. "
                "torch 2.13 (scripts/setup.sh) keeps such chunks exact; ONEDNN_MAX_CPU_ISA=AVX10_1_512, set "
                "before the process starts, keeps every product exact without AMX.",
                self.out_features, self.in_features, self.row_chunk, torch.__version__)
        return self.pad_single_rows or self.row_chunk is not None

    def chunks_agree(self) -> bool:
        """Whether this layer's chunked products give every row the bits of the same
        row in any other chunk of up to ``row_chunk`` rows: seeded rows computed as one
        full chunk and again in chunks of ``_CHUNK_PROBE_SIZES`` rows, compared bit for
        bit (once per shape, dtype and thread count; in 16 bits a different kernel
        changed 1 to 55 of 64 rows of the Qwen shapes)."""
        limit = self.row_chunk or 1
        key = (self.out_features, self.in_features, self.packed_weight.dtype, torch.get_num_threads())
        if key not in _CHUNKS_AGREE:
            rows = torch.randn(limit, self.in_features, generator=torch.Generator().manual_seed(0))
            rows = rows.to(self.packed_weight.dtype)
            with torch.inference_mode():
                whole = self._onednn_product(rows)
                start, parts = 0, []
                for size in (*_CHUNK_PROBE_SIZES, limit):
                    size = min(size, limit - start)
                    if size <= 0:
                        break
                    parts.append(self._onednn_product(rows[start:start + size].contiguous()))
                    start += size
                _CHUNKS_AGREE[key] = torch.equal(torch.cat(parts), whole)
        return _CHUNKS_AGREE[key]

    def lone_row_needs_padding(self) -> bool:
        """Whether this layer may compute a row alone with other bits than the same row
        among others: then a token decoded alone would not get the logits it gets in a
        verified tree, and ``pad_single_rows`` is needed (oneDNN and MLAS may send one
        row through a kernel that sums in another order; whether they do depends on the
        CPU, the library and the shape).

        A layer with 16-bit outputs always pads: rounding to bf16 hides most of a
        different order's differences (oneDNN's one-row bf16 kernel changed 11 to 22 of
        65 rows of the Qwen layers' shapes, so no cheap probe settles it). A layer with
        fp32 outputs (q4, q8, fp32) is measured once per library, shape and thread count:
        8 seeded random rows, each alone and among the others; in fp32 a different order
        shows in nearly every output."""
        if self.packed_weight is not None:
            kind, dtype = "onednn", self.packed_weight.dtype
        elif self.block_matmul is not None:
            kind, dtype = self.quantization, torch.float32
        else:
            kind, dtype = "dense", self.weight.dtype
        if dtype != torch.float32:
            return True
        key = (kind, self.out_features, self.in_features, torch.get_num_threads())
        if key not in _LONE_ROW_DIFFERS:
            padded, self.pad_single_rows = self.pad_single_rows, False
            try:
                rows = torch.randn(8, self.in_features, generator=torch.Generator().manual_seed(0))
                with torch.inference_mode():
                    together = self(rows)
                    _LONE_ROW_DIFFERS[key] = not all(torch.equal(self(rows[i : i + 1])[0], together[i])
                                                     for i in range(len(rows)))
            finally:
                self.pad_single_rows = padded
        return _LONE_ROW_DIFFERS[key]

    @property
    def weight_bytes(self) -> int:
        """Bytes this layer's weight takes in its current form."""
        tensors = [self.weight, self.packed_weight, self.qweight, self.qscales]
        blocks = self.block_matmul.nbytes if self.block_matmul is not None else 0
        return blocks + sum(t.numel() * t.element_size() for t in tensors if t is not None)
