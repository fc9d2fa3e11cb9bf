"""Offline generation on the embedded default model (Qwen2.5-Coder-1.5B-Instruct).

Runs one prompt alone and then a batch, printing the text and tokens/s of each, so
the gain of continuous batching is visible. ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import time

from pagedtree import LLM, SamplingParams

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a KV cache is in one paragraph.",
    "Write a SQL query that returns the ten most recent orders.",
    "Write a bash one-liner that counts lines in all .py files.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded Qwen2.5-Coder-1.5B)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=len(PROMPTS), help="prompts in the batched run")
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=2048)
    tok = llm.get_tokenizer()
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    chats = (chats * (args.batch // len(chats) + 1))[: args.batch]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    started = time.perf_counter()
    single = llm.generate(chats[:1], params, use_tqdm=False)[0]
    single_time = time.perf_counter() - started
    single_tps = len(single.outputs[0].token_ids) / single_time
    print(f"### {PROMPTS[0]}\n{single.outputs[0].text}\n")
    print(f"batch 1: {len(single.outputs[0].token_ids)} tokens, {single_tps:.2f} tokens/s\n")

    started = time.perf_counter()
    outs = llm.generate(chats, params)
    batch_time = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(PROMPTS[1:], outs[1:]):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    batch_tps = tokens / batch_time
    print(f"batch {len(chats)}: {tokens} tokens, {batch_tps:.2f} tokens/s "
          f"({batch_tps / single_tps:.2f}x the batch-1 rate)")
    stats = llm.stats()
    print(f"KV blocks free after the run: {stats['num_free_blocks']}/{stats['num_total_blocks']}")


if __name__ == "__main__":
    main()
