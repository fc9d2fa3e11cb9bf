"""A roofline estimate, on paper, of the attention kernel on a GPU this project has never had.

It models one attention launch (one layer) as the engine sends it: a decode is one
query per request; a token tree of T nodes is T + 1 queries (the root, the last
committed token, and the nodes: ``ScheduledChunk.with_tree``), which see the
request's L committed keys plus the T node keys. The tile shape and split-KV come
from the launch code itself (``tiles.choose_tile_shape`` with the real
query count), and registers, warps and shared memory per program from the compiled
kernels (the JSON of ``python -m pagedtree.kernels.cuda_compile``). Per launch:

- bytes: keys and values as the kernel reads them (a program reads its request's
  keys up to its last query, so a request whose queries take several programs
  reads its prefix once per program; L2 hits are not counted), queries and
  outputs, split-KV partials written and read back;
- tensor-core FLOPs: QK^T and PV, ``2 * rows * keys * head_dim`` each per program,
  with ``rows`` the program's padded query rows (the main tile and, with the root
  aside, its side tile: what the tile computes, padding included) and ``keys``
  rounded up to whole 16-key tiles;
- exp2: ``rows * keys`` softmax weights plus one rescale per row and key tile;
- programs, occupancy and waves: programs resident per SM from registers, warps
  and shared memory; ``waves = ceil(programs / (SMs * resident))``; a launch keeps
  its share of the SMs busy, ``programs / max(programs, (waves - 1) * SMs *
  resident + SMs)``: 1 when every wave is full or its last wave still covers every
  SM, ``programs / SMs`` for a single wave on fewer SMs (as the launch code's
  split-KV cost assumes);
- time: ``max(bytes / HBM, FLOPs / tensor, exp2 / MUFU) / busy share`` plus a
  launch overhead per kernel (two with split-KV). The roof named in the tables is
  the largest of the memory, compute (tensor cores), exp and launch terms.

Rates (H100 SXM, A100 SXM 80GB): HBM 3.35 / 2.04 TB/s; dense bf16 tensor cores
989 / 312 TFLOPS on the datasheet, and an assumed 40% of it for a Triton kernel
with 16-key tiles, 400 / 125 TFLOPS, as the roof (``--mma-tflops``; the tables
give the datasheet's ratio too); exp2 on the MUFU at 16 per clock per SM (the
CUDA guide's throughput table for compute capability 8.0 and 9.0): 132 SMs x
1.83 GHz = 3.865 T/s on an H100, the 3.9 TFLOPS of special functions the
FlashAttention-3 paper quotes (16 per SM sub-partition would be 4x that), and
108 x 1.41 GHz = 2.44 T/s on an A100; 3 us a launch (less in a CUDA graph). The
FP32 work around each exp2 (scale, max, sum, conversion: about 5 operations at
128 per clock per SM) fits under the exp roof and is not counted; neither are L2
hits, latency, instruction overheads, register spills, nor the overlap a program
misses between its MMAs and its softmax (with one resident program per SM,
compute and exp can add up rather than overlap: the detail table gives both
terms). CUDA-graph steps pad query counts to their buckets and choose tiles for
the longest context allowed; the estimate models the eager launch at the real
lengths. ``benchmarks/kernels.py`` measures on a real GPU.

Hand check, H100, Llama-3-8B shape (32 query heads, 8 KV heads, D 128), a 64-node
tree (65 queries) at B = 32 and L = 8192 (``tests/kernels/test_roofline.py``
recomputes it), with the tile the launch code picks today (one program per
request and KV head: 64 nodes in 256 rows, the root aside in 16 rows, 272 rows):

- keys: 8192 + 64 = 8256, 516 tiles of 16;
- FLOPs: 4 * 272 rows * 8256 keys * 128 * 8 KV heads * 32 requests = 294.3 G
  (281.4 G for the 65 x 4 = 260 real rows);
- exp2: 272 * 8256 * 256 = 574.9 M, + 272 * 516 * 256 = 35.9 M rescales = 610.8 M;
- bytes: 32 * 8256 * 8 * 128 * 2 * 2 = 1082.1 MB of K and V, + 34.1 MB of queries
  and outputs = 1116.2 MB;
- 256 programs, 1 resident per SM (16 warps, 128 KB of shared memory): 2 waves,
  busy share 256 / 264 = 0.97;
- compute 294.3 G / 989 T = 297 us (307 us at the share), / 400 T = 736 us (759 us);
  exp 610.8 M / 3.865 T = 158 us (163 us); memory 1116.2 MB / 3.35 TB/s = 333 us (344 us).
  At 400 TF the compute roof binds: 762 us against a decode's 324 us (1074 MB,
  memory-bound), 2.35x; at the datasheet's 989 TF memory binds: 347 us, 1.07x.

An estimate of 137 GFLOP and 268 M exp2 for this cell (139 us at 989 TF, 344 us
at 400 TF) is these formulas with 1024 query rows per request (128 per KV head,
e.g. 32 queries x 32 heads): the engine sends 65 queries x 32 heads = 2080 rows
per request, which the tiles compute as 8 x 272 = 2176, so FLOPs are 2.14x that
(exp2 2.14x, 2.28x with the rescales), and so are the compute and exp times.

    python benchmarks/roofline.py                       # H100, both shapes, the committed compiled JSON
    python benchmarks/roofline.py --gpu H100,A100 --detail --json roofline.json
    python -m pagedtree.kernels.cuda_compile --arch 80,90 --json kernels_sm.json   # fresh resources
    python benchmarks/roofline.py --compiled kernels_sm.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedtree.kernels.tiles import choose_tile_shape, next_power_of_2  # noqa: E402

DEFAULT_COMPILED = Path(__file__).resolve().parent / "results" / "kernels_sm80_sm90.json"


@dataclass(frozen=True)
class Gpu:
    """What the estimate needs to know about a GPU."""

    name: str
    arch: int
    sms: int
    hbm_gbps: float
    clock_ghz: float  # the clock the datasheet's tensor figure assumes
    peak_tflops: float  # dense bf16 tensor cores, datasheet
    mma_tflops: float  # dense bf16 tensor cores a Triton attention tile reaches (the default roof)
    mufu_per_clk_sm: int = 16  # exp2 (MUFU.EX2) results per clock per SM
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_program: int = 1024  # shared memory the driver keeps per resident block
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32
    launch_us: float = 3.0  # a kernel launch's fixed cost (in a CUDA graph: less)

    @property
    def exp2_per_s(self) -> float:
        return self.sms * self.mufu_per_clk_sm * self.clock_ghz * 1e9


GPUS = {
    "H100": Gpu("H100 SXM", 90, 132, 3350.0, 1.83, 989.4, 400.0),
    "A100": Gpu("A100 SXM 80GB", 80, 108, 2039.0, 1.41, 312.0, 125.0, smem_per_sm=164 * 1024),
}


@dataclass(frozen=True)
class Model:
    """Attention shape of one layer."""

    name: str = "custom"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    block_size: int = 16

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


MODELS = {
    "llama3-8b": Model("Llama-3-8B", 32, 8, 128),
    "qwen2.5-7b": Model("Qwen2.5-7B", 28, 4, 128),
}

ROOFS = ("memory", "compute", "exp", "launch")


def _build_rows(c: dict) -> tuple[int, int]:
    """(main rows, root side rows) of a compiled attention kernel's constexprs."""
    rows = c.get("BLOCK_M") or c["BLOCK_Q"] * c.get("GROUP_P", next_power_of_2(c["GROUP"]))
    return rows, (c.get("ROOT_M", 0) if c.get("ROOT_SIDE") else 0)


