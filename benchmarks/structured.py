"""Structured outputs: what a JSON schema costs per token, and what tree speculation
buys under one.

A JSON-extraction workload: eight prompts (a person, an order with items, an event
with a date and attendees, a product with an enum category, a book, a weather
report, a flight, a review), each asking for an object of its own JSON schema,
rendered through the model's chat template. One engine, built with speculation,
runs three arms round after round (so slow drifts of a noisy machine hit all
alike), at every batch size:

- ``unconstrained``: plain decoding without the constraint, each request cut to the
  length its constrained output has (EOS ignored), so that every arm produces the
  same number of tokens per prompt;
- ``constrained``: plain decoding under the schema (``set_speculation(False)``);
- ``constrained+spec``: the same requests with tree speculation on (the draft
  model, or the suffix drafter, plus the tokens the grammar forces).

Reports tokens/s (median over rounds), ms per token, the per-token cost of the
constraint (constrained / unconstrained), the speed-up of speculation under the
constraint (constrained+spec / constrained), the mean acceptance length, the forced
tokens, and the fraction of outputs that parse and validate against their schema.
Requests are seeded (``--seed``): at a temperature above 0 the constrained arms
draw the same tokens, with speculation or without.

    python benchmarks/structured.py --batch-sizes 1,8 --max-tokens 128 --rounds 3
    python benchmarks/structured.py --model smollm2-135m-instruct --drafter suffix --rounds 1 --batch-sizes 1

``--engine vllm`` runs the same workload on vLLM's offline ``LLM`` with its own
structured outputs (xgrammar; run it with vLLM's environment, ``.venv-vllm``):
the unconstrained and constrained arms, in the same table format, so a pagedtree run
and a vLLM run of the same model, dtype and batch sizes compare cell by cell.

    .venv-vllm/bin/python benchmarks/structured.py --engine vllm --model smollm2-135m-instruct --dtype float32

Writes ``TAG.md`` (the table, the command on its second line), ``TAG.json`` and
``TAG.png`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = ("unconstrained", "constrained", "constrained+spec")


def _s(n: int = 48) -> dict:
    return {"type": "string", "maxLength": n}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}

# (what to extract from, its schema)
TASKS: list[tuple[str, dict]] = [
    ("Alice Martin is a 34-year-old software engineer who lives in Lyon. Her email is alice.martin@example.com.",
     _obj({"name": _s(), "age": {"type": "integer", "minimum": 0, "maximum": 150}, "occupation": _s(),
           "city": _s(), "email": _s()})),
    ("Order A-1042: two notebooks at 3.50 dollars each and one pen at 1.20 dollars, shipped to Berlin.",
     _obj({"order_id": _s(16), "items": {"type": "array", "maxItems": 8,
                                         "items": _obj({"name": _s(), "quantity": {"type": "integer", "minimum": 1},
                                                        "unit_price": {"type": "number", "minimum": 0}})},
           "ship_to": _s()})),
    ("The team offsite is on 2025-06-14 in room 4B; Dana, Lee and Priya will attend.",
     _obj({"title": _s(), "date": DATE, "location": _s(),
           "attendees": {"type": "array", "items": _s(), "maxItems": 10}})),
    ("The Acme X200 cordless drill costs 89.99 euros and is in stock.",
     _obj({"name": _s(), "category": {"enum": ["tools", "electronics", "books", "food", "clothing"]},
           "price": {"type": "number", "minimum": 0}, "currency": _s(8), "in_stock": {"type": "boolean"}})),
    ("'The Silent Sea' by Mara Quinn, published in 2019, 312 pages; a thriller and a mystery.",
     _obj({"title": _s(), "author": _s(), "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
           "pages": {"type": "integer", "minimum": 1},
           "genres": {"type": "array", "items": {"enum": ["thriller", "mystery", "romance", "fantasy", "history"]},
                      "maxItems": 5}})),
    ("Tomorrow in Oslo: a high of 12 C, a low of 4 C and a 70 percent chance of rain.",
     _obj({"city": _s(), "high_c": {"type": "number"}, "low_c": {"type": "number"},
           "precipitation_chance": {"type": "integer", "minimum": 0, "maximum": 100},
           "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("Flight LH2034 from Munich to Lisbon leaves at 07:45 on 2025-03-02; the passenger sits in 14C.",
     _obj({"flight_number": _s(12), "origin": _s(), "destination": _s(),
           "departure_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "date": DATE,
           "seat": _s(8)})),
    ("I loved the pasta and the view, but the service was slow and the bill was wrong. 3 out of 5.",
     _obj({"sentiment": {"enum": ["positive", "negative", "mixed"]},
           "rating": {"type": "integer", "minimum": 1, "maximum": 5},
           "pros": {"type": "array", "items": _s(), "maxItems": 5},
           "cons": {"type": "array", "items": _s(), "maxItems": 5}}, required=["sentiment", "rating"])),
]


def task_text(text: str, schema: dict) -> str:
    return ("Extract the information in the following text as a JSON object that matches this JSON schema.\n"
            f"Schema: {json.dumps(schema)}\nText: {text}\nAnswer with the JSON object only.")


def validates(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON (strict: RFC 8259) that matches ``schema``."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@dataclass
class Cell:
    """One arm at one batch size, over the rounds."""

    arm: str
    batch_size: int
    tokens: list[int] = field(default_factory=list)  # per round
    seconds: list[float] = field(default_factory=list)
    requests: int = 0
    valid: int = 0
    finished: int = 0  # outputs that ended with "stop"
    drafts: int = 0
    accepted: int = 0
    forced: int = 0

    @property
    def rates(self) -> list[float]:
        return [t / s for t, s in zip(self.tokens, self.seconds) if s > 0]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000.0 / self.tokens_per_s if self.tokens_per_s else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def time_arm(cell: Cell, generate, num_prompts: int, schemas: list[dict],
             samples: dict[str, str] | None = None) -> None:
    """One round of ``cell``'s arm: every prompt, ``cell.batch_size`` at a time, through
    ``generate(indices) -> outputs`` (timed around the calls only); records the round's
    tokens and seconds, and each output's finish and validity (and first text in
    ``samples``)."""
    tokens, seconds = 0, 0.0
    for start in range(0, num_prompts, cell.batch_size):
        indices = list(range(start, min(start + cell.batch_size, num_prompts)))
        t0 = time.perf_counter()
        outs = generate(indices)
        seconds += time.perf_counter() - t0
        for i, out in zip(indices, outs):
            completion = out.outputs[0]
            tokens += len(completion.token_ids)
            cell.requests += 1
            cell.finished += completion.finish_reason == "stop"
            cell.valid += validates(completion.text, schemas[i])
            if samples is not None:
                samples.setdefault(f"{cell.arm} #{i}", completion.text)
    cell.tokens.append(tokens)
    cell.seconds.append(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct",
                        help="the draft model (with --drafter model or model+suffix)")
    parser.add_argument("--drafter", default="model", choices=["model", "suffix", "model+suffix"],
                        help="where trees come from; 'suffix' needs no draft model")
    parser.add_argument("--spec", default="{}", help="more SpeculativeConfig fields as JSON (default: the engine's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, help="default: the model's own (a GGUF file: q4 on CPU)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128, help="the cap on every output")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="every request's seed")
    parser.add_argument("--any-whitespace", action="store_true",
                        help="let the JSON carry free whitespace (default: compact, disable_any_whitespace)")
    parser.add_argument("--out-dir", default="benchmarks/results/structured")
    parser.add_argument("--tag", default="structured", help="file name stem of the outputs")
    parser.add_argument("--num-prompts", type=int, default=len(TASKS),
                        help=f"the first N of the {len(TASKS)} extraction prompts")
    parser.add_argument("--engine", default="pagedtree", choices=["pagedtree", "vllm"],
                        help="vllm: vLLM's own structured outputs, unconstrained and constrained arms (no speculation)")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or args.rounds < 1 or args.max_tokens < 1:
        parser.error("--batch-sizes, --rounds and --max-tokens must be >= 1")
    if not 1 <= args.num_prompts <= len(TASKS):
        parser.error(f"--num-prompts must be in [1, {len(TASKS)}]")
    del TASKS[args.num_prompts:]
    if args.engine == "vllm":
        return run_vllm(args, batch_sizes, argv)

    from tqdm.auto import tqdm

    import pagedtree  # noqa: F401 - before torch: OpenMP's passive wait policy
    from benchmarks.engines import EngineOptions, clear_suffix_cache, load_pagedtree
    from pagedtree import SamplingParams, StructuredOutputsParams
    from pagedtree.loadgen.datasets import chat_token_ids

    spec = {"drafter": args.drafter, **json.loads(args.spec)}
    drafts = [args.draft_model] if args.drafter != "suffix" else None
    options = EngineOptions(args.model, label="pagedtree", draft_model=drafts, spec=spec, dtype=args.dtype,
                            quantization=args.quantization, seed=args.seed, keep_suffix_cache=True)
    info, run = load_pagedtree(options, max(batch_sizes), 4096)
    llm = run.llm
    engine = llm.engine
    print(f"loaded in {info.load_seconds:.1f} s: {engine.resolved}", flush=True)
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        parser.error(f"{args.model} has no tokenizer: structured outputs need one")
    prompts = [chat_token_ids(tokenizer, [("user", task_text(text, schema))]) for text, schema in TASKS]
    schemas = [schema for _, schema in TASKS]
    constraints = [StructuredOutputsParams(json=s, disable_any_whitespace=not args.any_whitespace) for s in schemas]

    # Compile every schema before anything is timed (the compiler's process starts on
    # the first one), then find each prompt's constrained length.
    started = time.perf_counter()
    for c in constraints:
        engine.grammars.compile(c)
    print(f"compiled {len(constraints)} schemas in {time.perf_counter() - started:.1f} s", flush=True)

    def params(i: int, arm: str, lengths: list[int] | None) -> SamplingParams:
        if arm == "unconstrained":
            return SamplingParams(temperature=args.temperature, seed=args.seed, ignore_eos=True,
                                  max_tokens=lengths[i] if lengths else args.max_tokens)
        return SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens,
                              structured_outputs=constraints[i])

    def generate(indices: list[int], arm: str, lengths: list[int] | None):
        engine.set_speculation(arm == "constrained+spec")
        return llm.generate([{"prompt_token_ids": prompts[i]} for i in indices],
                            [params(i, arm, lengths) for i in indices], use_tqdm=False)

    engine.set_speculation(False)
    reference = generate(list(range(len(prompts))), "constrained", None)
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in reference]
    for arm in ARMS:  # warm-up: each arm once, at the largest batch
        generate(list(range(min(max(batch_sizes), len(prompts)))), arm, lengths)

    cells = {(arm, b): Cell(arm, b) for b in batch_sizes for arm in ARMS}
    samples: dict[str, str] = {}
    with tqdm(total=args.rounds * len(batch_sizes) * len(ARMS), desc="rounds", unit="arm") as bar:
        for _ in range(args.rounds):
            for b in batch_sizes:
                for arm in ARMS:
                    cell = cells[(arm, b)]
                    clear_suffix_cache(llm)  # no memory of the last round's outputs
                    before = llm.stats()
                    time_arm(cell, lambda indices: generate(indices, arm, lengths), len(prompts), schemas, samples)
                    after = llm.stats()
                    if arm == "constrained+spec":
                        cell.drafts += after.get("num_drafts", 0) - before.get("num_drafts", 0)
                        cell.accepted += after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
                        cell.forced += after.get("num_forced_tokens", 0) - before.get("num_forced_tokens", 0)
                    bar.update()
    engine.set_speculation(True)

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/structured.py " + " ".join(sys.argv[1:] if argv is None else argv)
    drafter = args.drafter if args.drafter == "suffix" else f"{args.drafter} ({args.draft_model})"
    lines = [
        f"# Structured outputs: {args.model}, drafter {drafter}",
        f"`{command}`",
        "",
        f"{platform.machine()}, {platform.processor() or platform.system()}; dtype {args.dtype}, quantization "
        f"{args.quantization or 'model default'}, speculative {spec}; {len(TASKS)} JSON-extraction prompts, "
        f"max {args.max_tokens} tokens, temperature {args.temperature:g}, seed {args.seed}, "
        f"{'any whitespace' if args.any_whitespace else 'compact JSON'}; median of {args.rounds} alternating rounds. "
        f"Unconstrained requests are cut to their constrained length (mean "
        f"{statistics.mean(lengths):.1f} tokens; {sum(1 for o in reference if o.outputs[0].finish_reason == 'stop')}"
        f"/{len(reference)} constrained outputs ended within the cap).",
        "",
        "| batch | arm | tokens/s | ms/token | cost vs unconstrained | spec vs plain | mean acceptance length "
        "| forced tokens | valid |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in batch_sizes:
        base = cells[("unconstrained", b)]
        plain = cells[("constrained", b)]
        for arm in ARMS:
            cell = cells[(arm, b)]
            cost = speedup = ""
            if arm != "unconstrained" and base.ms_per_token:
                cost = f"{cell.ms_per_token / base.ms_per_token:.3f}x"
            if arm == "constrained+spec" and plain.tokens_per_s:
                speedup = f"{cell.tokens_per_s / plain.tokens_per_s:.3f}x"
            length = f"{cell.mean_acceptance_length:.2f}" if cell.mean_acceptance_length else ""
            forced = str(cell.forced // args.rounds) if arm == "constrained+spec" else ""
            valid = f"{cell.valid / cell.requests:.0%}" if cell.requests else ""
            lines.append(f"| {b} | {arm} | {cell.tokens_per_s:.2f} | {cell.ms_per_token:.2f} | {cost} | {speedup} "
                         f"| {length} | {forced} | {valid} |")
    lines += ["", "Forced tokens: per round (the grammar's forced spans, proposed without a draft pass). "
              "Valid: outputs that parse as JSON and validate against their schema."]
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    (out_dir / f"{args.tag}.md").write_text(table)
    report = {"command": command, "args": vars(args), "engine": str(engine.resolved), "lengths": lengths,
              "load_seconds": info.load_seconds, "cells": [asdict(c) | {"tokens_per_s": c.tokens_per_s,
                                                                        "ms_per_token": c.ms_per_token}
                                                           for c in cells.values()],
              "samples": samples}
    (out_dir / f"{args.tag}.json").write_text(json.dumps(report, indent=1, default=str))
    plot(cells, batch_sizes, out_dir / f"{args.tag}.png", f"{args.model}, drafter {drafter}")
    print(f"wrote {out_dir / args.tag}.md, .json, .png")
    return 0


def run_vllm(args: argparse.Namespace, batch_sizes: list[int], argv: list[str] | None) -> int:
    """The workload on vLLM (its offline ``LLM``, structured outputs by xgrammar):
    unconstrained and constrained arms, alternating, the same prompts and lengths."""
    import os

    from tqdm.auto import tqdm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    folder = os.path.expanduser(f"~/.cache/pagedtree/hf/{args.model}")
    model = folder if os.path.isdir(folder) else args.model  # a packaged name's converted folder, else as given
    dtype = "float32" if args.dtype == "auto" else args.dtype
    started = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=4096, seed=args.seed, max_num_seqs=max(batch_sizes),
              enable_prefix_caching=False)
    load_seconds = time.perf_counter() - started
    tokenizer = llm.get_tokenizer()
    prompts = []
    for text, schema in TASKS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": task_text(text, schema)}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    schemas = [schema for _, schema in TASKS]

    def params(i: int, arm: str, lengths: list[int] | None):
        if arm == "unconstrained":
            return SamplingParams(temperature=args.temperature, seed=args.seed, ignore_eos=True,
                                  max_tokens=lengths[i] if lengths else args.max_tokens)
        return SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens,
                              structured_outputs=StructuredOutputsParams(
                                  json=schemas[i], disable_any_whitespace=not args.any_whitespace))

    def generate(indices: list[int], arm: str, lengths: list[int] | None):
        return llm.generate([{"prompt_token_ids": prompts[i]} for i in indices],
                            [params(i, arm, lengths) for i in indices], use_tqdm=False)

    reference = generate(list(range(len(prompts))), "constrained", None)  # compiles every schema too
    lengths = [max(1, len(o.outputs[0].token_ids)) for o in reference]
    arms = ARMS[:2]
    for arm in arms:
        generate(list(range(min(max(batch_sizes), len(prompts)))), arm, lengths)
    cells = {(arm, b): Cell(arm, b) for b in batch_sizes for arm in ARMS}
    with tqdm(total=args.rounds * len(batch_sizes) * len(arms), desc="rounds", unit="arm") as bar:
        for _ in range(args.rounds):
            for b in batch_sizes:
                for arm in arms:
                    cell = cells[(arm, b)]
                    time_arm(cell, lambda indices: generate(indices, arm, lengths), len(prompts), schemas)
                    bar.update()
    import vllm

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/structured.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# Structured outputs on vLLM {vllm.__version__}: {args.model}", f"`{command}`", "",
             f"{platform.machine()}; dtype {dtype}; {len(TASKS)} JSON-extraction prompts, max {args.max_tokens} "
             f"tokens, temperature {args.temperature:g}, {'any whitespace' if args.any_whitespace else 'compact JSON'}; "
             f"median of {args.rounds} alternating rounds; loaded in {load_seconds:.0f} s. Unconstrained requests "
             f"are cut to their constrained length (mean {statistics.mean(lengths):.1f} tokens).", "",
             "| batch | arm | tokens/s | ms/token | cost vs unconstrained | valid |", "|---:|---|---:|---:|---:|---:|"]
    for b in batch_sizes:
        base = cells[("unconstrained", b)]
        for arm in arms:
            cell = cells[(arm, b)]
            cost = f"{cell.ms_per_token / base.ms_per_token:.3f}x" if arm != "unconstrained" and base.ms_per_token else ""
            lines.append(f"| {b} | {arm} | {cell.tokens_per_s:.2f} | {cell.ms_per_token:.2f} | {cost} "
                         f"| {cell.valid / cell.requests:.0%} |")
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    (out_dir / f"{args.tag}.md").write_text(table)
    (out_dir / f"{args.tag}.json").write_text(json.dumps(
        {"command": command, "args": vars(args), "lengths": lengths, "load_seconds": load_seconds,
         "cells": [asdict(c) | {"tokens_per_s": c.tokens_per_s} for c in cells.values() if c.tokens]},
        indent=1, default=str))
    print(f"wrote {out_dir / args.tag}.md, .json")
    return 0


def plot(cells: dict[tuple[str, int], Cell], batch_sizes: list[int], path: Path, title: str) -> None:
    """Tokens/s per arm and batch size, and the two ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(ARMS)
    for k, arm in enumerate(ARMS):
        xs = [i + (k - (len(ARMS) - 1) / 2) * width for i in range(len(batch_sizes))]
        left.bar(xs, [cells[(arm, b)].tokens_per_s for b in batch_sizes], width, label=arm)
    left.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    left.set(xlabel="batch size", ylabel="output tokens/s", title="throughput")
    left.legend(fontsize=8)
    left.grid(axis="y", alpha=0.3)

    def ratio(a: Cell, b: Cell) -> float:
        return a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else 0.0

    xs = range(len(batch_sizes))
    right.plot(xs, [ratio(cells[("constrained", b)], cells[("unconstrained", b)]) for b in batch_sizes],
               marker="o", label="constrained / unconstrained")
    right.plot(xs, [ratio(cells[("constrained+spec", b)], cells[("constrained", b)]) for b in batch_sizes],
               marker="o", label="constrained+spec / constrained")
    right.axhline(1.0, color="grey", lw=1)
    right.set_xticks(list(xs), [str(b) for b in batch_sizes])
    right.set(xlabel="batch size", ylabel="tokens/s ratio", title="same-run ratios")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
