"""Attention kernel micro-benchmark: the Triton tree kernel against its baselines.

For every batch size B, context length L and tree size T it times, at the same KV
length (every request sees L keys):

- ``tree``: pagedtree's unified Triton kernel, B requests of T tree nodes each
  (random parents), the prefix read through shuffled block tables;
- ``decode``: the same kernel with one query token per request (plain paged decode);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a dense
  boolean mask over contiguous (pre-gathered) keys and values;
- ``xformers``: ``xformers.ops.memory_efficient_attention`` with a dense attention
  bias, when xformers is installed and the device is CUDA.

It reports the median time and the achieved memory bandwidth (the bytes an ideal
kernel must move: keys and values once, queries and outputs once) as a fraction of
the device's peak (a table of known devices; ``--peak-gbps`` overrides). On a GPU
the L2 cache is flushed before every timed call and the calls are timed inside a
CUDA graph (the host's launch overhead out). Without a GPU the kernels run in
Triton's interpreter (``TRITON_INTERPRET=1`` is set here): use ``--quick`` there,
which only shows that everything runs.

    python benchmarks/kernels.py                      # GPU: B 1,8,32 x L 1024,4096 x T 16,32,64
    python benchmarks/kernels.py --quick              # CPU smoke run (interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedtree.diagnostics.attention_workloads import (  # noqa: E402
    Workload,
    make_workload,
    peak_gbps,
    time_fn,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated B")
    p.add_argument("--context-lens", default="1024,4096", help="comma-separated KV lengths L")
    p.add_argument("--tree-sizes", default="16,32,64", help="comma-separated nodes per tree T")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--baselines", default="sdpa,xformers", help="comma-separated subset of sdpa,xformers ('' = none)")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (GB/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 iterations (CPU smoke test)")
    p.add_argument("--output-json", default=None, help="write the rows here")
    p.add_argument("--compiled", default=None, metavar="JSON",
                   help="print the registers, warps, shared memory and spills of the kernels compiled for "
                        "sm_80/sm_90 (the JSON of `python -m pagedtree.kernels.cuda_compile`) and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.context_lens, args.tree_sizes = "2", "48", "4,8"
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.warmup, args.iters = 1, 2
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sdpa_fn(w: Workload, scale: float):
    import torch.nn.functional as F

    gqa = w.dense_q.shape[1] != w.dense_k.shape[1]
    return lambda: F.scaled_dot_product_attention(w.dense_q, w.dense_k, w.dense_v, attn_mask=w.mask, scale=scale, enable_gqa=gqa)


def xformers_fn(w: Workload, scale: float):
    """memory_efficient_attention in the grouped [B, M, G, H, K] layout with a dense bias."""
    import xformers.ops as xops

    b, h, t, d = w.dense_q.shape
    hkv, ctx = w.dense_k.shape[1], w.dense_k.shape[2]
    g = h // hkv
    q = w.dense_q.transpose(1, 2).reshape(b, t, hkv, g, d)
    k = w.dense_k.transpose(1, 2).unsqueeze(3).expand(b, ctx, hkv, g, d)
    v = w.dense_v.transpose(1, 2).unsqueeze(3).expand(b, ctx, hkv, g, d)
    pad = -(-ctx // 8) * 8  # xformers wants the bias rows 8-element aligned
    bias = torch.full((b, hkv, g, t, pad), float("-inf"), dtype=q.dtype, device=q.device)
    bias = bias[..., :ctx]
    bias.masked_fill_(w.mask.view(b, 1, 1, t, ctx), 0.0)
    return lambda: xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=scale)


def print_compiled(path: str) -> None:
    """The resource table of a ``pagedtree.kernels.cuda_compile`` JSON, one row per
    compiled specialisation."""
    data = json.loads(Path(path).read_text())
    print(f"# kernels compiled without a GPU: triton {data['triton']}, {len(data['builds'])} specialisations")
    print("| arch | kernel | case | warps | stages | registers | shared bytes | spill stores | stack bytes |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for b in sorted(data["builds"], key=lambda b: (b["arch"], b["kernel"], b["case"])):
        status = f" ({b['error']})" if b.get("error") else ""
        print(f"| sm_{b['arch']} | {b['kernel']}{status} | {b['case']} | {b['num_warps']} | {b['num_stages']} "
              f"| {b['registers']} | {b['shared_bytes']} | {b['spill_stores']} | {b['stack_bytes']} |")
    for arch, counts in data.get("variants_over_varying_steps", {}).items():
        print(f"# sm_{arch}: compiled variants over steps of varying sizes: {counts}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compiled:
        print_compiled(args.compiled)
        return 0
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if not use_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from pagedtree.kernels import triton_ops  # noqa: E402  (after TRITON_INTERPRET)

    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if use_cuda else "fp32")]
    name, peak = peak_gbps(device, args.peak_gbps)
    baselines = [b for b in args.baselines.split(",") if b]
    scale = args.head_dim**-0.5
    rng = random.Random(args.seed)
    print(f"# device: {name}; peak {peak or 'unknown'} GB/s; torch {torch.__version__}; dtype {dtype}; "
          f"H={args.heads} H_kv={args.kv_heads} D={args.head_dim} block={args.block_size}")
    rows: list[dict] = []
    notes: set[str] = set()

    def record(batch, ctx, nodes, impl, seconds, w, decode_s):
        gbps = w.ideal_bytes / seconds / 1e9
        rows.append(dict(batch=batch, context=ctx, nodes=nodes, impl=impl, time_us=seconds * 1e6, gbps=gbps,
                         frac_peak=gbps / peak if peak else None, vs_decode=seconds / decode_s))

    for ctx in _ints(args.context_lens):
        for batch in _ints(args.batch_sizes):
            dec = make_workload(args, batch, ctx, 1, dtype, device, rng)
            dec_out = torch.empty_like(dec.query)
            dec_s = time_fn(lambda: triton_ops.unified_attention(dec.query, dec.k_cache, dec.v_cache, dec.plan, scale, out=dec_out),
                            args.warmup, args.iters, device)
            record(batch, ctx, 1, "decode", dec_s, dec, dec_s)
            for nodes in [n for n in _ints(args.tree_sizes) if n < ctx]:
                w = make_workload(args, batch, ctx, nodes, dtype, device, rng)
                out = torch.empty_like(w.query)
                tree_call = lambda: triton_ops.unified_attention(w.query, w.k_cache, w.v_cache, w.plan, scale, out=out)  # noqa: E731
                record(batch, ctx, nodes, "tree", time_fn(tree_call, args.warmup, args.iters, device), w, dec_s)
                # Guard against timing a wrong kernel: the tree output equals SDPA's.
                expected = sdpa_fn(w, scale)().transpose(1, 2).reshape_as(out)
                err = (out.float() - expected.float()).abs().max().item()
                if err > (1e-3 if dtype == torch.float32 else 5e-2):
                    notes.add(f"tree kernel differs from SDPA by {err:.3g} at B={batch} L={ctx} T={nodes}")
                for impl in baselines:
                    try:
                        if impl == "xformers" and device.type != "cuda":
                            raise RuntimeError("xformers runs on CUDA only")
                        fn = sdpa_fn(w, scale) if impl == "sdpa" else xformers_fn(w, scale)
                        record(batch, ctx, nodes, impl, time_fn(fn, args.warmup, args.iters, device), w, dec_s)
                    except (ImportError, RuntimeError, NotImplementedError, ValueError) as exc:
                        notes.add(f"{impl} skipped: {str(exc).splitlines()[0][:120]}")
                del w

    print("\n| B | L | T | kernel | time (us) | GB/s | of peak | vs decode |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        frac = f"{100 * r['frac_peak']:.0f}%" if r["frac_peak"] is not None else "n/a"
        print(f"| {r['batch']} | {r['context']} | {r['nodes']} | {r['impl']} | {r['time_us']:.1f} | "
              f"{r['gbps']:.3g} | {frac} | {r['vs_decode']:.2f}x |")
    trees = [r for r in rows if r["impl"] == "tree" and 16 <= r["nodes"] <= 64]
    if trees:
        worst = max(trees, key=lambda r: r["vs_decode"])
        verdict = "met" if worst["vs_decode"] <= 1.1 else "missed"
        print(f"\ntarget tree (T=16..64) <= 1.1x decode: {verdict} (worst {worst['vs_decode']:.2f}x at "
              f"B={worst['batch']} L={worst['context']} T={worst['nodes']})")
    decodes = [r for r in rows if r["impl"] == "decode" and r["context"] == 4096 and r["frac_peak"] is not None]
    if decodes:
        best = max(decodes, key=lambda r: r["frac_peak"])
        verdict = "met" if best["frac_peak"] >= 0.7 else "missed"
        print(f"target decode >= 70% of peak at L=4096: {verdict} (best {100 * best['frac_peak']:.0f}% at B={best['batch']})")
    for note in sorted(notes):
        print(f"note: {note}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(dict(device=name, peak_gbps=peak, dtype=str(dtype),
                                                          args=vars(args), rows=rows, notes=sorted(notes)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
