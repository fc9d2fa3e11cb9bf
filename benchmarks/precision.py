"""Reduced precision and quantized weights against fp32 on a real packaged model.

Every variant (``--variants``, default fp32, bf16, int8, int4) runs in its own fresh
process on the same chat-templated coding prompts: peak RSS after loading, the bytes
of the linear layers' weights, greedy decoding of every prompt (``--output-len``
tokens, EOS ignored) timed at batch 1 (prompts one after another) and at batch
``--batch`` (all together), and optionally the chain-speculation speed-up at batch 1
(``--draft-model``). Against fp32 from the same run it reports greedy token agreement
(the fraction of positions before each prompt's first divergence, and how many
prompts agree entirely) and the mean |logprob difference| of the chosen tokens
where the sequences agree.

    python benchmarks/precision.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --output-json benchmarks/out/precision.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="packaged model, folder or .gguf")
    parser.add_argument("--draft-model", default=None, help="also time chain-5 speculation at batch 1 with it")
    parser.add_argument("--variants", default="fp32,bf16,int8,int4", help=f"comma list of {list(VARIANTS)}")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="batch size of the throughput timing")
    parser.add_argument("--output-json", default=None, help="write every figure here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one variant
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> dict:
    """One variant in this process: load, decode, time; returns its figures."""
    from pagedtree import LLM, SamplingParams
    from pagedtree.loadgen.datasets import CODING_PROMPTS
    from pagedtree.worker.models.linear import Linear

    kwargs = dict(VARIANTS[args.worker], max_model_len=1024, enable_prefix_caching=False, kv_cache_memory=256 * 2**20)
    if args.draft_model:
        kwargs.update(draft_model=args.draft_model, speculative=dict(tree="chain", depth=5, max_nodes=5, adaptive=False))
    started = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    load_seconds = time.perf_counter() - started
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    linear_bytes = sum(m.weight_bytes for m in llm.engine.runner.model.modules() if isinstance(m, Linear))
    tok = llm.get_tokenizer()
    prompts = [
        {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                                                add_generation_prompt=True, tokenize=False),
                                        add_special_tokens=False)}
        for p in (CODING_PROMPTS * 4)[: args.num_prompts]
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, logprobs=0)
    if args.draft_model:
        llm.engine.set_speculation(False)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:2]]
    batch1 = 2 * args.output_len / (time.perf_counter() - t)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batched = len(prompts) * args.output_len / (time.perf_counter() - t)
    result = {
        "variant": args.worker, "load_seconds": load_seconds, "peak_rss_bytes": peak_rss,
        "linear_weight_bytes": linear_bytes, "batch1_tokens_per_s": batch1, "batch_tokens_per_s": batched,
        "tokens": [o.outputs[0].token_ids for o in outs],
        "logprobs": [[lp[t] for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs],
    }
    if args.draft_model:
        llm.engine.set_speculation(True)
        t = time.perf_counter()
        for p in prompts[:2]:
            llm.generate([p], SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
        result["spec_batch1_tokens_per_s"] = 2 * args.output_len / (time.perf_counter() - t)
        result["mean_acceptance_length"] = llm.stats()["mean_acceptance_length"]
    return result


def agreement(reference: dict, other: dict) -> dict:
    """Greedy agreement with the reference and mean |logprob difference| where they agree."""
    agreed = total = whole = 0
    diffs: list[float] = []
    for ref_t, ref_lp, t, lp in zip(reference["tokens"], reference["logprobs"], other["tokens"], other["logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(ref_t, t)) if a != b), len(ref_t))
        agreed += n
        total += len(ref_t)
        whole += n == len(ref_t)
        diffs += [abs(a - b) for a, b in zip(ref_lp[:n], lp[:n])]
    return {"agreement": agreed / total, "prompts_identical": whole,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs) if diffs else float("nan")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    results = {}
    for variant in variants:
        cmd = [sys.executable, __file__, "--worker", variant, "--model", args.model, "--num-prompts",
               str(args.num_prompts), "--output-len", str(args.output_len), "--batch", str(args.batch)]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
        print(f"[precision] {variant} ...", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results.get("fp32")
    fp32_b1 = base["batch1_tokens_per_s"] if base else None
    lines = [f"Model {args.model}; {args.num_prompts} coding prompts x {args.output_len} greedy tokens; "
             f"{platform.machine()}, each variant in a fresh process.", "",
             "| variant | peak RSS after load | linear weights | batch 1 tok/s | vs fp32 | batch "
             f"{args.batch} tok/s | greedy agreement with fp32 | prompts identical | mean abs logprob diff |"
             + (" chain-5 batch 1 tok/s | speed-up | acceptance length |" if args.draft_model else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.draft_model else "")]
    for variant, r in results.items():
        agree = agreement(base, r) if base else {}
        row = (f"| {variant} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | {r['linear_weight_bytes'] / 2**30:.2f} GiB | "
               f"{r['batch1_tokens_per_s']:.2f} | "
               + (f"{r['batch1_tokens_per_s'] / fp32_b1:.2f}x" if fp32_b1 else "n/a")
               + f" | {r['batch_tokens_per_s']:.2f} | "
               + (f"{agree['agreement']:.3f} | {agree['prompts_identical']}/{args.num_prompts} | "
                  f"{agree['mean_abs_logprob_diff']:.4f} |" if agree else "| | |"))
        if args.draft_model:
            row += (f" {r['spec_batch1_tokens_per_s']:.2f} | {r['spec_batch1_tokens_per_s'] / r['batch1_tokens_per_s']:.2f}x"
                    f" | {r['mean_acceptance_length']:.2f} |")
        lines.append(row)
    print("\n".join(lines))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
