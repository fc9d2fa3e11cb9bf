"""Same-run A/B of two commits: is a change within noise of the code before it?

Checks both commits out as git worktrees and alternates them, one process per arm and
round (so each arm loads its own code), for each case:

- ``qwen-chain5-b1``: Qwen2.5-Coder 1.5B with the 0.5B draft, bf16, a fixed chain of
  5 (no adaptive budget), batch 1, greedy, the coding and prose prompts one by one;
- ``smollm2-b8``: SmolLM2-135M plain decoding, fp32, batch 8, greedy.

Only the public ``LLM`` API is used, so any two commits compare. Reports the median
tokens/s over the rounds per arm and the ratio after/before, with the spread.

    python benchmarks/commit_ab.py --before HEAD~3 --after HEAD --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = {
    "qwen-chain5-b1": dict(model="qwen2.5-coder-1.5b-instruct", dtype="bfloat16",
                           draft_model="qwen2.5-coder-0.5b-instruct",
                           speculative={"tree": "chain", "depth": 5, "max_nodes": 5, "adaptive": False},
                           batch=1, datasets=["coding", "prose"], num_prompts=2),
    "smollm2-b8": dict(model="smollm2-135m-instruct", dtype="float32", batch=8, datasets=["coding", "prose"],
                       num_prompts=4),
}

# Run inside a worktree: prints {"tokens": n, "seconds": s} of one timed pass.
_ARM = r"""
import json, sys, time
case = json.loads(sys.argv[1]); output_len = int(sys.argv[2])
import pagedtree
from pagedtree import LLM, SamplingParams
try:  # commits from before the load-generation package was named loadgen
    from pagedtree.bench.datasets import PROMPT_SETS, chat_token_ids
except ImportError:
    from pagedtree.loadgen.datasets import PROMPT_SETS, chat_token_ids
kwargs = {k: case[k] for k in ("dtype", "draft_model", "speculative") if k in case}
llm = LLM(case["model"], max_model_len=2048, **kwargs)
tok = llm.engine.tokenizer
prompts = [{"prompt_token_ids": chat_token_ids(tok, chat)}
           for name in case["datasets"] for chat in PROMPT_SETS[name][: case["num_prompts"]]]
params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
batch = case["batch"]
tokens, started = 0, time.perf_counter()
for i in range(0, len(prompts), batch):
    for out in llm.generate(prompts[i:i + batch], params, use_tqdm=False):
        tokens += len(out.outputs[0].token_ids)
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started}))
"""


def _worktree(rev: str, root: Path) -> Path:
    path = root / rev.replace("/", "_").replace("~", "-")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def _arm(tree: Path, case: dict, output_len: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", _ARM, json.dumps(case), str(output_len)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the arm in {tree} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens"] / result["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=48)
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")

    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory(prefix="commit_ab_") as tmp:
        trees = {"before": _worktree(args.before, Path(tmp)), "after": _worktree(args.after, Path(tmp))}
        try:
            rates: dict[tuple[str, str], list[float]] = {(c, a): [] for c in cases for a in trees}
            runs = [(c, r) for r in range(args.rounds) for c in cases]
            for case, round_index in tqdm(runs, desc="arms"):
                # Alternate which arm goes first, so a drift hits both alike.
                order = ["before", "after"] if round_index % 2 == 0 else ["after", "before"]
                for arm in order:
                    rates[(case, arm)].append(_arm(trees[arm], CASES[case], args.output_len))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    print(f"before {args.before}, after {args.after}; median of {args.rounds} rounds, tokens/s\n")
    print("| case | before | after | after/before | rounds before | rounds after |\n|---|---:|---:|---:|---|---|")
    for case in cases:
        before, after = (statistics.median(rates[(case, a)]) for a in ("before", "after"))
        spread = [" ".join(f"{x:.2f}" for x in rates[(case, a)]) for a in ("before", "after")]
        print(f"| {case} | {before:.2f} | {after:.2f} | {after / before:.3f}x | {spread[0]} | {spread[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
