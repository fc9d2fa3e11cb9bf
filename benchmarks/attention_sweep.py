"""Tile sweep of the paged (tree) attention kernel: decode and tree launches timed with
other tile shapes than the one the launch code picks, to find the shapes that bring
decode attention near the memory bandwidth.

For each workload (B requests over L keys, a decode or trees of T nodes sent with
their root, T + 1 queries as the engine sends them: the kernel benchmark's workloads, ``diagnostics/attention_workloads.py``; first one
request's decodes, the batch-1 step's attention) the default
tile (``triton_ops.default_tile_shape``) is timed, then every variant: keys per
inner-loop tile (``--tile-n``: 16 keys stay inside one cache block of 16; 32 and 64
gather their block ids key by key, as vLLM's unified kernel does), the split-KV
count times ``--split-factors``, and ``--warps``. A variant whose output differs
from the default's by more than the dtype's rounding is marked wrong (and not a
candidate). Rows print as they are measured (a run cut short by a timeout keeps
what it printed); the end lists the best tile per workload against the default.
Each launch is timed on the GPU inside a CUDA graph, after an L2 flush, so the
host's launch overhead is not counted (a row marked "eager" could not be captured
and was timed with events around eager launches).

With FlashInfer importable on a GPU (``--flashinfer auto``; ``scripts/pack_flashinfer.sh``
builds it for a machine without a registry), each workload also runs FlashInfer's
kernels through the engine's FlashInfer backend on the same cache and plan: decodes
on its CUDA-core and its tensor-core decode kernels, trees on its FA2 prefill with
the trees' custom mask. Their outputs are checked against the default tile's and
their times listed beside it.

    python benchmarks/attention_sweep.py                       # a GPU: B=8, 32/8 heads, D=128, bf16
    python benchmarks/attention_sweep.py --device cpu --quick  # the interpreter, tiny shapes: a dry run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one iteration (the interpreter's dry run)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--single-contexts", default="256,1024",
                        help="comma-separated KV lengths of one request's decode, swept first (the batch-1 step)")
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated KV lengths L")
    parser.add_argument("--tree-sizes", default="16,64", help="comma-separated tree nodes (decode always runs)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tile-n", default="16,32,64", help="comma-separated keys per tile")
    parser.add_argument("--split-factors", default="1,2", help="comma-separated multiples of the default split")
    parser.add_argument("--warps", default="default,8", help="comma-separated warp counts ('default': the tile's)")
    parser.add_argument("--flashinfer", choices=("auto", "on", "off"), default="auto",
                        help="FlashInfer's kernels beside the tiles (auto: on a GPU where it imports)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--no-progress", action="store_true")
    if parser.parse_known_args(argv)[0].quick:  # tiny defaults; options given still win
        parser.set_defaults(batch=2, contexts="80,160", single_contexts="", tree_sizes="16", heads=4, kv_heads=2,
                            head_dim=32, iters=1)
    return parser.parse_args(argv)


@dataclass(slots=True)
class SweepRow:
    """One timed tile on one workload."""

    batch: int
    context: int
    nodes: int  # 1 = decode
    tile_n: int
    num_splits: int
    num_warps: int | None
    block_m: int
    microseconds: float
    gbps: float
    vs_default: float  # the default tile's time over this one's (> 1: faster)
    default: bool
    wrong: bool
    kernel: str = "triton"  # or FlashInfer's: "flashinfer-decode", "flashinfer-decode-tc", "flashinfer-prefill"
    graphed: bool = True  # timed inside a CUDA graph (False: eager launches, or a CPU)


def _marks(row: SweepRow, device) -> str:
    """A row's notes: a wrong output, a GPU time taken outside a CUDA graph."""
    return ("  WRONG" if row.wrong else "") + ("  eager" if device.type == "cuda" and not row.graphed else "")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def variants(default, tile_ns: list[int], factors: list[int], warps: list[int | None]) -> list:
    """The default tile first, then every other combination (each once)."""
    seen = {default}
    out = [default]
    for tile_n in tile_ns:
        for factor in factors:
            for warp in warps:
                tile = replace(default, tile_n=tile_n, num_splits=max(1, default.num_splits * factor),
                               num_warps=default.num_warps if warp is None else warp)
                if tile not in seen:
                    seen.add(tile)
                    out.append(tile)
    return out


