"""Check 5: tree attention against decode attention, timed with the kernel benchmark.

Uses the measurement ``benchmarks/kernels.py`` uses (``attention_workloads``: B
requests over L keys through shuffled block tables, random trees; launches after
L2 flushes inside a CUDA graph, less the flushes) for a decode and for trees
of 16 and 64 nodes sent with their root (17 and 65 queries, as the engine sends
them) at two context lengths, and reports each tree's time over the
decode's at the same KV length (the design target is at most 1.1x) and the decode's
share of the memory bandwidth. Informational: the rows never
fail, except when the benchmark cannot run. In the interpreter the timings mean nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from pagedtree.diagnostics import attention_workloads as bench
from pagedtree.diagnostics.report import INFO, Row, failed_run

CHECK = "tree/decode kernel time"
TARGET_RATIO = 1.1


@dataclass(frozen=True, slots=True)
class BenchPlan:
    """What to time: one batch size, contexts, tree sizes, the attention shape."""

    batch: int
    contexts: tuple[int, ...]
    tree_sizes: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    warmup: int
    iters: int


def bench_plan(device_type: str, quick: bool) -> BenchPlan:
    """A Llama-8B-like layer (32 query heads, 8 KV heads, head dim 128, bf16) at
    batch 8 on a GPU; tiny shapes in the interpreter."""
    if device_type == "cuda":
        return BenchPlan(8, (1024, 4096), (16, 64), 32, 8, 128, 16, torch.bfloat16,
                         warmup=3 if quick else 5, iters=10 if quick else 30)
    return BenchPlan(2, (80, 160), (16, 64), 4, 2, 32, 16, torch.float32, warmup=0, iters=1)


@dataclass(slots=True)
class BenchPoint:
    """One timed launch: context length, tree nodes (1 = decode), seconds, ideal bytes."""

    context: int
    nodes: int
    seconds: float
    ideal_bytes: int


def measure(plan: BenchPlan, device: torch.device, seed: int = 0) -> list[BenchPoint]:
    """Time the decode and every tree size at every context with the benchmark's
    workloads and timer."""
    from pagedtree.kernels import triton_ops

    shape = SimpleNamespace(block_size=plan.block_size, kv_heads=plan.kv_heads, head_dim=plan.head_dim,
                            heads=plan.heads)
    rng = random.Random(seed)
    scale = plan.head_dim ** -0.5
    points = []
    if device.type == "cuda":
        spin_up(device)
    for context in plan.contexts:
        for nodes in (1, *[n for n in plan.tree_sizes if n < context]):
            w = bench.make_workload(shape, plan.batch, context, nodes, plan.dtype, device, rng)
            out = torch.empty_like(w.query)

            def call(w=w, out=out):
                return triton_ops.unified_attention(w.query, w.k_cache, w.v_cache, w.plan, scale, out=out)

            seconds = bench.time_fn(call, plan.warmup, plan.iters, device)
            points.append(BenchPoint(context, nodes, seconds, w.ideal_bytes))
            del w, out
    return points


def spin_up(device: torch.device, seconds: float = 0.3) -> None:
    """Keep the GPU busy for ``seconds`` before timing, so the first timed launch does
    not meet an idle GPU's clocks (one H100 run timed its first decode, L=1024, at
    474 us, where an earlier run had 124 us)."""
    import time

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def bench_rows(device: torch.device, quick: bool, seed: int = 0) -> list[Row]:
    """Check 5's rows: per context, the decode's time and bandwidth, then each tree's
    time over the decode's."""
    plan = bench_plan(device.type, quick)
    try:
        points = measure(plan, device, seed)
        name, peak = bench.peak_gbps(device, None)
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        return [failed_run(CHECK, "decode and trees", exc)]
    return point_rows(plan, points, peak, device.type == "cuda")


def point_rows(plan: BenchPlan, points: list[BenchPoint], peak_gbps: float | None, on_gpu: bool) -> list[Row]:
    """The rows of measured points (see :func:`bench_rows`)."""
    rows = []
    shape = f"B={plan.batch} H={plan.heads}/{plan.kv_heads} D={plan.head_dim}"
    note = "" if on_gpu else " (interpreter: not a timing)"
    for context in plan.contexts:
        decode = next(p for p in points if p.context == context and p.nodes == 1)
        gbps = decode.ideal_bytes / decode.seconds / 1e9
        share = f", {100 * gbps / peak_gbps:.0f}% of {peak_gbps:.0f} GB/s" if peak_gbps and on_gpu else ""
        rows.append(Row(CHECK, f"decode, L={context}, {shape}", f"{decode.seconds * 1e6:.1f} us{note}",
                        f"{gbps:.3g} GB/s{share}", INFO, dict(context=context, nodes=1, seconds=decode.seconds)))
        for point in (p for p in points if p.context == context and p.nodes > 1):
            ratio = point.seconds / decode.seconds
            target = f" (target <= {TARGET_RATIO}x: {'met' if ratio <= TARGET_RATIO else 'missed'})" if on_gpu else ""
            rows.append(Row(CHECK, f"{point.nodes}-node trees, L={context}", f"{point.seconds * 1e6:.1f} us{note}",
                            f"{ratio:.2f}x decode{target}", INFO,
                            dict(context=context, nodes=point.nodes, seconds=point.seconds, vs_decode=ratio)))
    return rows
