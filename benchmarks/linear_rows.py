"""Row curves of CPU linear-layer formats: milliseconds per product by row count.

Tree speculation pays when verifying k tokens costs about what decoding one costs, so
what matters for a weight format is its cost at 1 row (a decode step: bandwidth) and
how that grows with rows (a tree's nodes). For each layer shape of Qwen2.5 1.5B and
0.5B and each format it times ``rows x in_features`` products (median of ``--reps``
after warm-up calls) for rows 1..65 (65: a 64-node tree and its root), and reports the
relative error against the fp32 product.

Formats (every one a thin call into a library kernel):

- ``fp32``: oneDNN inner product on a prepacked fp32 weight (``Linear.pack_for_cpu``);
- ``bf16``: the same on a bf16 weight and bf16 activations (torch's own GEMM where
  oneDNN cannot pack bf16: AVX2); ``bf16-chunked``: as a speculating engine runs it (``Linear.make_rows_consistent``:
  where oneDNN runs AMX kernels, products of more than 32 rows in chunks of at most 32);
- ``fp16-fbgemm``: FBGEMM's fp16-weight GEMM (``quantized.linear_dynamic_fp16``);
- ``int8``, ``int4``: torch's weight-only kernels (``Linear.quantize``; bf16 activations);
- ``q8``, ``q4``: ONNX Runtime's MatMulNBits (MLAS) with int8 activations (``Linear.quantize``);
- ``q4-b64``, ``q4-b128``: the same MLAS kernel on 4-bit blocks of 64 and 128;
- ``ggml-q4_k``, ``ggml-q6_k``, ``ggml-q8_0``, ``ggml-q4_0``: llama.cpp's block formats
  (rounded by ggml's quantizer) through ggml's kernels in the file's layout, whose rows
  are independent of their batch (``ggml_matmul``); ``ggml-q4_k-repack``,
  ``ggml-q4_0-repack``: the 8-row interleaved layout llama.cpp loads them in on x86;
- ``zen-int4``: AMD zentorch's weight-only int4 product (``zentorch_woq_linear``: groups
  of 128 with a bf16 scale, bf16 activations), AVX-512 x86 CPUs with zentorch installed;
- ``int8-onednn``: oneDNN's prepacked int8 GEMM (``onednn.qlinear_pointwise``) with each
  row quantized on its own to 7 bits (u8 around 64: AVX2 without VNNI multiplies u8 by
  s8 in pairs that saturate 16 bits beyond that), scales applied after.

    python benchmarks/linear_rows.py                       # every format and shape
    python benchmarks/linear_rows.py --formats q4,int4 --shapes "1.5B gate_up"
    python benchmarks/linear_rows.py --plot benchmarks/results/linear_rows.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedtree.worker.models import block_quant  # noqa: E402
from pagedtree.worker.models.linear import Linear  # noqa: E402

SHAPES = {  # name: (in_features, out_features)
    "1.5B qkv": (1536, 2048), "1.5B o": (1536, 1536), "1.5B gate_up": (1536, 17920), "1.5B down": (8960, 1536),
    "1.5B head": (1536, 151936),
    "0.5B qkv": (896, 1152), "0.5B o": (896, 896), "0.5B gate_up": (896, 9728), "0.5B down": (4864, 896),
    "0.5B head": (896, 151936),
}
ROWS = (1, 2, 4, 8, 16, 32, 65)


def _layer(weight: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def fp32(weight: torch.Tensor) -> Callable:
    layer = _layer(weight)
    layer.pack_for_cpu()
    return layer


def bf16(chunked: bool) -> Callable[[torch.Tensor], Callable]:
    def make(weight: torch.Tensor) -> Callable:
        layer = _layer(weight).to(torch.bfloat16)
        layer.pack_for_cpu()  # where oneDNN cannot pack bf16 (AVX2), torch's own GEMM runs it
        if chunked:
            layer.make_rows_consistent()
        return lambda x: layer(x.to(torch.bfloat16)).float()
    return make


def quantized(mode: str) -> Callable[[torch.Tensor], Callable]:
    def make(weight: torch.Tensor) -> Callable:
        layer = _layer(weight)
        layer.quantize(mode)
        return layer
    return make


def fp16_fbgemm(weight: torch.Tensor) -> Callable:
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def int8_onednn(weight: torch.Tensor, act_bits: int = 7) -> Callable:
    scales = weight.abs().amax(1).clamp(min=1e-12) / 127
    packed = torch.ops.onednn.qlinear_prepack(torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8),
                                              None)
    levels, zero = 2 ** (act_bits - 1) - 1, 2 ** (act_bits - 1)
    w_zeros = torch.zeros(weight.shape[0], dtype=torch.int64)

    def run(x: torch.Tensor) -> torch.Tensor:
        row_scales = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / levels
        qx = (torch.round(x / row_scales) + zero).to(torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(qx, 1.0, zero, packed, scales, w_zeros, None, 1.0, 0,
                                                 torch.float32, "none", [], "")
        return out * row_scales
    return run


def q4_blocks_of(block: int) -> Callable[[torch.Tensor], Callable]:
    def make(weight: torch.Tensor) -> Callable:
        return block_quant.BlockMatMul(block_quant.quantize_blocks(weight, 4, block))
    return make


def ggml_format(type_name: str, repack: bool = False) -> Callable[[torch.Tensor], Callable]:
    def make(weight: torch.Tensor) -> Callable:
        from pagedtree.worker.models import ggml_matmul

        blocks = ggml_matmul.quantize_rows(weight, type_name)
        return ggml_matmul.GgmlMatMul([blocks], repack=repack)
    return make


def zen_int4(weight: torch.Tensor, group: int = 128) -> Callable:
    """AMD zentorch's weight-only int4 product (symmetric codes, a bf16 scale per group
    of ``group`` inputs, bf16 activations): its op library as ``kernels.zen_sdpa``
    loads it."""
    from pagedtree.kernels import zen_sdpa

    if zen_sdpa.library_op() is None:
        raise ImportError(f"zen-int4 needs zentorch: {zen_sdpa.why_not()}")
    n, k = weight.shape
    grouped = weight.view(n, k // group, group)
    scales = (grouped.abs().amax(-1).clamp(min=1e-12) / 7).to(torch.bfloat16)
    codes = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8).view(n, k)
    packed = torch.ops.zentorch.zentorch_woq_repack_weight(codes).transpose(0, 1)
    scales_t = scales.transpose(0, 1).contiguous()
    return lambda x: torch.ops.zentorch.zentorch_woq_linear(x.to(torch.bfloat16), packed, scales_t, None, None).float()


FORMATS: dict[str, Callable[[torch.Tensor], Callable]] = {
    "fp32": fp32, "bf16": bf16(chunked=False), "bf16-chunked": bf16(chunked=True), "fp16-fbgemm": fp16_fbgemm, "int8": quantized("int8"), "int4": quantized("int4"),
    "q8": quantized("q8"), "q4": quantized("q4"), "q4-b64": q4_blocks_of(64), "q4-b128": q4_blocks_of(128),
    "ggml-q4_k": ggml_format("Q4_K"), "ggml-q4_k-repack": ggml_format("Q4_K", repack=True),
    "ggml-q4_0": ggml_format("Q4_0"), "ggml-q4_0-repack": ggml_format("Q4_0", repack=True),
    "ggml-q6_k": ggml_format("Q6_K"), "ggml-q8_0": ggml_format("Q8_0"), "int8-onednn": int8_onednn,
    "zen-int4": zen_int4,
}


def time_ms(fn: Callable, x: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure(formats: list[str], shapes: list[str], rows: tuple[int, ...], reps: int) -> dict:
    from tqdm import tqdm

    results: dict = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                     "rows": list(rows), "cells": []}
    torch.manual_seed(0)
    with torch.inference_mode(), tqdm(total=len(formats) * len(shapes), desc="layers") as bar:
        for shape in shapes:
            k, n = SHAPES[shape]
            weight = torch.randn(n, k) * 0.02
            x = torch.randn(max(rows), k)
            reference = x[:8] @ weight.t()
            for name in formats:
                try:
                    fn = FORMATS[name](weight)
                except ImportError as exc:  # ggml or zentorch not installed: the other formats still run
                    results.setdefault("skipped", {})[name] = f"{type(exc).__name__}: {exc}"
                    bar.update()
                    continue
                error = ((fn(x[:8]) - reference).norm() / reference.norm()).item()
                head = n > 100_000
                ms = [time_ms(fn, x[:r].contiguous(), max(3, reps // 3) if head else reps) for r in rows]
                results["cells"].append({"shape": shape, "format": name, "ms": ms, "rel_error": error})
                bar.set_postfix_str(f"{shape} {name} {ms[0]:.2f} ms")
                bar.update()
                del fn
    return results


def table(results: dict) -> str:
    rows = results["rows"]
    lines = ["| layer | format | rel. error | " + " | ".join(f"{r} rows" for r in rows) + " | 16/1 |",
             "|---|---|---:|" + "---:|" * (len(rows) + 1)]
    for cell in results["cells"]:
        ms = cell["ms"]
        ratio = ms[rows.index(16)] / ms[0] if 16 in rows else float("nan")
        lines.append(f"| {cell['shape']} | {cell['format']} | {cell['rel_error']:.3f} | "
                     + " | ".join(f"{v:.2f}" for v in ms) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(c["shape"] for c in results["cells"]))
    cols = min(3, len(shapes))
    fig, axes = plt.subplots((len(shapes) + cols - 1) // cols, cols, figsize=(5 * cols, 3.6 * ((len(shapes) + cols - 1) // cols)),
                             squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        for cell in (c for c in results["cells"] if c["shape"] == shape):
            ax.plot(results["rows"], cell["ms"], marker="o", label=cell["format"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} {SHAPES[shape][0]} -> {SHAPES[shape][1]}")
        ax.set_xlabel("rows")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shapes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {list(FORMATS)}")
    parser.add_argument("--shapes", default=";".join(SHAPES), help=f"semicolon list of {list(SHAPES)}")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/linear_rows.json", help="JSON (and .md, .png beside it)")
    parser.add_argument("--plot", default=None, help="only plot this JSON")
    args = parser.parse_args(argv)
    if args.plot:
        path = Path(args.plot)
        plot(json.loads(path.read_text()), path.with_suffix(".png"))
        return 0
    formats = [f for f in args.formats.split(",") if f]
    shapes = [s for s in args.shapes.split(";") if s]
    for name in formats:
        if name not in FORMATS:
            parser.error(f"unknown format {name!r}")
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}")
    results = measure(formats, shapes, tuple(int(r) for r in args.rows.split(",")), args.reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(table(results) + "\n")
    plot(results, out.with_suffix(".png"))
    print(table(results))
    for name, reason in results.get("skipped", {}).items():
        print(f"{name}: not measured ({reason})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