def flashinfer_kernels(nodes: int) -> list[tuple[str, bool | None]]:
    """FlashInfer's kernels for a workload: (row name, decode on tensor cores)."""
    if nodes == 1:
        return [("flashinfer-decode", False), ("flashinfer-decode-tc", True)]
    return [("flashinfer-prefill", None)]


def want_flashinfer(choice: str, device) -> bool:
    """Whether to run FlashInfer's rows; "on" where it cannot run is an error."""
    if choice == "off":
        return False
    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention

    import torch

    reason = FlashInferPagedAttention.unavailable(device, torch.bfloat16)
    if reason is not None and choice == "on":
        raise SystemExit(f"--flashinfer on: {reason}")
    if reason is not None:
        print(f"# FlashInfer rows skipped: {reason}", flush=True)
    return reason is None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device_name = args.device
    if device_name == "auto":
        import torch

        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    if device_name == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    import torch
    from tqdm import tqdm

    from pagedtree.diagnostics import attention_workloads as bench
    from pagedtree.diagnostics.kernel_bench import spin_up
    from pagedtree.kernels import triton_ops

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SimpleNamespace(block_size=args.block_size, kv_heads=args.kv_heads, head_dim=args.head_dim,
                            heads=args.heads)
    name, peak = bench.peak_gbps(device, None)
    print(f"# attention tile sweep on {name}: B={args.batch} (and 1 at L={args.single_contexts or '-'}) "
          f"H={args.heads}/{args.kv_heads} D={args.head_dim} block {args.block_size}, "
          f"{str(dtype).removeprefix('torch.')}" + (f", peak {peak:.0f} GB/s" if peak else ""), flush=True)
    if device.type == "cuda":
        spin_up(device)
    with_flashinfer = want_flashinfer(args.flashinfer, device)
    rng = random.Random(args.seed)
    scale = args.head_dim ** -0.5
    warps = [None if w == "default" else int(w) for w in args.warps.split(",") if w.strip()]
    # One request's decodes first (the batch-1 step), then the batch's decodes (the
    # bandwidth target), then trees by size: a run cut short keeps those.
    workloads = [(1, ctx, 1) for ctx in _ints(args.single_contexts)] + sorted(
        ((args.batch, ctx, nodes) for ctx in _ints(args.contexts)
         for nodes in (1, *[n for n in _ints(args.tree_sizes) if n < ctx])), key=lambda w: (w[2], w[1]))
    rows: list[SweepRow] = []
    bar = tqdm(workloads, desc="workloads", disable=args.no_progress, file=sys.stderr)
    for batch, context, nodes in bar:
        w = bench.make_workload(shape, batch, context, nodes, dtype, device, rng)
        default = triton_ops.default_tile_shape(w.plan, args.heads, args.kv_heads, device, args.head_dim,
                                                w.k_cache.element_size())
        reference = triton_ops.unified_attention(w.query, w.k_cache, w.v_cache, w.plan, scale, tile=default)
        bound = (2 ** -7 if dtype != torch.float32 else 1e-5) * float(w.v_cache.abs().max()) + 1e-4
        base = None
        for tile in variants(default, _ints(args.tile_n), _ints(args.split_factors), warps):
            out = torch.empty_like(w.query)

            def call(tile=tile, out=out):
                return triton_ops.unified_attention(w.query, w.k_cache, w.v_cache, w.plan, scale, tile=tile, out=out)

            try:
                timing = bench.timed(call, 2, args.iters, device)
            except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses is a row, not the end
                print(f"B={batch:2d} L={context:5d} T={nodes:3d} tile_n {tile.tile_n:3d} splits {tile.num_splits:2d} "
                      f"warps {tile.num_warps}: failed ({type(exc).__name__}: {str(exc)[:80]})", flush=True)
                continue
            wrong = float((out.float() - reference.float()).abs().max()) > bound
            seconds = timing.seconds
            base = base or seconds
            row = SweepRow(batch, context, nodes, tile.tile_n, tile.num_splits, tile.num_warps, tile.block_m,
                           seconds * 1e6, w.ideal_bytes / seconds / 1e9, base / seconds, tile == default, wrong,
                           graphed=timing.graphed)
            rows.append(row)
            share = f" {100 * row.gbps / peak:5.1f}%" if peak and device.type == "cuda" else ""
            print(f"B={batch:2d} L={context:5d} T={nodes:3d} tile_n {tile.tile_n:3d} splits {tile.num_splits:2d} "
                  f"warps {tile.num_warps or '-':>2} rows {tile.block_m:3d}: {row.microseconds:9.1f} us "
                  f"{row.gbps:8.1f} GB/s{share}  {row.vs_default:5.2f}x default"
                  + ("  (default)" if row.default else "") + _marks(row, device), flush=True)
        if with_flashinfer and base is not None:
            rows += time_flashinfer(w, batch, context, nodes, scale, reference, bound, base, args, peak, device)
        del w
    print("best tile per workload (correct outputs only):")
    for batch, context, nodes in workloads:
        here = [r for r in rows if (r.batch, r.context, r.nodes) == (batch, context, nodes) and not r.wrong]
        mine = [r for r in here if r.kernel == "triton"]
        if not mine:
            continue
        best = min(mine, key=lambda r: r.microseconds)
        print(f"  B={batch:2d} L={context:5d} T={nodes:3d}: tile_n {best.tile_n} splits {best.num_splits} "
              f"warps {best.num_warps or '-'} -> {best.microseconds:.1f} us, {best.vs_default:.2f}x the default")
        theirs = [r for r in here if r.kernel != "triton"]
        if theirs:
            fastest = min(theirs, key=lambda r: r.microseconds)
            print(f"  {'':22s}FlashInfer's fastest, {fastest.kernel}: {fastest.microseconds:.1f} us, "
                  f"{best.microseconds / fastest.microseconds:.2f}x the best tile")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_gbps": peak, "args": vars(args),
                                               "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if any(r.wrong for r in rows if r.default) else 0


