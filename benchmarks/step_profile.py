"""Where a decode step's time goes: the model forward against everything around it.

Times each part of ``LLMEngine.step`` (scheduling, batch tensors, the attention plan,
the model forward, the LM head, sampling, output processing, the scheduler's update)
over a whole generation and prints each as a share of the steps' time. ``--layers``
also times every kind of linear layer at one row (summed over the layers, run one
after another as a forward does) with the bytes it holds, which tells how close a
weight format comes to the machine's memory bandwidth.

    python benchmarks/step_profile.py --model smollm2-135m-instruct --batch 8 --dtype float32
    python benchmarks/step_profile.py --model qwen2.5-coder-1.5b-instruct --batch 1 --quantization q4 --layers
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "q4", "q8", "ggml", "none"],
                        help="default: the model's own (a GGUF file: q4 on CPU)")
    parser.add_argument("--layers", action="store_true", help="also time each kind of linear layer at one row")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)

    import pagedtree.worker.model_runner as model_runner
    from pagedtree import LLM, SamplingParams
    from pagedtree.loadgen.datasets import CODING_PROMPTS

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=1024,
              enable_prefix_caching=False, kv_cache_memory=2**28)
    engine = llm.engine
    spent: dict[str, float] = defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += time.perf_counter() - started

        setattr(owner, name, wrapper)

    timed(engine, "step", "whole step")
    timed(engine.scheduler, "schedule", "schedule")
    timed(model_runner, "host_step", "batch tensors")
    timed(model_runner, "upload_step", "batch tensors")
    timed(engine.runner.attention, "begin_step", "attention plan")
    timed(engine.runner.model, "forward", "model forward")
    timed(engine.runner.model, "compute_logits", "LM head")
    timed(model_runner, "sample_rows", "sampling")
    timed(engine, "update", "update (tokens, detokenizer, stops, KV bookkeeping)")

    prompts = (CODING_PROMPTS * (args.batch // len(CODING_PROMPTS) + 1))[: args.batch]
    llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    spent.clear()
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - started
    steps = spent.pop("whole step")
    print(f"{args.model} {args.quantization or args.dtype}, batch {args.batch}: "
          f"{args.batch * args.output_len / seconds:.1f} tokens/s")
    print("| part | seconds | share of the steps |\n|---|---:|---:|")
    for label, value in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {value:.3f} | {100 * value / steps:.1f}% |")
    outside = sum(v for k, v in spent.items() if k not in ("model forward", "LM head"))
    print(f"| everything but the forward and the LM head | {outside:.3f} | {100 * outside / steps:.1f}% |")
    if args.layers:
        print_layer_table(engine.runner.model)
    return 0


def print_layer_table(model) -> None:
    """Each kind of linear layer at one row: ms summed over the model's layers of that
    kind (each called in turn, as a forward streams them), MiB held, GB/s."""
    import torch

    from pagedtree.worker.models.linear import Linear

    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])  # count, seconds, bytes
    layers = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(1, m.in_features) for _, m in layers}
    with torch.inference_mode():
        for _ in range(2):  # the first pass warms up; the second is timed
            for kind in kinds:
                kinds[kind][1] = 0.0
            for kind, layer in layers:
                started = time.perf_counter()
                layer(inputs[layer.in_features])
                kinds[kind][1] += time.perf_counter() - started
    for kind, layer in layers:
        kinds[kind][0] += 1
        kinds[kind][2] += layer.weight_bytes
    print("\n| linear layers (one row) | count | ms | MiB | GB/s |\n|---|---:|---:|---:|---:|")
    for kind, (count, seconds, nbytes) in kinds.items():
        print(f"| {kind} | {count} | {seconds * 1e3:.2f} | {nbytes / 2**20:.1f} | {nbytes / seconds / 1e9:.1f} |")
    seconds, nbytes = sum(k[1] for k in kinds.values()), sum(k[2] for k in kinds.values())
    print(f"| all | {sum(k[0] for k in kinds.values())} | {seconds * 1e3:.2f} | {nbytes / 2**20:.1f} | "
          f"{nbytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
