"""A roofline estimate, on paper, of the attention kernel on a GPU this project has never had.

From what the compiler says about each kernel (registers, warps, shared memory: the
JSON of ``python -m pagedtree.kernels.cuda_compile``) and from the bytes each
launch must move, it estimates per layer, for decode and for tree verification at
batch sizes B and KV lengths L:

- bytes: keys and values as the kernel reads them (once per query tile of a
  request: a tree whose T x G query rows take several tiles re-reads its prefix
  once per tile), queries and outputs, split-KV partials (written and read back);
- programs and occupancy: programs per SM from registers, warps and shared memory,
  the SMs kept busy (a launch with fewer programs than SMs leaves bandwidth unused);
- time: bytes over the bandwidth of the busy SMs, plus a launch overhead per
  kernel; and two targets: a tree of T = 16..64 nodes within 1.1x
  of decode at the same L, and decode at >= 70% of HBM bandwidth.

It models the launch code (``attention_plan.choose_tile_shape``) as it is, so it
shows where the kernel stands and what a kernel that reads KV once per tree would
change. It is an estimate: latency hiding, L2 hits and instruction overheads are
not modelled; ``benchmarks/kernels.py`` measures on a real GPU.

    python -m pagedtree.kernels.cuda_compile --arch 90 --json kernels_sm.json
    python benchmarks/roofline.py --compiled kernels_sm.json --gpu H100
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedtree.kernels.attention_plan import choose_tile_shape, next_power_of_2  # noqa: E402


@dataclass(frozen=True)
class Gpu:
    """What the estimate needs to know about a GPU."""

    name: str
    arch: int
    sms: int
    hbm_gbps: float
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    max_warps_per_sm: int = 64
    max_programs_per_sm: int = 32
    launch_us: float = 3.0  # a kernel launch's fixed cost (in a CUDA graph: less)


GPUS = {
    "H100": Gpu("H100 SXM", 90, 132, 3350.0),
    "A100": Gpu("A100 SXM 80GB", 80, 108, 2039.0, smem_per_sm=164 * 1024),
}


@dataclass(frozen=True)
class Model:
    """Attention shape of one layer."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    block_size: int = 16


def kernel_resources(compiled: dict, arch: int, dtype: str, head_dim: int, group: int, block_q: int,
                     splits: bool) -> dict:
    """The compiled attention kernel's registers, warps and shared memory for a tile
    shape: the compiled case with the same head dim, group, query tile and split-KV
    (the most registers among those)."""
    def matches(b: dict, strict: bool) -> bool:
        c = b["constexprs"]
        return (b["kernel"] == "_unified_attention_kernel" and b["arch"] == arch and b["dtype"] == dtype
                and c.get("HEAD_DIM") == head_dim and c.get("GROUP") == group and c.get("BLOCK_Q") == block_q
                and (not strict or (c.get("NUM_SPLITS", 1) > 1) == splits))

    best = None
    for strict in (True, False):  # split-KV changes little in registers: fall back to the other
        for b in compiled["builds"]:
            if matches(b, strict):
                best = b if best is None or b["registers"] > best["registers"] else best
        if best is not None:
            break
    if best is None:
        raise SystemExit(f"no compiled attention kernel for sm_{arch} {dtype} D{head_dim} G{group} "
                         f"BLOCK_Q {block_q} split={splits} in the JSON; compile with those cases")
    return best


def programs_per_sm(gpu: Gpu, registers: int, warps: int, smem: int) -> int:
    """Resident programs per SM, limited by registers, warps and shared memory."""
    by_regs = gpu.regs_per_sm // max(1, registers * 32 * warps)
    by_warps = gpu.max_warps_per_sm // warps
    by_smem = gpu.smem_per_sm // smem if smem else gpu.max_programs_per_sm
    return max(0, min(by_regs, by_warps, by_smem, gpu.max_programs_per_sm))


