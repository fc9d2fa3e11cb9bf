"""Offline throughput of pagedtree against transformers' generate, in one run.

Every engine gets the same prompts and generates exactly ``--output-len`` tokens
(EOS ignored), greedy. The table reports tokens/s and requests/s per engine and
batch size, with ratios against transformers measured in the same run (these
machines are noisy, so only same-run ratios mean anything).

    python benchmarks/throughput.py --model qwen2.5-coder-0.5b-instruct --batch-sizes 1,16

``--backend vllm`` runs vLLM's offline ``LLM`` in-process instead of pagedtree, with the
same transformers baseline. Run it with the vLLM environment's Python (pagedtree is
imported from this source tree, never installed there):

    bash benchmarks/peers/setup_vllm.sh
    VLLM_CPU_NUM_OF_RESERVED_CPU=0 LD_PRELOAD=.venv-vllm/lib/libiomp5.so \\
        .venv-vllm/bin/python benchmarks/throughput.py --backend vllm --batch-sizes 1,16

(vLLM keeps one core for its scheduler unless ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``.)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

# The vLLM environment runs this script without pagedtree installed: use the source tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass
class Result:
    """One engine at one batch size."""

    engine: str
    batch_size: int
    num_requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def make_prompts(args, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token-id prompts: from a file (one prompt per line, or JSONL with "prompt") or random."""
    rng = random.Random(args.seed)
    if args.dataset != "random":
        lines = [ln for ln in Path(args.dataset).read_text().splitlines() if ln.strip()]
        texts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
        if tokenizer is None:
            raise SystemExit("a text dataset needs a model with a tokenizer")
        prompts = [tokenizer.encode(t) for t in texts]
        return [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    # Random ids from the lower vocabulary (real tokens, not reserved specials).
    hi = min(vocab_size, 30000)
    return [[rng.randrange(100, hi) for _ in range(args.input_len)] for _ in range(args.num_prompts)]


def run_pagedtree(args, prompts: list[list[int]], batch_size: int, llm) -> Result:
    from pagedtree import SamplingParams

    llm.engine.scheduler.config.max_num_seqs = batch_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=True)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("pagedtree", batch_size, len(prompts), tokens, seconds)


def run_transformers(args, prompts: list[list[int]], batch_size: int, model) -> Result:
    """transformers generate, ``batch_size`` prompts at a time (left padding)."""
    tokens = 0
    started = time.perf_counter()
    with torch.no_grad():
        for start in tqdm(range(0, len(prompts), batch_size), desc=f"transformers b{batch_size}"):
            batch = prompts[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
            tokens += (out.shape[1] - width) * len(batch)
    return Result("transformers", batch_size, len(prompts), tokens, time.perf_counter() - started)


def run_vllm(args, prompts: list[list[int]], batch_size: int, folder: str) -> Result:
    try:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VParams
    except ImportError as exc:
        raise SystemExit(f"--backend vllm needs vllm in this environment ({exc}); see benchmarks/peers/") from exc
    # "auto" means fp32 here, as for pagedtree on CPU: the same dtype on both sides.
    llm = VLLM(model=folder, dtype="float32" if args.dtype == "auto" else args.dtype, max_num_seqs=batch_size,
               max_model_len=args.input_len + args.output_len + 16, seed=args.seed)
    params = VParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    started = time.perf_counter()
    outs = llm.generate(inputs, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("vllm", batch_size, len(prompts), tokens, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="packaged name, folder or .gguf")
    parser.add_argument("--backend", choices=["pagedtree", "vllm"], default="pagedtree")
    parser.add_argument("--dataset", default="random", help="'random' or a text/JSONL file of prompts")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated")
    parser.add_argument("--baseline-prompts", type=int, default=4,
                        help="prompts the batch-1 runs use (batch 1 is slow; the rate is what counts)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="write the results here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from pagedtree.loading.loader import load_tokenizer, resolve_model_path

    folder = resolve_model_path(args.model)
    tokenizer = load_tokenizer(folder)
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    prompts = make_prompts(args, tokenizer, config.vocab_size)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: list[Result] = []

    llm = None
    if args.backend == "pagedtree":
        from pagedtree import LLM

        llm = LLM(str(folder), dtype=args.dtype, max_num_seqs=max(batch_sizes),
                  max_model_len=args.input_len + args.output_len + 16)
    hf = None
    if not args.no_transformers:
        dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    for b in batch_sizes:
        subset = prompts[: args.baseline_prompts] if b == 1 else prompts
        if args.backend == "pagedtree":
            results.append(run_pagedtree(args, subset, b, llm))
        else:
            results.append(run_vllm(args, subset, b, str(folder)))
        if hf is not None:
            results.append(run_transformers(args, subset, b, hf))

    hf_by_b = {r.batch_size: r for r in results if r.engine == "transformers"}
    hf_b1 = hf_by_b.get(1)
    print(f"\nmodel {args.model}, input {args.input_len}, output {args.output_len}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| engine | batch | requests | tokens/s | requests/s | vs transformers same batch | vs transformers batch 1 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        same = hf_by_b.get(r.batch_size)
        vs_same = f"{r.tokens_per_s / same.tokens_per_s:.2f}x" if same else "-"
        vs_b1 = f"{r.tokens_per_s / hf_b1.tokens_per_s:.2f}x" if hf_b1 else "-"
        print(f"| {r.engine} | {r.batch_size} | {r.num_requests} | {r.tokens_per_s:.2f} | "
              f"{r.requests_per_s:.3f} | {vs_same} | {vs_b1} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(
            {"args": vars(args), "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]},
            indent=2))


if __name__ == "__main__":
    main()