def kernel_resources(compiled: dict, arch: int, dtype: str, head_dim: int, tile) -> tuple[dict | None, str]:
    """The compiled attention kernel closest to ``tile`` and how it matched, the
    first of: ``exact`` (the same tokens, rows per token, root side and split-KV or
    not); ``exact/split`` (split-KV differing: it changes registers little);
    ``rows`` (a tile of the same rows, root rows and warps: registers and shared
    memory follow the rows, not how they split into tokens and heads);
    ``rows/split``; ``rows/root`` (the same main rows and warps, root side
    differing); ``assumed`` (no build: one program per SM). Among several, the one
    with the most registers."""
    root_m = getattr(tile, "root_m", 0) if getattr(tile, "root_side", False) else 0
    splits = tile.num_splits > 1
    cands = []
    for b in compiled.get("builds", []):
        c = b.get("constexprs") or {}
        if (b.get("kernel") != "_unified_attention_kernel" or b.get("error") or b.get("arch") != arch
                or b.get("dtype") != dtype or c.get("HEAD_DIM") != head_dim
                or c.get("TILE_N", tile.tile_n) != tile.tile_n):
            continue
        rows, b_root = _build_rows(c)
        cands.append((b, c, rows, b_root))
    def same_tile(c, rows, r):
        return (c.get("BLOCK_Q") == tile.block_q and c.get("GROUP_P") == tile.group_p and rows == tile.block_m
                and r == root_m)

    def same_rows(b, rows):
        return rows == tile.block_m and b["num_warps"] == (tile.num_warps or b["num_warps"])

    def same_split(c):
        return (c.get("NUM_SPLITS", 1) > 1) == splits

    tests = (
        ("exact", lambda b, c, rows, r: same_tile(c, rows, r) and same_split(c)),
        ("exact/split", lambda b, c, rows, r: same_tile(c, rows, r)),
        ("rows", lambda b, c, rows, r: same_rows(b, rows) and r == root_m and same_split(c)),
        ("rows/split", lambda b, c, rows, r: same_rows(b, rows) and r == root_m),
        ("rows/root", lambda b, c, rows, r: same_rows(b, rows)),
    )
    for name, test in tests:
        found = [b for b, c, rows, r in cands if test(b, c, rows, r)]
        if found:
            return max(found, key=lambda b: (b["registers"], b["shared_bytes"])), name
    return None, "assumed"


