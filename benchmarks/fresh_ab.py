"""Plain decoding against speculation in alternating fresh processes, with where the time goes.

A fresh process is what a user starts: nothing learnt, no prompt cached. Each round
starts one process of plain decoding and one of the engine with its draft model
(its default speculation, or ``--spec`` JSON), in turn, each running the first
``--num-prompts`` prompts of ``--dataset`` one after another at batch 1 for every
``--temperatures``. Every engine step is timed and classed: prefill, a plain decode
step, or a step that verified a tree. The table gives the median tokens/s of each
side over the rounds, their ratio, and the mean seconds per run of each class of step,
so that a difference splits into prefill, plain steps (their count and cost),
speculative steps (their tokens against what plain steps would have cost) and the
host's time between steps.

    python benchmarks/fresh_ab.py --dataset prose --rounds 10
    python benchmarks/fresh_ab.py --dataset coding --spec '{"draft_min_prob": 0.5}' --rounds 4

One process takes about a minute for the default pair (load included). Run it on a
quiet machine: processes of a noisy one differ by several percent. Steps run in order
(a CUDA engine's async scheduling off), so that every step is timed and classed, and
prefix caching is off, as ``compare.py`` runs every engine (the temperatures repeat
the same prompts, which a prefix cache would then hold).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP_CLASSES = ("prefill", "plain", "spec")


def run_one(args: argparse.Namespace, speculative: bool) -> list[dict]:
    """This process's measurements: one record per temperature."""
    import pagedtree  # noqa: F401 - before torch: OpenMP's passive wait policy
    from benchmarks.engines import EngineOptions, load_pagedtree, time_batches
    from pagedtree.loadgen.datasets import PROMPT_SETS, chat_token_ids
    from pagedtree.step_data import Phase

    spec = (json.loads(args.spec) if args.spec else {}) if speculative else None  # {}: the engine default
    options = EngineOptions(args.model, label="pagedtree", quantization=args.quantization,
                            draft_model=[args.draft_model] if speculative and args.draft_model else None,
                            spec=spec)
    _, run = load_pagedtree(options, None, 2048)
    engine = run.llm.engine
    steps: list[tuple[str, float, int]] = []
    execute = engine.step_runner.execute

    def timed(plan):
        started = time.perf_counter()
        result = execute(plan)
        seconds = time.perf_counter() - started
        phases = {chunk.phase for chunk in plan.chunks}
        kind = "prefill" if Phase.PREFILL in phases else "spec" if result.accepted else "plain"
        steps.append((kind, seconds, sum(len(tokens) for tokens in result.committed.values())))
        return result

    engine.step_runner.execute = timed
    # Steps launched ahead of their readback (a CUDA engine's plain steps) bypass
    # ``execute``: every step runs in order here, so that every step is classed.
    engine.set_async_scheduling(False)
    prompts = [chat_token_ids(run.llm.get_tokenizer(), chat) for chat in PROMPT_SETS[args.dataset]][:args.num_prompts]
    run([prompts[0]], args.temperatures[0], 8)  # warm-up
    records = []
    for temperature in args.temperatures:
        steps.clear()
        tokens, seconds, counters = time_batches(run, [[p] for p in prompts], temperature, args.output_len)
        by_class = {k: {"steps": 0, "seconds": 0.0, "tokens": 0} for k in STEP_CLASSES}
        for kind, step_seconds, committed in steps:
            by_class[kind]["steps"] += 1
            by_class[kind]["seconds"] += step_seconds
            by_class[kind]["tokens"] += committed
        records.append({"speculative": speculative, "temperature": temperature, "tokens": tokens, "seconds": seconds,
                        "by_class": by_class, "drafts": (counters or {}).get("num_drafts", 0)})
    return records


def table(records: list[dict], temperatures: list[float]) -> str:
    """Medians per side, their ratio, and the mean seconds of each class of step."""
    lines = ["| temperature | side | tokens/s (median) | ratio | prefill s | plain steps | ms a plain step "
             "| spec steps | spec s | tokens from spec steps | between steps s | drafts |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for temperature in temperatures:
        rates = {}
        for side in (False, True):
            rows = [r for r in records if r["speculative"] == side and r["temperature"] == temperature]
            if not rows:
                continue
            rates[side] = statistics.median(r["tokens"] / r["seconds"] for r in rows)

            def mean(key: str, kind: str, rows=rows) -> float:
                return statistics.mean(r["by_class"][kind][key] for r in rows)

            plain_ms = 1e3 * mean("seconds", "plain") / max(mean("steps", "plain"), 1e-9)
            between = statistics.mean(r["seconds"] - sum(c["seconds"] for c in r["by_class"].values()) for r in rows)
            ratio = "1.000x" if not side else f"{rates[side] / rates[False]:.3f}x" if False in rates else ""
            lines.append(
                f"| {temperature} | {'speculative' if side else 'plain'} | {rates[side]:.2f} | {ratio} "
                f"| {mean('seconds', 'prefill'):.3f} | {mean('steps', 'plain'):.1f} | {plain_ms:.1f} "
                f"| {mean('steps', 'spec'):.1f} | {mean('seconds', 'spec'):.3f} | {mean('tokens', 'spec'):.1f} "
                f"| {between:.3f} | {statistics.mean(r['drafts'] for r in rows):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct",
                        help="the speculative side's draft model ('': none, for the model-free suffix drafter)")
    parser.add_argument("--quantization", default=None, help="default: the model's own (a GGUF file: q4 on CPU)")
    parser.add_argument("--spec", default=None,
                        help="SpeculativeConfig fields as JSON (default: the engine's own speculation)")
    parser.add_argument("--dataset", default="prose", help="coding, prose or edit")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--temperatures", default="0,0.8", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="pairs of processes")
    parser.add_argument("--json", default=None, help="write every process's records here")
    parser.add_argument("--child", choices=["plain", "speculative"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.child:
        print(json.dumps(run_one(args, args.child == "speculative")))
        return 0

    from tqdm.auto import tqdm

    records: list[dict] = []
    forwarded = list(argv if argv is not None else sys.argv[1:])
    with tqdm(total=2 * args.rounds, desc="processes", unit="process") as bar:
        for round_index in range(args.rounds):
            sides = ["plain", "speculative"] if round_index % 2 == 0 else ["speculative", "plain"]
            for side in sides:
                out = subprocess.run([sys.executable, __file__, *forwarded, "--child", side], capture_output=True,
                                     text=True, check=False)
                if out.returncode != 0:
                    sys.stderr.write(out.stderr[-4000:])
                    return out.returncode
                records += json.loads(out.stdout.strip().splitlines()[-1])
                bar.update()
    print(table(records, args.temperatures))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
