"""How closely each weight format follows bf16: greedy agreement, log-probability
differences and perplexity, for pagedtree's formats and llama.cpp on the same GGUF.

The reference continuation of each prompt is bf16's own greedy output (``--tokens``
tokens, pagedtree dense bf16). Every format then reads prompt + reference in one pass
(teacher forcing) and is scored at each reference position:

- agreement: the fraction of positions where the format's most likely token is the
  reference token (bf16's choice);
- mean |logprob difference|: ``|log p_format(token) - log p_bf16(token)|`` averaged over
  the positions;
- perplexity on a held-out text (``--text``; by default a passage written for this
  benchmark, prose and code, so no model has seen it).

pagedtree formats run the engine's own loaded model (its linear kernels, its
quantized weights) with plain causal attention over the one sequence; llama.cpp runs
in its own environment (``--llamacpp-python``) through llama-cpp-python with
``logits_all``, on the same token ids.

    .venv/bin/python benchmarks/accuracy.py --model qwen2.5-coder-1.5b-instruct \\
        --formats bf16,q4,q8,int4 --out benchmarks/results/accuracy
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    ("Refactor this function to avoid the nested loops:\ndef pairs(xs):\n    out = []\n    for a in xs:\n"
     "        for b in xs:\n            if a + b == 10:\n                out.append((a, b))\n    return out\n"),
    "Explain in a short paragraph why the sky is blue.",
    "Write a short story opening about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for writing maintainable code? Answer briefly.",
    "Summarise the difference between a process and a thread for a new programmer.",
]

HELD_OUT = """The harbour town woke slowly in winter. Fishing boats stayed tied to the quay until the
fog lifted, and the baker on the corner opened an hour later than in summer, because nobody
came for bread before the light did. Mara kept the ledger for the cooperative: every crate of
mackerel, every repaired net, every debt that would be settled when the weather turned. She
liked the numbers because they did not argue. When the council proposed a new breakwater, she
was the one who showed that the repairs of the last ten years had cost more than the new wall
would, and the vote passed by a single hand.

def moving_average(values, window):
    \"\"\"Mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages

