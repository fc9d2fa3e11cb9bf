"""Tree speculation against plain decoding: tree kinds and budgets x batch sizes.

One engine loads the target and the draft(s) once; for every batch size it runs the
same prompts with speculation off (the baseline of that row, measured in the same
run) and with every tree configuration, and reports tokens/s, the speed-up over
plain decoding, the mean acceptance length and target passes per generated token.
Chain speculation (a one-branch tree) is one of the configurations; with
``--hf-assisted`` transformers' assisted generation (batch 1 only, its limit) and
transformers' plain ``generate`` are timed afterwards as another baseline pair
(greedy). Every engine runs through the adapters of ``benchmarks/engines.py``, on
chat-templated token ids, exactly ``--output-len`` tokens per request (EOS ignored).

    python benchmarks/spec_decode.py --batch-sizes 1,2,4,8,16,32 --output-len 48

Writes a markdown table, a JSON file and a PNG plot of speed-up against batch size
per tree kind under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engines import EngineOptions, load_pagedtree, load_transformers, time_batches  # noqa: E402
from pagedtree.loadgen.datasets import CODING_PROMPTS, chat_token_ids  # noqa: E402
from pagedtree.speculative import SpeculativeConfig  # noqa: E402
from pagedtree.speculative.presets import TREE_PRESETS  # noqa: E402

PROMPTS = CODING_PROMPTS

CONFIGS = TREE_PRESETS


@dataclass
class Row:
    """One configuration at one batch size."""

    config: str
    batch_size: int
    output_tokens: int
    seconds: float
    plain_tokens_per_s: float
    mean_acceptance_length: float
    target_passes_per_token: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.plain_tokens_per_s


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft-model", default=["qwen2.5-coder-0.5b-instruct"], nargs="+")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--hf-assisted", action="store_true", help="also time transformers' assisted generation (batch 1)")
    parser.add_argument("--out-dir", default="benchmarks/out")
    parser.add_argument("--tag", default="spec_decode", help="file name stem of the outputs")
    return parser.parse_args()


def hf_assisted(args, prompts: list[list[int]]) -> list[dict]:
    """transformers generate alone and with the draft as assistant, batch 1, greedy."""
    from pagedtree.loading.loader import resolve_model_path

    target = str(resolve_model_path(args.model))
    draft = str(resolve_model_path(args.draft_model[0]))
    max_len = max(len(p) for p in prompts) + args.output_len
    results = {}
    for name, drafts in (("transformers", None), ("transformers-assisted", [draft])):
        _, run = load_transformers(EngineOptions(target, label=name, draft_model=drafts, dtype="float32"), 1, max_len)
        run(prompts[:1], 0.0, min(4, args.output_len))  # warm-up
        tokens, seconds, _ = time_batches(run, [[p] for p in prompts], 0.0, args.output_len)
        results[name] = tokens / seconds
        del run
        gc.collect()
    return [{"engine": k, "batch_size": 1, "tokens_per_s": v, "speedup": v / results["transformers"]} for k, v in results.items()]


def write_outputs(args, rows: list[Row], hf_rows: list[dict], machine: str) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"machine: {machine}",
        f"target {args.model}, draft {', '.join(args.draft_model)}, output {args.output_len} tokens, "
        f"temperature {args.temperature}",
        "",
        "| config | batch | tokens/s | plain tokens/s | speed-up | mean acceptance length | target passes/token |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.config} | {r.batch_size} | {r.tokens_per_s:.2f} | {r.plain_tokens_per_s:.2f} | "
            f"{r.speedup:.2f}x | {r.mean_acceptance_length:.2f} | {r.target_passes_per_token:.3f} |"
        )
    for h in hf_rows:
        lines.append(f"| {h['engine']} | 1 | {h['tokens_per_s']:.2f} | | {h['speedup']:.2f}x vs transformers | | |")
    table = "\n".join(lines)
    print(table)
    (out / f"{args.tag}.md").write_text(table + "\n")
    (out / f"{args.tag}.json").write_text(json.dumps(
        {"machine": machine, "args": vars(args), "rows": [asdict(r) | {"speedup": r.speedup} for r in rows], "hf": hf_rows},
        indent=2,
    ))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in dict.fromkeys(r.config for r in rows):
        pts = [(r.batch_size, r.speedup) for r in rows if r.config == config]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speed-up over plain decoding (same run)")
    ax.set_title(f"tree speculation: {args.model} + {args.draft_model[0]}\n{machine}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{args.tag}.png", dpi=120)
    print(f"plot: {out / f'{args.tag}.png'}")


def main() -> None:
    args = parse_args()
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs = {n: SpeculativeConfig(**CONFIGS[n]) for n in names}
    biggest = max(configs.values(), key=lambda c: c.max_nodes)
    # The engine's defaults otherwise (prefix caching on); the suffix drafter's global
    # tree is cleared before every timing (engines.clear_suffix_cache).
    options = EngineOptions(args.model, label="pagedtree", draft_model=args.draft_model, spec=biggest,
                            prefix_caching=True)
    _, run = load_pagedtree(options, max(batch_sizes), 2048)
    llm = run.llm
    chats = [chat_token_ids(llm.get_tokenizer(), [("user", p)]) for p in PROMPTS]
    run(chats[:2], 0.0, 4)  # warm-up
    machine = f"{platform.machine()} {platform.processor() or ''} CPU x{__import__('os').cpu_count()}".strip()
    try:
        import torch

        if torch.cuda.is_available():
            machine = torch.cuda.get_device_name()
    except ImportError:
        pass
    rows: list[Row] = []
    bar = tqdm(total=len(batch_sizes) * (len(names) + 1), desc="runs")
    for batch in batch_sizes:
        prompts = (chats * (batch // len(chats) + 1))[:batch]
        llm.engine.set_speculation(False)
        tokens, seconds, _ = time_batches(run, [prompts], args.temperature, args.output_len)
        plain = tokens / seconds
        bar.update(1)
        llm.engine.set_speculation(True)
        for name, cfg in configs.items():
            llm.engine.speculation.reconfigure(cfg)
            tokens, seconds, delta = time_batches(run, [prompts], args.temperature, args.output_len)
            drafts = delta.get("num_drafts", 0)
            rows.append(Row(
                config=name, batch_size=batch, output_tokens=tokens, seconds=seconds, plain_tokens_per_s=plain,
                mean_acceptance_length=1 + delta["num_accepted_tokens"] / drafts if drafts else 0.0,
                target_passes_per_token=delta["num_target_forward_passes"] / tokens,
            ))
            bar.update(1)
            bar.write(f"batch {batch} {name}: {rows[-1].tokens_per_s:.2f} tok/s ({rows[-1].speedup:.2f}x), "
                      f"acceptance {rows[-1].mean_acceptance_length:.2f}")
    bar.close()
    hf_rows = []
    if args.hf_assisted:
        del llm, run
        gc.collect()
        hf_rows = hf_assisted(args, chats[:2])
    write_outputs(args, rows, hf_rows, machine)


if __name__ == "__main__":
    main()
