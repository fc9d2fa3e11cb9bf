"""Tile sweep of the batch-invariant product kernel: which fixed shape streams best.

Every configuration here is batch-invariant (a layer keeps one for every row count);
this times alternatives at a decode's one row (the weight stream) and at 64 and
2,080 rows for the Qwen2.5-1.5B's bandwidth-heavy layers, so the fixed choice in
``kernels/dense_ops.py`` can be made from measurements. Timed as CUDA graphs over
enough weight copies to spill the L2 cache (``diagnostics/dense_check.graph_seconds``).

    python benchmarks/dense_sweep.py                       # on a GPU
    python benchmarks/dense_sweep.py --device cpu --tiny   # a dry run in the interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, n_out, k, gated, rows timed): the 1.5B's small layers and the 0.5B draft's at
# one row first, where they are latency-bound (9-10 us for 4-6 MB on an H100 and an
# H200: the batch-1 step's largest gap to its weight stream; a run cut short by its
# time bound keeps these), then its heavy layers at a decode's and a batch of trees' rows.
LAYERS = (("qkv", 2048, 1536, False, (1,)), ("o", 1536, 1536, False, (1,)),
          ("draft qkv", 1152, 896, False, (1,)), ("draft gate_up", 4864, 896, True, (1,)),
          ("draft down", 896, 4864, False, (1,)),
          ("gate_up", 8960, 1536, True, (1, 2080)), ("down", 1536, 8960, False, (1, 2080)),
          ("head", 151_936, 1536, False, (1, 2080)))
TINY_LAYERS = (("gate_up", 80, 64, True, (1, 16)), ("down", 64, 160, False, (1, 16)))
# (BLOCK_N, BLOCK_K, warps, stages, programs per SM at one row, groups a split tile's
# last program loads together: 0 for the shipped ``dense_ops.reduce_unroll``); the
# first is the shipped one (gated layers ship 8 warps and 2 stages before sm_90), the
# second the same with one group's load in flight at a time.
CONFIGS = [(64, 64, 4, 4, 2, 0), (64, 64, 4, 4, 2, 1), (64, 64, 4, 3, 4, 0), (64, 64, 4, 4, 8, 0),
           (32, 64, 4, 4, 2, 0), (32, 128, 4, 3, 2, 0), (64, 128, 4, 3, 2, 0), (128, 64, 4, 3, 2, 0),
           (128, 64, 8, 3, 2, 0), (64, 64, 8, 2, 2, 0)]
TINY_CONFIGS = [(64, 64, 4, 3, 2, 0), (32, 64, 4, 3, 4, 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and two configurations (the dry run)")
    parser.add_argument("--rows", default=None, help="row counts to time (default: each layer's own)")
    parser.add_argument("--max-configs", type=int, default=len(CONFIGS), help="configurations tried per layer "
                                                                              "(the first N)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from pagedtree.diagnostics.dense_check import graph_seconds
    from pagedtree.kernels import dense_kernels as D
    from pagedtree.kernels import dense_ops

    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    sms = dense_ops.device_sms(device)
    chosen_rows = [int(r) for r in args.rows.split(",")] if args.rows else None
    configs = TINY_CONFIGS if args.tiny else CONFIGS[:args.max_configs]
    results = []
    started = time.perf_counter()
    for name, n_out, k, gated, layer_rows in (TINY_LAYERS if args.tiny else LAYERS):
        rows_list = chosen_rows or list(layer_rows)
        halves = 2 if gated else 1
        weight = (torch.randn(halves * n_out, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        nbytes = weight.numel() * 2
        copies = max(1, min(16, -(-(256 << 20) // nbytes))) if device.type == "cuda" else 1
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        for block_n, block_k, warps, stages, per_sm, unroll in configs:
            tiles_n = -(-n_out // block_n)
            steps = -(-k // block_k)
            wanted = min(steps, max(1, -(-per_sm * sms // tiles_n)))
            per_group = max(1, steps // wanted)
            groups = -(-steps // per_group)
            unroll = unroll or dense_ops.reduce_unroll(groups, gated)
            for m in rows_list:
                x = (torch.randn(m, k, generator=gen, device=device)).to(torch.bfloat16)
                out = torch.empty(m, n_out, dtype=torch.bfloat16, device=device)
                tiles = -(-m // dense_ops.BLOCK_M) * tiles_n
                split = groups > 1 and m <= dense_ops.SPLIT_MAX_ROWS and tiles < 2 * sms
                parts = torch.empty(groups, halves, m, n_out, dtype=torch.float32, device=device) if split else out
                counters = dense_ops._counters(device)

                def call(w, x=x, out=out, parts=parts, split=split, groups=groups, per_group=per_group,
                         block_n=block_n, block_k=block_k, warps=warps, stages=stages, tiles=tiles, m=m,
                         unroll=unroll):
                    return lambda: D._invariant_matmul_kernel[(tiles, groups if split else 1)](
                        x, w, out, out, parts, counters, m, k, n_out, x.stride(0), w.stride(0), out.stride(0),
                        *dense_ops.epilogue_args(None, out),
                        NUM_GROUPS=groups, GROUP_K=per_group * block_k, BLOCK_M=dense_ops.BLOCK_M,
                        BLOCK_N=block_n, BLOCK_K=block_k, REDUCE_M=dense_ops.reduce_rows(block_n),
                        REDUCE_UNROLL=unroll,
                        SPLIT=split, GATED=gated, HAS_BIAS=False,
                        DOT_FP32=dense_ops.INTERPRETED, ROW_EXACT_DOT=dense_ops.INTERPRETED,
                        MANUAL_BF16=dense_ops.INTERPRETED, num_warps=warps, num_stages=stages)

                try:
                    seconds = graph_seconds(lambda: [call(w) for w in weights], device)
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or fit
                    seconds = None
                    error = f"{type(exc).__name__}: {str(exc)[:80]}"
                else:
                    error = None
                results.append(dict(layer=name, rows=m, block_n=block_n, block_k=block_k, warps=warps,
                                    stages=stages, per_sm=per_sm, groups=groups, unroll=unroll, split=split,
                                    seconds=seconds,
                                    gbps=nbytes / seconds / 1e9 if seconds else None, error=error))
                shown = f"{seconds * 1e6:8.1f} us {nbytes / seconds / 1e9:6.0f} GB/s" if seconds else error
                print(f"{name:14s} rows {m:5d} BN {block_n:3d} BK {block_k:3d} w{warps} s{stages} "
                      f"{per_sm}/SM groups {groups:3d} x{unroll:<2d} {'split' if split else 'whole'}: {shown}",
                      flush=True)
        del weights, weight
    print("best per layer and rows:")
    for (name, m), group in itertools.groupby(sorted((r for r in results if r["seconds"]),
                                                     key=lambda r: (r["layer"], r["rows"], r["seconds"])),
                                              key=lambda r: (r["layer"], r["rows"])):
        best = next(group)
        print(f"  {name:14s} rows {m:5d}: BN {best['block_n']} BK {best['block_k']} w{best['warps']} "
              f"s{best['stages']} {best['per_sm']}/SM x{best['unroll']} -> {best['seconds'] * 1e6:.1f} us")
    print(f"sweep took {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
