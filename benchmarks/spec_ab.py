"""Same-run A/B: speculation configurations against plain decoding in one engine.

Loads the target and the draft once, then alternates plain decoding and every
configuration (a preset of ``pagedtree.speculative.presets``, or ``default`` for the
engine's own speculative config; either followed by ``@field=value`` settings of
``SpeculativeConfig``, as in ``default@draft_min_prob=0.5``) round after round, each round starting one arm
later, so slow drifts of a noisy machine hit every arm alike. A draft model's preset
on an engine that also runs the suffix drafter (a CPU stream's default) sits the
suffix drafter out, so ``--configs adaptive-chain-5,default`` compares the chain
alone with the chain beside the suffix drafter. Each arm of a round times the first ``--num-prompts``
prompts of each ``--datasets`` one after another at batch 1; the table reports the
median tokens/s over the rounds, the ratio to plain decoding of the same rounds,
drafts, accepted tokens and the mean acceptance length.

    python benchmarks/spec_ab.py --datasets prose --configs default --rounds 5
    python benchmarks/spec_ab.py --configs default,default@draft_min_prob=0.5 --datasets prose,coding
    python benchmarks/spec_ab.py --dtype bfloat16 --quantization none --datasets prose --rounds 5

Presets that change what is loaded (``draft_vocab_size``) need their own engine:
give them as ``--load-spec`` (JSON) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="default: the model's own (a GGUF file: q4 on CPU)")
    parser.add_argument("--load-spec", default="{}", help="the engine's SpeculativeConfig fields as JSON")
    parser.add_argument("--configs", default="default",
                        help="comma-separated preset names, or 'default' (the engine's own config), each "
                             "optionally followed by @field=value settings")
    parser.add_argument("--datasets", default="coding,prose", help="from coding, prose, edit")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    from tqdm.auto import tqdm

    import pagedtree  # noqa: F401 - before torch: OpenMP's passive wait policy
    from benchmarks.engines import EngineOptions, clear_suffix_cache, load_pagedtree, time_batches
    from pagedtree.loadgen.datasets import PROMPT_SETS, chat_token_ids
    from pagedtree.speculative import SpeculativeConfig
    from pagedtree.speculative.presets import tree_preset

    load_spec = json.loads(args.load_spec)
    # The suffix drafter's tree is cleared once per arm and dataset below, not per prompt.
    options = EngineOptions(args.model, label="pagedtree", draft_model=[args.draft_model], spec=load_spec,
                            dtype=args.dtype, quantization=args.quantization, keep_suffix_cache=True)
    info, run = load_pagedtree(options, None, 2048)
    print(f"loaded in {info.load_seconds:.1f} s", flush=True)
    llm = run.llm
    engine, speculator = llm.engine, llm.engine.speculation
    base = speculator.config
    arms: dict[str, SpeculativeConfig | None] = {"plain": None}
    for name in args.configs.split(","):
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        preset, *settings = name.split("@")
        if preset != "default":
            fields.update(tree_preset(preset))
        for setting in settings:
            field, _, value = setting.partition("=")
            if field not in fields or not value:
                parser.error(f"{setting!r} in {name!r} is not a SpeculativeConfig field=value")
            try:
                fields[field] = json.loads(value)
            except json.JSONDecodeError:
                fields[field] = value  # a string field (tree, drafter, ...)
        if fields.get("draft_vocab_size") != base.draft_vocab_size:
            parser.error(f"{name} cuts the draft vocabulary: load it with --load-spec")
        try:
            arms[name] = SpeculativeConfig(**fields)
        except ValueError as exc:
            parser.error(f"{name}: {exc}")
    tokenizer = llm.get_tokenizer()
    prompts = {d: [chat_token_ids(tokenizer, chat) for chat in PROMPT_SETS[d][: args.num_prompts]]
               for d in args.datasets.split(",")}
    first = next(iter(prompts.values()))[0]
    run([first], args.temperature, 8)  # warm-up

    rates: dict[tuple[str, str], list[float]] = {}
    counts: dict[tuple[str, str], list[int]] = {}
    with tqdm(total=args.rounds * len(arms) * len(prompts), desc="A/B", unit="run") as bar:
        names = list(arms)
        for round_index in range(args.rounds):
            # Each round starts one arm later, so that no arm always follows the same one.
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                config = arms[name]
                engine.set_speculation(config is not None)
                if config is not None:
                    speculator.reconfigure(config)
                for dataset, ids in prompts.items():
                    clear_suffix_cache(llm)  # no memory of the last round's outputs
                    # Batch 1: the prompts one after another.
                    tokens, seconds, counters = time_batches(run, [[p] for p in ids], args.temperature,
                                                             args.output_len)
                    rates.setdefault((name, dataset), []).append(tokens / seconds)
                    total = counts.setdefault((name, dataset), [0, 0])
                    total[0] += counters["num_drafts"]
                    total[1] += counters["num_accepted_tokens"]
                    bar.update()
    print(f"\n{args.model} + {args.draft_model}, dtype {args.dtype}, quantization {args.quantization or 'model default'}, "
          f"load spec {load_spec}; {args.num_prompts} prompts x {args.output_len} tokens per dataset, batch 1, "
          f"temperature {args.temperature}, median of {args.rounds} alternating rounds")
    print("| config | dataset | tokens/s | vs plain | drafts | accepted | mean acceptance length |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for (name, dataset), values in rates.items():
        median = statistics.median(values)
        plain = statistics.median(rates[("plain", dataset)])
        drafts, accepted = counts[(name, dataset)]
        length = f"{1 + accepted / drafts:.2f}" if drafts else ""
        print(f"| {name} | {dataset} | {median:.2f} | {median / plain:.2f}x | {drafts} | {accepted} | {length} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