def estimate(gpu: Gpu, model: Model, compiled: dict, batch: int, context: int, new: int) -> dict:
    """One launch (one layer) of ``batch`` requests with ``new`` query tokens each
    (1: decode; T: a tree) seeing ``context`` keys."""
    group = model.heads // model.kv_heads
    tile = choose_tile_shape(new, group, batch, model.kv_heads, context, interpreted=False, num_sms=gpu.sms,
                             block_size=model.block_size, capability=gpu.arch, head_dim=model.head_dim,
                             kv_elem_bytes=model.dtype_bytes)
    tiles_per_request = math.ceil(new / tile.block_q)
    programs = batch * tiles_per_request * model.kv_heads * tile.num_splits
    e = model.dtype_bytes
    kv_row = model.kv_heads * model.head_dim * e * 2  # K and V of one position, all KV heads
    ideal_kv = batch * context * kv_row
    kv = 0
    for t in range(tiles_per_request):  # each tile reads the prefix and the new tokens up to its last query
        kv_end = context - new + min((t + 1) * tile.block_q, new)
        kv += batch * kv_end * kv_row
    qo = 2 * batch * new * model.heads * model.head_dim * e
    partials = 0
    if tile.num_splits > 1:
        d_p = next_power_of_2(model.head_dim)
        partials = 2 * tile.num_splits * batch * new * model.heads * (d_p + 2) * 4
    dtype = {2: "bf16", 4: "fp32"}[e]
    res = kernel_resources(compiled, gpu.arch, dtype, model.head_dim, group, tile.block_q, tile.num_splits > 1)
    resident = programs_per_sm(gpu, res["registers"], res["num_warps"], res["shared_bytes"])
    busy_sms = min(gpu.sms, programs)
    total = kv + qo + partials
    seconds = total / (gpu.hbm_gbps * 1e9 * busy_sms / gpu.sms)
    seconds += gpu.launch_us * 1e-6 * (2 if tile.num_splits > 1 else 1)
    return {
        "batch": batch, "context": context, "new": new, "block_q": tile.block_q, "tiles": tiles_per_request,
        "rows": tile.block_m,
        "splits": tile.num_splits, "programs": programs, "resident_per_sm": resident,
        "registers": res["registers"], "warps": res["num_warps"], "kv_reads": kv / ideal_kv,
        "bytes": total, "us": seconds * 1e6, "hbm_fraction": ideal_kv / seconds / (gpu.hbm_gbps * 1e9),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compiled", required=True, help="JSON of pagedtree.kernels.cuda_compile")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context-lens", default="1024,4096")
    parser.add_argument("--tree-sizes", default="16,32,64")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    compiled = json.loads(Path(args.compiled).read_text())
    gpu = GPUS[args.gpu]
    model = Model(args.heads, args.kv_heads, args.head_dim)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print(f"{gpu.name} ({gpu.hbm_gbps:.0f} GB/s, {gpu.sms} SMs); {model.heads} heads, {model.kv_heads} KV heads, "
          f"D {model.head_dim}, bf16; one layer, one launch (+ reduce with split-KV)\n")
    print("| B | L | kind | query tiles/request | splits | programs | regs | warps | resident/SM "
          "| KV read (x ideal) | us | HBM fraction (ideal bytes) | vs decode |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for context in ints(args.context_lens):
        for batch in ints(args.batch_sizes):
            decode = estimate(gpu, model, compiled, batch, context, 1)
            rows = [("decode", decode)] + [(f"tree T={t}", estimate(gpu, model, compiled, batch, context, t))
                                           for t in ints(args.tree_sizes)]
            for kind, r in rows:
                print(f"| {batch} | {context} | {kind} | {r['tiles']} | {r['splits']} | {r['programs']} "
                      f"| {r['registers']} | {r['warps']} | {r['resident_per_sm']} | {r['kv_reads']:.2f} "
                      f"| {r['us']:.1f} | {r['hbm_fraction']:.0%} | {r['us'] / decode['us']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
