"""Measure a draft pair's acceptance rates by depth and rank: the adaptive budget's prior.

Runs the target with the draft on a prompt set with a fixed tree (every request
speculates every step), greedy and at a sampling temperature, and counts every
tested proposal's (depth, rank, accepted). Prints the rates as the Python literal
that ``pagedtree.speculative.budget.priors.PAIR_PRIORS`` stores, and a table.

    python benchmarks/acceptance_prior.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --datasets coding,prose
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from tqdm import tqdm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--datasets", default="coding,prose", help="prompt sets of pagedtree.loadgen.datasets")
    parser.add_argument("--temperature", type=float, default=0.8, help="the sampling class's temperature")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--expansion", default="2,2,1,1,1,1", help="static tree measured (ranks 0-1 near the root)")
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--max-rank", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the counts as JSON here")
    args = parser.parse_args()

    from pagedtree import LLM, SamplingParams
    from pagedtree.loadgen.datasets import PROMPT_SETS, chat_token_ids
    from pagedtree.speculative.budget.acceptance import request_class

    expansion = tuple(int(k) for k in args.expansion.split(","))
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=8, draft_model=args.draft_model,
              speculative=dict(tree="static", expansion=expansion, max_nodes=sum(_level_sizes(expansion)),
                               adaptive=False))
    counts: dict[str, dict[tuple[int, int], list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    budget = llm.engine.speculation.budget
    original = budget.observe_verification

    def record(request, trials):
        cls = request_class(request.params)
        for depth, rank, hit in trials:
            cell = counts[cls][(depth, rank)]
            cell[0] += 1
            cell[1] += int(hit)
        original(request, trials)

    budget.observe_verification = record
    tokenizer = llm.get_tokenizer()
    prompts = [chat_token_ids(tokenizer, chat) for name in args.datasets.split(",") for chat in PROMPT_SETS[name]]
    for temperature in tqdm((0.0, args.temperature), desc="classes"):
        params = SamplingParams(temperature=temperature, max_tokens=args.output_len, ignore_eos=True, seed=None)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    prior = {}
    for cls in ("greedy", "sampling"):
        rows = []
        for depth in range(1, args.max_depth + 1):
            row = []
            for rank in range(args.max_rank):
                tried, hit = counts[cls].get((depth, rank), (0, 0))
                if tried < 20:  # too few to say: the rank above's rate, halved
                    row.append(round(row[-1] / 2, 3) if row else (rows[-1][0] if rows else 0.5))
                else:
                    row.append(round(hit / tried, 3))
            rows.append(row)
        prior[cls] = rows
        print(f"{cls}: (depth: rank 0, 1, 2 acceptance | tried)")
        for depth, row in enumerate(rows, 1):
            tried = [counts[cls].get((depth, r), (0, 0))[0] for r in range(args.max_rank)]
            print(f"  depth {depth}: {row} | {tried}")
    print("PAIR_PRIORS entry:")
    print(repr(prior))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prior": prior, "counts": {c: {f"{d},{r}": v for (d, r), v in cells.items()}
                                                  for c, cells in counts.items()}}, f, indent=1)


def _level_sizes(expansion: tuple[int, ...]) -> list[int]:
    sizes, width = [], 1
    for k in expansion:
        width *= k
        sizes.append(width)
    return sizes


if __name__ == "__main__":
    main()