def programs_per_sm(gpu: Gpu, registers: int, warps: int, smem: int) -> int:
    """Resident programs per SM, limited by registers (allocated 8 per thread at a
    time), warps and shared memory (plus what the driver reserves per program)."""
    regs = -(-max(1, registers) // 8) * 8
    by_regs = gpu.regs_per_sm // (regs * 32 * warps)
    by_warps = gpu.max_warps_per_sm // warps
    by_smem = gpu.smem_per_sm // (smem + gpu.smem_reserved_per_program) if smem else gpu.max_programs_per_sm
    return max(0, min(by_regs, by_warps, by_smem, gpu.max_programs_per_sm))


def estimate(gpu: Gpu, model: Model, compiled: dict, batch: int, context: int, nodes: int,
             mma_tflops: float | None = None, launch_us: float | None = None) -> dict:
    """One launch (one layer) over ``batch`` requests of ``context`` committed tokens
    each: a decode (``nodes = 0``: one query) or a tree of ``nodes`` nodes (``nodes +
    1`` queries: its root and the nodes, seeing ``context + nodes`` keys)."""
    mma_tflops = gpu.mma_tflops if mma_tflops is None else mma_tflops
    launch_us = gpu.launch_us if launch_us is None else launch_us
    queries = nodes + 1
    keys = context + nodes  # the request's context length once the step has written its queries
    group = model.group
    d_p = next_power_of_2(model.head_dim)
    tile = choose_tile_shape(queries, group, batch, model.kv_heads, keys, interpreted=False, num_sms=gpu.sms,
                             block_size=model.block_size, capability=gpu.arch, head_dim=model.head_dim,
                             kv_elem_bytes=model.dtype_bytes)
    root_side = bool(getattr(tile, "root_side", False))
    root_m = tile.root_m if root_side else 0
    first = tile.first_query() if hasattr(tile, "first_query") else 0
    starts = list(range(first, queries, tile.block_q)) or [first]
    rows = tile.block_m + root_m  # computed per program, padding included
    prefix = keys - queries
    e = model.dtype_bytes
    kv_row = model.kv_heads * model.head_dim * e * 2  # K and V of one position, all KV heads
    kv = flops = exp2 = 0
    for start in starts:  # each program reads the prefix and the new tokens up to its last query
        kv_end = prefix + min(start + tile.block_q, queries)
        key_tiles = math.ceil(kv_end / tile.tile_n)  # over all its splits
        kv += batch * kv_end * kv_row
        flops += batch * model.kv_heads * 4 * rows * key_tiles * tile.tile_n * d_p
        exp2 += batch * model.kv_heads * rows * key_tiles * (tile.tile_n + 1)  # weights + a rescale per tile
    real_flops = 4 * batch * queries * model.heads * keys * model.head_dim
    ideal_kv = batch * keys * kv_row
    qo = 2 * batch * queries * model.heads * model.head_dim * e
    partials = 0
    if tile.num_splits > 1:
        partials = 2 * tile.num_splits * batch * queries * model.heads * (d_p + 2) * 4
    total = kv + qo + partials
    programs = batch * len(starts) * model.kv_heads * tile.num_splits
    dtype = {2: "bf16", 4: "fp32"}[e]
    res, match = kernel_resources(compiled, gpu.arch, dtype, model.head_dim, tile)
    if res is None:
        registers, warps, smem, resident = None, tile.num_warps or 4, None, 1
    else:
        registers, warps, smem = res["registers"], res["num_warps"], res["shared_bytes"]
        resident = programs_per_sm(gpu, registers, warps, smem)
        if resident == 0:
            raise SystemExit(f"{match} compiled kernel for {tile} does not fit an SM of {gpu.name}")
    lanes = gpu.sms * resident
    waves = math.ceil(programs / lanes)
    busy = programs / max(programs, (waves - 1) * lanes + gpu.sms)
    memory_us = total / (gpu.hbm_gbps * 1e9 * busy) * 1e6
    compute_us = flops / (mma_tflops * 1e12 * busy) * 1e6
    compute_peak_us = flops / (gpu.peak_tflops * 1e12 * busy) * 1e6
    exp_us = exp2 / (gpu.exp2_per_s * busy) * 1e6
    launches_us = launch_us * (2 if tile.num_splits > 1 else 1)
    terms = {"memory": memory_us, "compute": compute_us, "exp": exp_us, "launch": launches_us}
    us = max(memory_us, compute_us, exp_us) + launches_us
    us_peak = max(memory_us, compute_peak_us, exp_us) + launches_us
    return {
        "gpu": gpu.name, "model": model.name, "batch": batch, "context": context, "nodes": nodes,
        "queries": queries, "keys": keys,
        "block_q": tile.block_q, "rows": tile.block_m, "root_rows": root_m, "tiles": len(starts),
        "splits": tile.num_splits, "programs": programs,
        "registers": registers, "warps": warps, "shared_bytes": smem, "resources": match,
        "resident_per_sm": resident, "waves": waves, "busy_share": busy,
        "bytes": total, "kv_reads": kv / ideal_kv, "flops": flops, "flops_real_rows": real_flops,
        "row_padding": flops / real_flops, "exp2": exp2,
        "memory_us": memory_us, "compute_us": compute_us, "compute_peak_us": compute_peak_us,
        "exp_us": exp_us, "launch_us": launches_us,
        "us": us, "us_peak": us_peak, "bound": max(ROOFS, key=terms.__getitem__),
        "bound_peak": max(ROOFS, key=(terms | {"compute": compute_peak_us}).__getitem__),
        "hbm_fraction": ideal_kv / (us * 1e-6) / (gpu.hbm_gbps * 1e9),
        "mma_tflops": mma_tflops, "peak_tflops": gpu.peak_tflops,
    }


def ratio_table(gpu: Gpu, model: Model, compiled: dict, batches: list[int], contexts: list[int],
                trees: list[int], mma_tflops: float | None = None, launch_us: float | None = None) -> list[dict]:
    """Per (context, batch): the decode and, per tree size, the tree's estimate with
    ``ratio`` (tree time / decode time at the tensor roof used) and ``ratio_peak``
    (at the datasheet's)."""
    cells = []
    for context in contexts:
        for batch in batches:
            decode = estimate(gpu, model, compiled, batch, context, 0, mma_tflops, launch_us)
            trees_out = []
            for t in trees:
                r = estimate(gpu, model, compiled, batch, context, t, mma_tflops, launch_us)
                r["ratio"] = r["us"] / decode["us"]
                r["ratio_peak"] = r["us_peak"] / decode["us_peak"]
                trees_out.append(r)
            cells.append({"context": context, "batch": batch, "decode": decode, "trees": trees_out})
    return cells


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def print_tables(gpu: Gpu, model: Model, cells: list[dict], trees: list[int], detail: bool,
                 launch_us: float | None = None, out=None) -> None:
    """The ratio table of one GPU and shape (and with ``detail`` every estimate's terms)."""
    out = sys.stdout if out is None else out
    d0 = cells[0]["decode"]
    launch_us = gpu.launch_us if launch_us is None else launch_us
    print(f"### {gpu.name}, {model.name} shape ({model.heads} query heads, {model.kv_heads} KV heads, G {model.group}, "
          f"D {model.head_dim}, bf16): one layer\n", file=out)
    print(f"HBM {gpu.hbm_gbps:.0f} GB/s; tensor cores {d0['mma_tflops']:.0f} TFLOPS (datasheet {gpu.peak_tflops:.0f}); "
          f"exp2 {gpu.exp2_per_s / 1e12:.3f} T/s; {gpu.sms} SMs; {launch_us:g} us a launch. "
          f"A tree of T nodes is T + 1 queries. Cells: tree time / decode time at the same B and L, "
          f"the roof that binds, and the ratio at the datasheet's tensor peak.\n", file=out)
    head = "| L | B | decode us (roof, HBM) | " + " | ".join(f"T={t} ({t + 1} q)" for t in trees) + " |"
    print(head, file=out)
    print("|---:|---:|---|" + "---|" * len(trees), file=out)
    for cell in cells:
        d = cell["decode"]
        row = f"| {_k(cell['context'])} | {cell['batch']} | {d['us']:.1f} ({d['bound']}, {d['hbm_fraction']:.0%}) | "
        row += " | ".join(f"{r['ratio']:.2f}x {r['bound']} ({r['ratio_peak']:.2f}x {r['bound_peak']})"
                          for r in cell["trees"])
        print(row + " |", file=out)
    print(file=out)
    if not detail:
        return
    print("| L | B | T | queries | programs/request x rows | splits | programs | regs/warps/smem KB (match) "
          "| resident | waves | busy | MB | KV x ideal | GFLOP | pad | M exp2 | mem us | mma us | mma us peak "
          "| exp us | launch us | us | roof |", file=out)
    print("|" + "---:|" * 3 + "---:|---|---:|---:|---|" + "---:|" * 13 + "---|", file=out)
    for cell in cells:
        for r in [cell["decode"]] + cell["trees"]:
            rows = f"{r['rows']}+{r['root_rows']}" if r["root_rows"] else str(r["rows"])
            res = ("-" if r["registers"] is None else
                   f"{r['registers']}/{r['warps']}/{r['shared_bytes'] / 1024:.0f}") + f" ({r['resources']})"
            print(f"| {_k(r['context'])} | {r['batch']} | {r['nodes'] or 'decode'} | {r['queries']} "
                  f"| {r['tiles']} x {rows} "
                  f"| {r['splits']} | {r['programs']} | {res} | {r['resident_per_sm']} | {r['waves']} "
                  f"| {r['busy_share']:.2f} | {r['bytes'] / 1e6:.1f} | {r['kv_reads']:.2f} | {r['flops'] / 1e9:.2f} "
                  f"| {r['row_padding']:.2f} | {r['exp2'] / 1e6:.1f} | {r['memory_us']:.1f} | {r['compute_us']:.1f} "
                  f"| {r['compute_peak_us']:.1f} | {r['exp_us']:.1f} | {r['launch_us']:.0f} | {r['us']:.1f} "
                  f"| {r['bound']} |", file=out)
    print(file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiled", default=str(DEFAULT_COMPILED),
                        help="JSON of pagedtree.kernels.cuda_compile "
                             "(default: benchmarks/results/kernels_sm80_sm90.json)")
    parser.add_argument("--gpu", default="H100", help=f"comma-separated, of {', '.join(GPUS)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--heads", type=int, help="a custom shape instead of --models: query heads")
    parser.add_argument("--kv-heads", type=int, help="a custom shape: KV heads")
    parser.add_argument("--head-dim", type=int, default=128, help="a custom shape: head dim")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--context-lens", default="1024,4096,32768", help="committed tokens per request (L)")
    parser.add_argument("--tree-sizes", default="16,32,64", help="tree nodes T (T + 1 queries)")
    parser.add_argument("--mma-tflops", type=float, default=None,
                        help="tensor-core throughput the roof uses (default per GPU: 400 on H100, 125 on A100; "
                             "the datasheet's peak is always reported beside it)")
    parser.add_argument("--launch-us", type=float, default=None, help="fixed cost per kernel launch (default 3)")
    parser.add_argument("--detail", action="store_true", help="also print every estimate's terms")
    parser.add_argument("--json", default=None, help="write every estimate here ('-': stdout, instead of the tables)")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    compiled = json.loads(Path(args.compiled).read_text())
    gpus = []
    for name in args.gpu.split(","):
        if name not in GPUS:
            parser.error(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
        gpus.append(GPUS[name])
    if args.heads or args.kv_heads:
        if not (args.heads and args.kv_heads) or args.heads % args.kv_heads:
            parser.error("--heads and --kv-heads go together, heads a multiple of KV heads")
        models = [Model("custom", args.heads, args.kv_heads, args.head_dim)]
    else:
        models = []
        for name in args.models.split(","):
            if name not in MODELS:
                parser.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
            models.append(MODELS[name])
    trees = ints(args.tree_sizes)
    report = {"compiled": args.compiled, "gpus": [asdict(g) | {"exp2_per_s": g.exp2_per_s} for g in gpus],
              "models": [asdict(m) for m in models], "tables": []}
    for gpu in gpus:
        for model in models:
            cells = ratio_table(gpu, model, compiled, ints(args.batch_sizes), ints(args.context_lens), trees,
                                args.mma_tflops, args.launch_us)
            report["tables"].append({"gpu": gpu.name, "model": model.name, "cells": cells})
            if args.json != "-":
                print_tables(gpu, model, cells, trees, args.detail, args.launch_us)
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
