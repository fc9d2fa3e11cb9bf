"""Host time to build a static (CUDA-graph-shaped) step's attention plan.

A graph replays its launches on fixed buffers, so every padded decode step must
put its block tables where the graph reads them. This times ``build_kernel_plan``
with a ``StaticShape`` per decode step (median over the steps after a warm-up) for
batch sizes and ``max_model_len`` values, with every request's table growing by a
block now and then, as decoding does. It runs on the CPU (the host work is the
same with a GPU: building and uploading the tables' changes).

    python benchmarks/static_plan.py
    python benchmarks/static_plan.py --max-model-lens 8192,131072 --batches 32,128
"""

from __future__ import annotations

import argparse
import inspect
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pagedtree.kernels.attention_plan import PlanBuffers, build_kernel_plan
from pagedtree.step_data import StaticShape  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402


def plan_ms(max_len: int, batch: int, context: int, block_size: int = 16, steps: int = 40) -> float:
    """Median milliseconds of one static decode step's plan, ``batch`` requests of
    ``context`` tokens, tables as wide as ``max_len`` allows."""
    width = -(-(max_len + 1) // block_size)
    num_blocks = batch * width + 1
    rng = random.Random(0)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-context // block_size))] for _ in range(batch)]
    ctx = [context] * batch
    buffers = PlanBuffers(torch.device("cpu"))
    shape = StaticShape(batch, width, 1)
    extra = {}
    if "row_keys" in inspect.signature(build_kernel_plan).parameters:  # builds that track rows by request
        extra["row_keys"] = [f"r{i}" for i in range(batch)]
    times = []
    for _ in range(steps):
        for i in range(batch):
            ctx[i] += 1
            if ctx[i] > len(tables[i]) * block_size:
                tables[i].append(free.pop())
        meta = AttentionMetadata(block_size=block_size, slot_mapping=torch.zeros(batch, dtype=torch.long),
                                 query_start_loc=list(range(batch + 1)), context_lens=list(ctx),
                                 block_tables=[list(t) for t in tables], tree_parents=[None] * batch,
                                 slot_bounds=(0, 0))
        started = time.perf_counter()
        build_kernel_plan(meta, num_blocks, buffers, shape, **extra)
        times.append(time.perf_counter() - started)
    times = sorted(times[5:])
    return times[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-model-lens", default="8192,131072")
    parser.add_argument("--batches", default="32,128")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    print("| max_model_len | batch | context | plan ms/step |\n|---|---|---|---|")
    for max_len in ints(args.max_model_lens):
        for batch in ints(args.batches):
            for context in (1024, max_len - 64):
                ms = plan_ms(max_len, batch, context, steps=args.steps)
                print(f"| {max_len} | {batch} | {context} | {ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
