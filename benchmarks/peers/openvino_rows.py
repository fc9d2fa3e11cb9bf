"""Row curves of OpenVINO's int4 weight-compressed products on CPU, beside
``benchmarks/linear_rows.py``'s (milliseconds per product by row count).

A MatMul whose weight is u4 codes with a zero point and an fp32 scale per group of
``--group`` inputs (the pattern OpenVINO's CPU plugin runs as a compressed weight),
activations quantized to int8 per group on the fly (``DYNAMIC_QUANTIZATION_GROUP_SIZE``),
random weights of one layer shape. It also checks that a row's result has the same bits
alone and anywhere in a batch of up to 65 rows (what tree verification needs).

OpenVINO is not a dependency of pagedtree; run it in an environment of its own:

    python3 -m venv .venv-openvino && .venv-openvino/bin/pip install openvino numpy
    .venv-openvino/bin/python benchmarks/peers/openvino_rows.py --shape 1536x17920
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

ROWS = (1, 2, 4, 8, 16, 32, 65)


def compressed_matmul(k: int, n: int, group: int, threads: int, seed: int = 0):
    """A compiled ``x @ w.T`` on u4 groups, the dequantized weight, and random rows."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(seed)
    blocks = (rng.standard_normal((n, k)) * 0.02).astype(np.float32).reshape(n, k // group, group)
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    scale = np.maximum((high - low) / 15, 1e-12).astype(np.float32)
    zero = np.clip(np.round(-low / scale), 0, 15)
    codes = np.clip(np.round(blocks / scale[..., None] + zero[..., None]), 0, 15).astype(np.uint8)
    dequantized = ((codes - zero[..., None]) * scale[..., None]).reshape(n, k)
    x = ops.parameter([-1, k], np.float32, name="x")
    weight = ops.multiply(ops.subtract(ops.convert(ops.constant(codes, ov.Type.u4), ov.Type.f32),
                                       ops.convert(ops.constant(zero.astype(np.uint8)[..., None], ov.Type.u4),
                                                   ov.Type.f32)),
                          ops.constant(scale[..., None]))
    weight = ops.reshape(weight, ops.constant(np.array([n, k], np.int64)), False)
    model = ov.Model([ops.matmul(x, weight, False, True)], [x])
    config = {"INFERENCE_NUM_THREADS": threads, "DYNAMIC_QUANTIZATION_GROUP_SIZE": group,
              "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
    return request, dequantized, rng.standard_normal((max(ROWS), k)).astype(np.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1536x17920", help="IN x OUT features (default: the 1.5B's gate_up)")
    parser.add_argument("--group", type=int, default=32, help="inputs per group (weights and activations)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    k, n = (int(v) for v in args.shape.lower().split("x"))
    run, dequantized, xs = compressed_matmul(k, n, args.group, args.threads)
    infer = lambda rows: run.infer({0: np.ascontiguousarray(rows)})[0].copy()
    error = np.linalg.norm(infer(xs[:8]) - xs[:8] @ dequantized.T) / np.linalg.norm(xs[:8] @ dequantized.T)
    times = []
    for rows in ROWS:
        for _ in range(3):
            infer(xs[:rows])
        samples = []
        for _ in range(args.reps):
            started = time.perf_counter()
            infer(xs[:rows])
            samples.append(time.perf_counter() - started)
        times.append(statistics.median(samples) * 1e3)
    full = infer(xs)
    invariant = all(np.array_equal(infer(xs[s:s + r]), full[s:s + r])
                    for r in (1, 2, 3, 4, 5, 8, 16, 17, 64) for s in sorted({0, (65 - r) // 2, 65 - r}))
    print(f"| {k} -> {n} | openvino int4 (groups of {args.group}) | {error:.3f} | "
          + " | ".join(f"{t:.2f}" for t in times) + f" | rows independent of their batch: {invariant} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