def time_flashinfer(w, batch: int, context: int, nodes: int, scale: float, reference, bound: float, base: float,
                    args, peak, device) -> list[SweepRow]:
    """FlashInfer's kernels on workload ``w`` through the engine's backend (planned
    once, as a step's layers share a plan), each a row against the default tile."""
    import torch

    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention
    from pagedtree.diagnostics import attention_workloads as bench

    rows = []
    for kernel, tensor_cores in flashinfer_kernels(nodes):
        try:
            backend = FlashInferPagedAttention([(w.k_cache, w.v_cache)], scale, decode_tensor_cores=tensor_cores)
            backend.begin_step(w.meta)
            out = backend.attend(0, w.query)  # plans, and builds or loads the kernel
            timing = bench.timed(lambda: backend.attend(0, w.query), 2, args.iters, device)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not run is a row, not the end
            print(f"B={batch:2d} L={context:5d} T={nodes:3d} {kernel}: failed "
                  f"({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        wrong = float((out.float() - reference.float()).abs().max()) > bound
        seconds = timing.seconds
        row = SweepRow(batch, context, nodes, 0, 0, None, 0, seconds * 1e6, w.ideal_bytes / seconds / 1e9,
                       base / seconds, False, wrong, kernel, timing.graphed)
        rows.append(row)
        share = f" {100 * row.gbps / peak:5.1f}%" if peak else ""
        print(f"B={batch:2d} L={context:5d} T={nodes:3d} {kernel:38s}: {row.microseconds:9.1f} us "
              f"{row.gbps:8.1f} GB/s{share}  {row.vs_default:5.2f}x default" + _marks(row, device), flush=True)
        del backend
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