A cache is only as good as its eviction rule. Least-recently-used works when the recent past
predicts the near future; when a scan reads every item once, it flushes everything useful,
which is why databases keep a small probation area for items seen only once.
"""


def causal_attention(layer_index, query, key, value):
    """Attention of one sequence over itself (no paged cache): ``[T, H, D]`` in and out."""
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    q, k, v = (t.transpose(0, 1) for t in (query, key.repeat_interleave(groups, 1),
                                            value.repeat_interleave(groups, 1)))
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return out.transpose(0, 1).to(query.dtype)


def _pagedtree_scores(model: str, fmt: str, sequences: list[list[int]], wanted: list[list[int]]) -> dict:
    """Log-probabilities of ``wanted[i][j]`` at position j of sequence i, and whether it
    was the most likely token, for pagedtree in format ``fmt``."""
    import torch

    from pagedtree import LLM

    kwargs = {"dtype": "bfloat16", "quantization": "none"} if fmt == "bf16" else {"quantization": fmt}
    if fmt == "fp32":
        kwargs = {"dtype": "float32", "quantization": "none"}
    llm = LLM(model, max_model_len=4096, kv_cache_memory=2**26, **kwargs)
    net = llm.engine.runner.model
    out = {"logprobs": [], "top": []}
    with torch.inference_mode():
        for ids, targets in zip(sequences, wanted):
            x = torch.tensor(ids)
            hidden = net.forward(x, torch.arange(len(ids)), causal_attention)
            logits = net.compute_logits(hidden).float()
            logp = torch.log_softmax(logits, dim=-1)
            # position j predicts token j + 1
            rows = torch.arange(len(ids) - len(targets) - 1, len(ids) - 1)
            chosen = logp[rows, torch.tensor(targets)]
            out["logprobs"].append(chosen.tolist())
            out["top"].append(logp[rows].argmax(-1).tolist())
    del llm, net
    return out


def _llamacpp_scores(python: str, gguf: str, sequences: list[list[int]], wanted: list[list[int]]) -> dict:
    """The same scores from llama.cpp, in its own environment."""
    job = json.dumps({"gguf": gguf, "sequences": sequences, "wanted": wanted})
    done = subprocess.run([python, __file__, "--llamacpp-worker"], input=job, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_worker() -> None:
    """Runs inside the llama.cpp environment (numpy and llama_cpp only)."""
    import os

    import llama_cpp
    import numpy as np

    job = json.loads(sys.stdin.read())
    longest = max(len(s) for s in job["sequences"])
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=longest + 8, n_batch=512, logits_all=True, verbose=False,
                          n_threads=os.cpu_count(), n_threads_batch=os.cpu_count())
    out = {"logprobs": [], "top": []}
    for ids, targets in zip(job["sequences"], job["wanted"]):
        llm.reset()
        llm.eval(ids)
        scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
        rows = np.arange(len(ids) - len(targets) - 1, len(ids) - 1)
        logits = scores[rows]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        out["logprobs"].append([float(logp[i, t]) for i, t in enumerate(targets)])
        out["top"].append([int(i) for i in logp.argmax(-1)])
    print(json.dumps(out))


def summarise(scores: dict, reference: dict, n_prompts: int) -> dict:
    """Agreement and mean |logprob difference| over the prompts; perplexity on the held-out text."""
    agree = total = 0
    diffs: list[float] = []
    for i in range(n_prompts):
        ref_tokens_top = reference["top"][i]
        for j, (lp, ref_lp) in enumerate(zip(scores["logprobs"][i], reference["logprobs"][i])):
            diffs.append(abs(lp - ref_lp))
            total += 1
            agree += scores["top"][i][j] == ref_tokens_top[j]
    held_out = scores["logprobs"][n_prompts]
    return {"agreement": agree / total, "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "perplexity": math.exp(-sum(held_out) / len(held_out)), "positions": total,
            "held_out_tokens": len(held_out)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="packaged model name (a GGUF)")
    parser.add_argument("--formats", default="bf16,q4,q8,int4",
                        help="comma-separated pagedtree formats (bf16 first: the reference; fp32, q4, q8, int4, int8)")
    parser.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt")
    parser.add_argument("--text", default=None, help="held-out text file for perplexity (default: built in)")
    parser.add_argument("--llamacpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"),
                        help="Python of the llama.cpp environment ('' to skip llama.cpp)")
    parser.add_argument("--out", default=str(HERE / "results" / "accuracy"), help="output prefix (.json, .md)")
    parser.add_argument("--llamacpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llamacpp_worker:
        llamacpp_worker()
        return 0
    formats = args.formats.split(",")
    if formats[0] != "bf16":
        parser.error("--formats must start with bf16 (the reference)")

    from tqdm import tqdm

    from pagedtree import LLM, SamplingParams
    from pagedtree.loading import packaged_models as pm

    text = Path(args.text).read_text() if args.text else HELD_OUT
    started = time.time()
    reference_llm = LLM(args.model, dtype="bfloat16", quantization="none", max_model_len=4096,
                        kv_cache_memory=2**27)
    tokenizer = reference_llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS]
    outs = reference_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
                                  use_tqdm=True)
    sequences, wanted = [], []
    for out in outs:
        continuation = list(out.outputs[0].token_ids)
        sequences.append(list(out.prompt_token_ids) + continuation)
        wanted.append(continuation)
    del reference_llm
    held = tokenizer(text, add_special_tokens=False)["input_ids"]
    sequences.append(held)
    wanted.append(held[1:])

    results: dict[str, dict] = {}
    raw: dict[str, dict] = {}
    engines = [("pagedtree", f) for f in formats]
    if args.llamacpp_python and Path(args.llamacpp_python).exists():
        engines.append(("llamacpp", pm.gguf_path(pm.PACKAGED_MODELS[args.model]).name))
    for engine, fmt in tqdm(engines, desc="formats", unit="format"):
        label = f"pagedtree {fmt}" if engine == "pagedtree" else f"llama.cpp {fmt}"
        if engine == "pagedtree":
            raw[label] = _pagedtree_scores(args.model, fmt, sequences, wanted)
        else:
            raw[label] = _llamacpp_scores(args.llamacpp_python, str(pm.gguf_path(pm.PACKAGED_MODELS[args.model])),
                                          sequences, wanted)
    reference = raw["pagedtree bf16"]
    for label, scores in raw.items():
        results[label] = summarise(scores, reference, len(PROMPTS))

    lines = [(f"Model {args.model}; reference: pagedtree bf16's greedy output, {len(PROMPTS)} prompts x "
              f"{args.tokens} tokens (teacher-forced); perplexity on a held-out text of {len(held)} tokens."), "",
             "| engine / format | agreement with bf16 | mean abs logprob diff | perplexity |", "|---|---:|---:|---:|"]
    for label, r in results.items():
        lines.append(f"| {label} | {r['agreement']:.3f} | {r['mean_abs_logprob_diff']:.4f} | {r['perplexity']:.3f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"model": args.model, "tokens": args.tokens, "results": results,
                                                    "seconds": time.time() - started}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
