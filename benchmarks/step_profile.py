"""Where a decode step's time goes: the model forward against everything around it.

Times each part of ``LLMEngine.step`` (scheduling, batch tensors, the attention plan,
the model forward, the LM head, sampling, output processing, the scheduler's update)
over a whole generation and prints each as a share of the steps' time.

    python benchmarks/step_profile.py --model smollm2-135m-instruct --batch 8 --dtype float32
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
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args(argv)

    import pagedtree.worker.model_runner as model_runner
    from pagedtree import LLM, SamplingParams
    from pagedtree.bench.datasets import CODING_PROMPTS

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
    timed(engine.runner, "_metadata", "batch tensors")
    timed(engine.runner.attention, "begin_step", "attention plan")
    timed(engine.runner.model, "forward", "model forward")
    timed(engine.runner, "logits", "LM head")
    timed(model_runner, "sample", "sampling")
    timed(engine, "_postprocess", "output processing (tokens, detokenizer, stops)")
    timed(engine.scheduler, "update", "scheduler update")

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
