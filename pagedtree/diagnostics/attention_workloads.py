"""Attention workloads and a kernel timer, shared by the GPU-day check and the kernel benchmark.

``make_workload``: B requests over L keys each through shuffled block tables, with
random trees of T nodes sent with their root, T + 1 queries as the engine sends them
(T = 1: a decode, one query), and dense copies for the baselines;
``time_fn``/``timed``: a launch's GPU time from CUDA graphs of flushes and launches
(launch overhead out, the L2 cold; eager CUDA events where a launch cannot be
captured; wall clock on a CPU); ``peak_gbps``: a device's peak memory bandwidth from
a table of known GPUs.
``benchmarks/kernels.py`` and the check ``kernel_bench`` both time with these.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from dataclasses import dataclass

import torch

from pagedtree.diagnostics.graph_timing import graph_replay_seconds

# Peak HBM bandwidth in GB/s by device-name substring; first match wins, so more
# specific names come first.
PEAK_GBPS = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("V100", 900.0),
    ("MI300X", 5300.0),
]

def peak_gbps(device: torch.device, override: float | None) -> tuple[str, float | None]:
    """The device's name and its peak memory bandwidth (None when unknown)."""
    if device.type != "cuda":
        return f"CPU ({platform.processor() or platform.machine()}, Triton interpreter)", override
    name = torch.cuda.get_device_name(device)
    if override is not None:
        return name, override
    return name, next((gbps for key, gbps in PEAK_GBPS if key in name), None)


@dataclass
class Workload:
    """B requests of T new tokens each (T = 1: decode) over L keys per request."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    plan: object
    dense_q: torch.Tensor  # [B, H, T, D]
    dense_k: torch.Tensor  # [B, H_kv, L, D]
    dense_v: torch.Tensor
    mask: torch.Tensor  # [B, 1, T, L] bool
    ideal_bytes: int
    meta: object = None  # the AttentionMetadata the plan was built from


def make_workload(args, batch: int, ctx: int, nodes: int, dtype, device, rng: random.Random) -> Workload:
    """Random caches, shuffled block tables and random trees of ``nodes`` nodes below a
    root (``nodes + 1`` queries: a 64-node tree is 65, the shape the engine sends and
    the kernels' tiles are chosen for; ``nodes == 1``: a decode); dense copies for the
    baselines. ``args`` has ``block_size``, ``kv_heads``, ``head_dim`` and ``heads``."""
    from pagedtree.attention import torch_backend as reference
    from pagedtree.step_data import AttentionMetadata
    from pagedtree.kernels.attention_plan import PlanBuffers, build_kernel_plan

    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    per_req = -(-ctx // bs)
    num_blocks = batch * per_req + 1
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = [ids[i * per_req : (i + 1) * per_req] for i in range(batch)]
    queries = 1 if nodes == 1 else nodes + 1
    # Every node below the root (query 0) hangs from an earlier query.
    parents = [None if nodes == 1 else [-1] + [rng.randrange(0, j) for j in range(1, queries)] for _ in range(batch)]
    qsl = [i * queries for i in range(batch + 1)]
    slots = torch.zeros(batch * queries, dtype=torch.long, device=device)
    meta = AttentionMetadata(bs, slots, qsl, [ctx] * batch, tables, parents)
    plan = build_kernel_plan(meta, num_blocks, PlanBuffers(device))
    query = torch.randn(batch * queries, args.heads, d, generator=gen).to(dtype).to(device)
    pos = torch.arange(ctx)
    gather = torch.stack([torch.tensor(t)[pos // bs] * bs + pos % bs for t in tables]).to(device)  # [B, L]
    dense_k = k_cache.view(-1, hkv, d)[gather].transpose(1, 2).contiguous()
    dense_v = v_cache.view(-1, hkv, d)[gather].transpose(1, 2).contiguous()
    mask = torch.zeros(batch, queries, ctx, dtype=torch.bool)
    mask[:, :, : ctx - queries] = True
    for b, par in enumerate(parents):
        mask[b, :, ctx - queries :] = torch.ones(queries, queries, dtype=torch.bool).tril() if par is None \
            else reference.ancestor_mask(par)
    elem = torch.empty((), dtype=dtype).element_size()
    ideal = 2 * batch * ctx * hkv * d * elem + 2 * batch * queries * args.heads * d * elem
    return Workload(
        query=query, k_cache=k_cache, v_cache=v_cache, plan=plan,
        dense_q=query.view(batch, queries, args.heads, d).transpose(1, 2).contiguous(),
        dense_k=dense_k, dense_v=dense_v, mask=mask.unsqueeze(1).to(device), ideal_bytes=ideal, meta=meta,
    )


@dataclass(frozen=True)
class Timing:
    """Seconds a call takes and how they were measured."""

    seconds: float
    graphed: bool  # True: GPU time inside a CUDA graph; False: eager events or wall clock


def time_fn(fn, warmup: int, iters: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (see :func:`timed`)."""
    return timed(fn, warmup, iters, device).seconds


def timed(fn, warmup: int, iters: int, device: torch.device) -> Timing:
    """Seconds ``fn()`` takes. On CUDA: ``iters`` calls, each after an L2 flush,
    captured into one CUDA graph, less a graph of the flushes alone (the median of
    a few replays, per call). Eager launches would time the host's launch overhead
    too: a Triton launch from Python costs tens of microseconds, more than a small
    decode kernel runs. A call that cannot be captured (it syncs, say) falls back to
    CUDA events around eager calls. On a CPU: the median wall time."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return Timing(statistics.median(times), False)
    # Twice the L2 written between calls: every call reads its data from HBM.
    flush = torch.empty(2 * _l2_bytes(device), dtype=torch.int8, device=device)
    try:
        with_calls = graph_replay_seconds(lambda: [(flush.zero_(), fn()) for _ in range(iters)], device)
        flushes = graph_replay_seconds(lambda: [flush.zero_() for _ in range(iters)], device)
        return Timing(max(with_calls - flushes, 0.0) / iters, True)
    except Exception:  # noqa: BLE001 - a capture the call refuses: time it eagerly instead
        torch.cuda.synchronize(device)
    events = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return Timing(statistics.median(s.elapsed_time(e) for s, e in events) / 1e3, False)


def _l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20)
