"""Offline throughput of pagedtree against transformers' generate, in one run.

Every engine gets the same prompts and generates exactly ``--output-len`` tokens
(EOS ignored), greedy. At batch size B the prompts go through in groups of B, each
group submitted together and timed once it finishes, the next after it. The table
reports tokens/s and requests/s per engine and batch size, with ratios against
transformers measured in the same run (these machines are noisy, so only same-run
ratios mean anything). The engines are loaded once each, warmed up with one short
request, and run through the adapters of ``benchmarks/engines.py`` (prefix caching
off, as in ``compare.py``).

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

# The vLLM environment runs this script without pagedtree installed: use the source tree.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engines import EngineOptions, RunBatch, load_pagedtree, load_transformers, load_vllm, time_batches  # noqa: E402


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


def run_engine(engine: str, run: RunBatch, prompts: list[list[int]], batch_size: int, output_len: int) -> Result:
    """Greedy, ``batch_size`` prompts at a time, one group after another."""
    groups = [prompts[start : start + batch_size] for start in range(0, len(prompts), batch_size)]
    tokens, seconds, _ = time_batches(run, tqdm(groups, desc=f"{engine} b{batch_size}"), 0.0, output_len)
    return Result(engine, batch_size, len(prompts), tokens, seconds)


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

    from pagedtree.loading.loader import load_tokenizer, resolve_model_path

    folder = resolve_model_path(args.model)
    tokenizer = load_tokenizer(folder)
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(folder))
    prompts = make_prompts(args, tokenizer, config.vocab_size)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: list[Result] = []

    # max_num_seqs is the largest batch: groups of B never run more than B sequences.
    max_len = max(len(p) for p in prompts) + args.output_len + 16
    options = EngineOptions(str(folder), label=args.backend, dtype=args.dtype, seed=args.seed)
    engines: list[tuple[str, RunBatch]] = []
    if args.backend == "pagedtree":
        engines.append(("pagedtree", load_pagedtree(options, max(batch_sizes), max_len)[1]))
    else:
        try:
            engines.append(("vllm", load_vllm(options, max(batch_sizes), max_len)[1]))
        except ImportError as exc:
            raise SystemExit(f"--backend vllm needs vllm in this environment ({exc}); see benchmarks/peers/") from exc
    if not args.no_transformers:
        hf_options = replace(options, label="transformers")
        engines.append(("transformers", load_transformers(hf_options, max(batch_sizes), max_len)[1]))
    for _, run in engines:
        run(prompts[:1], 0.0, min(2, args.output_len))  # warm-up
    for b in batch_sizes:
        subset = prompts[: args.baseline_prompts] if b == 1 else prompts
        for engine, run in engines:
            results.append(run_engine(engine, run, subset, b, args.output_len))

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
