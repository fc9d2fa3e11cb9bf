"""Offline generation with tree speculative decoding on the embedded Qwen pair.

Loads the Qwen2.5-Coder-1.5B-Instruct target with the 0.5B draft, generates for a
few chats with tree speculation, then again with speculation off in the same
engine, and prints the text, tokens/s of both, the mean acceptance length and the
speed-up, overall and per chat. Greedy outputs of both runs are checked to be
identical. The default chats are a coding question and a code edit, one after the
other: where the output is new text a CPU's rows may cost more than trees save, and
the adaptive budget then keeps decoding plain; where it copies its prompt, the
suffix drafter's trees are verified.
"""

from __future__ import annotations

import argparse
import time

from pagedtree import LLM, SamplingParams
from pagedtree.loadgen.datasets import PROMPT_SETS
from pagedtree.speculative import SpeculativeConfig

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


def chats_of(dataset: str) -> list[list[tuple[str, str]]]:
    """The chats of ``dataset``: a set of compare.py's, or "mixed" (coding and edit
    chats in turn)."""
    if dataset != "mixed":
        return PROMPT_SETS[dataset]
    return [chat for pair in zip(PROMPT_SETS["coding"], PROMPT_SETS["edit"]) for chat in pair]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TARGET, help="target model (default: %(default)s)")
    parser.add_argument("--draft-model", default=DRAFT, nargs="+", help="draft model(s) (default: %(default)s)")
    parser.add_argument("--tree", default=None, choices=["static", "chain", "dynamic", "sequoia"],
                        help="tree kind (default: the engine's own speculation; on a CPU, the draft's "
                             "adaptive chain of 5 beside the suffix drafter)")
    parser.add_argument("--drafter", default=None, choices=["model", "model+suffix"],
                        help="where trees come from (default: the engine's own choice)")
    parser.add_argument("--expansion", default=None, help="static expansion, e.g. 2,2,1,1,1,1")
    parser.add_argument("--max-nodes", type=int, default=None, help="node budget per request")
    parser.add_argument("--depth", type=int, default=None, help="depth of chain/dynamic/sequoia trees")
    parser.add_argument("--no-adaptive", action="store_true", help="always speculate with the full budget")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=2, help="chats, run one at a time (batch 1)")
    parser.add_argument("--dataset", default="mixed", choices=["mixed", *PROMPT_SETS],
                        help="chats: a coding question and a code edit in turn, or one set (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Only what was asked for: with none of it the engine picks its own default.
    spec: dict[str, object] = {}
    if args.tree:
        spec["tree"] = args.tree
    if args.drafter:
        spec["drafter"] = args.drafter
    if args.no_adaptive:
        spec["adaptive"] = False
    if args.expansion:
        spec["expansion"] = tuple(int(k) for k in args.expansion.split(","))
    if args.max_nodes:
        spec["max_nodes"] = args.max_nodes
    if args.depth:
        spec["depth"] = args.depth
    llm = LLM(args.model, draft_model=args.draft_model, speculative=SpeculativeConfig(**spec) if spec else None,
              max_model_len=2048)
    config = llm.engine.speculation.config
    described = f"{config.tree}{' + suffix' if config.drafter == 'model+suffix' else ''}, up to {config.max_nodes} nodes"
    tok = llm.get_tokenizer()
    dialogues = chats_of(args.dataset)
    dialogues = (dialogues * (args.num_prompts // len(dialogues) + 1))[: args.num_prompts]
    chats = [
        tok.apply_chat_template([{"role": role, "content": text} for role, text in dialogue], tokenize=False,
                                add_generation_prompt=True)
        for dialogue in dialogues
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    # Warm up on the same prompts and lengths, plainly, so that neither timed run pays
    # one-time costs (a step shape's first graph, the cache's first pages).
    llm.engine.set_speculation(False)
    for chat in chats:
        llm.generate([chat], params, use_tqdm=False)
    suffix = getattr(llm.engine.speculation.proposer, "suffix", None)

    # Each prompt one at a time (the batch-1 latency case) with speculation and
    # without, the order alternating from prompt to prompt: a machine that speeds up
    # or slows down over the run moves both alike.
    outs: dict[bool, list] = {True: [], False: []}
    tokens = {True: 0, False: 0}
    seconds = {True: 0.0, False: 0.0}
    per_chat: list[dict[bool, float]] = []  # tokens/s of each chat, with and without
    before = llm.stats()
    for index, chat in enumerate(chats):
        per_chat.append({})
        for speculate in ((True, False) if index % 2 == 0 else (False, True)):
            llm.engine.set_speculation(speculate)
            if speculate and suffix is not None:
                # The suffix drafter would otherwise propose the other run's output,
                # or the warm-up's, back verbatim.
                suffix.clear_global()
            started = time.perf_counter()
            out = llm.generate([chat], params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - started
            seconds[speculate] += elapsed
            tokens[speculate] += len(out.outputs[0].token_ids)
            per_chat[-1][speculate] = len(out.outputs[0].token_ids) / elapsed
            outs[speculate].append(out)
    after = llm.stats()
    spec_outs, plain_outs = outs[True], outs[False]
    spec_tps, plain_tps = tokens[True] / seconds[True], tokens[False] / seconds[False]
    for dialogue, out, rates in zip(dialogues, spec_outs, per_chat):
        ask = dialogue[-1][1].split("\n")[0]
        print(f"### {ask}\n{out.outputs[0].text}\n")
        print(f"(this chat: {rates[True]:.2f} tokens/s with speculation, {rates[False]:.2f} without, "
              f"{rates[True] / rates[False]:.2f}x; {out.metrics.get('spec_num_drafts', 0):.0f} trees verified)\n")
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    if drafts:
        outcome = f"{drafts} trees verified, mean acceptance length {1 + accepted / drafts:.2f}"
    else:  # the adaptive budget priced every tree above what it would save
        outcome = "no tree drafted: on this machine verifying one would cost more than it saves"
    print(f"weights: {llm.engine.resolved.target.quantization or llm.engine.resolved.target.dtype}")
    print(f"tree speculation ({described}): {spec_tps:.2f} tokens/s, {outcome}")
    print(f"plain decoding:   {plain_tps:.2f} tokens/s")
    print(f"speed-up: {spec_tps / plain_tps:.2f}x (same engine, same run, batch 1)")
    if args.temperature == 0:
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(spec_outs, plain_outs))
        print(f"greedy outputs identical with and without speculation: {same}")
    stats = llm.stats()
    print(f"KV blocks free: target {stats['num_free_blocks']}/{stats['num_total_blocks']}, "
          f"draft {stats['draft_num_free_blocks']}/{stats['draft_num_total_blocks']}")


if __name__ == "__main__":
    main()
