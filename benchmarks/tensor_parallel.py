"""Tensor parallelism: memory per rank, and where a step's time goes, for 1 and N ranks.

For each tensor-parallel size and batch size it starts an engine, prefills a batch
of prompts, then times decode steps (``LLMEngine.step``, each one forward of the
whole batch) and reads every rank's counters before and after
(``TensorParallelGroupHandle.report``). A step's time splits into

- ``collectives``: rank 0's host time inside all-reduces and the logit gather (on
  CPU they block; this includes waiting for the slower rank);
- ``compute + host``: the rest (the rank's shard of the forward, sampling,
  scheduling, sending the step to the other ranks).

It also reports the weights and KV-cache bytes each rank holds and the all-reduce
bytes per step, then prices the same schedule on paper for GPUs (``--paper``):
a decode or verify step of a Llama-3-8B / 70B-shaped model on 1-8 H100s, from the
measured collective counts per step and stated bandwidths and latencies.

    python benchmarks/tensor_parallel.py                       # SmolLM2-135M, N = 1, 2; batch 1, 8
    python benchmarks/tensor_parallel.py --model qwen2.5-coder-0.5b-instruct --batches 1 4
    python benchmarks/tensor_parallel.py --paper-only           # the GPU estimate alone

Run it on a quiet machine: two ranks on two cores share them with nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Measured:
    """One (ranks, batch) cell."""

    ranks: int
    batch: int
    step_ms: float
    collective_ms: float  # rank 0's time in collectives per step
    collective_ms_other: float  # the slowest other rank's
    all_reduces_per_step: float
    all_reduce_kib_per_step: float
    gather_kib_per_step: float
    weights_mib: list[float]  # per rank
    kv_cache_mib: list[float]  # per rank
    kv_blocks: int


def measure(model: str, ranks: int, batches: list[int], steps: int, dtype: str) -> list[Measured]:
    """Time ``steps`` decode steps per batch size on an engine of ``ranks`` ranks."""
    from tqdm.auto import tqdm

    from pagedtree import LLM, SamplingParams
    from pagedtree.loadgen.datasets import CODING_PROMPTS as BENCH_PROMPTS

    llm = LLM(model, dtype=dtype, tensor_parallel_size=ranks, max_model_len=1024, kv_cache_memory=256 * 2**20)
    engine = llm.engine
    out: list[Measured] = []
    try:
        params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        llm.generate(BENCH_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
        for batch in tqdm(batches, desc=f"{ranks} rank(s)", unit="batch"):
            ids = [engine.add_request(None, BENCH_PROMPTS[i % len(BENCH_PROMPTS)], params) for i in range(batch)]
            while engine.scheduler.waiting or any(
                not engine.requests.parents[i].children[0].output_token_ids for i in ids
            ):
                engine.step()  # prefill
            before = report(engine, ranks)
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            seconds = time.perf_counter() - started
            after = report(engine, ranks)
            for request_id in ids:
                engine.abort_request(request_id)
            out.append(cell(ranks, batch, steps, seconds, before, after))
    finally:
        llm.shutdown()
    return out


def report(engine, ranks: int) -> list[dict]:
    """Every rank's counters (one rank: its runner's memory, no collectives)."""
    if ranks > 1:
        return engine.tensor_parallel.report()
    memory = engine.runner.memory_bytes()
    return [{"rank": 0, "models": [{"weight_bytes": memory["weights"], "kv_cache_bytes": memory["kv_cache"],
                                    "kv_blocks": engine.runner.num_blocks}],
             "all_reduces": 0, "all_reduce_bytes": 0, "gathers": 0, "gather_bytes": 0, "collective_us": 0}]


def cell(ranks: int, batch: int, steps: int, seconds: float, before: list[dict], after: list[dict]) -> Measured:
    def delta(rank: int, key: str) -> float:
        return (after[rank][key] - before[rank][key]) / steps

    mib = 2**20
    return Measured(
        ranks=ranks, batch=batch, step_ms=1000 * seconds / steps,
        collective_ms=delta(0, "collective_us") / 1000,
        collective_ms_other=max((delta(r, "collective_us") / 1000 for r in range(1, ranks)), default=0.0),
        all_reduces_per_step=delta(0, "all_reduces"),
        all_reduce_kib_per_step=delta(0, "all_reduce_bytes") / 1024,
        gather_kib_per_step=delta(0, "gather_bytes") / 1024,
        weights_mib=[r["models"][0]["weight_bytes"] / mib for r in after],
        kv_cache_mib=[r["models"][0]["kv_cache_bytes"] / mib for r in after],
        kv_blocks=after[0]["models"][0]["kv_blocks"],
    )


def measure_in_child(args: argparse.Namespace, ranks: int) -> list[Measured]:
    """``measure`` in a fresh process: each size starts from an untouched process, as
    a server would (thread pools are chosen once per process). One rank runs with
    OpenMP's default (spinning idle threads: fastest alone); several ranks start
    with ``OMP_WAIT_POLICY=PASSIVE``, as docs/tensor_parallel.md advises for ranks sharing cores."""
    import os
    import subprocess
    import tempfile

    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if ranks > 1 and not args.no_passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        command = [sys.executable, __file__, "--model", args.model, "--sizes", str(ranks), "--steps", str(args.steps),
                   "--dtype", args.dtype, "--cells-json", f.name, "--batches", *map(str, args.batches)]
        subprocess.run(command, check=True, env=env)
        return [Measured(**c) for c in json.loads(Path(f.name).read_text())]


# ----------------------------------------------------------------- on paper
@dataclass(frozen=True)
class PaperModel:
    """A Llama-shaped model for the GPU estimate."""

    name: str
    layers: int
    hidden: int
    params_b: float  # billions of parameters (bf16 weights)


@dataclass(frozen=True)
class PaperGpu:
    """Stated figures for one GPU kind and its interconnect (not measured here)."""

    name: str = "H100 SXM (NVLink 4)"
    hbm_gbps: float = 3350.0
    hbm_efficiency: float = 0.75  # share of peak a decode GEMV reaches
    bf16_tflops: float = 989.0  # dense
    mma_efficiency: float = 0.6  # share of peak a many-row GEMM reaches
    allreduce_busbw_gbps: float = 360.0  # NCCL bus bandwidth, large messages
    allreduce_latency_us: dict = None  # small-message latency by ranks

    def latency(self, ranks: int) -> float:
        table = self.allreduce_latency_us or {2: 8.0, 4: 11.0, 8: 15.0}
        return table.get(ranks, 15.0)


PAPER_MODELS = [PaperModel("Llama-3-8B", 32, 4096, 8.0), PaperModel("Llama-3-70B", 80, 8192, 70.6)]


def paper_step_ms(model: PaperModel, gpu: PaperGpu, ranks: int, tokens: int) -> tuple[float, float]:
    """(compute, collectives) ms of one step of ``tokens`` tokens: the slower of reading
    the weights once (memory-bound decode/verify) and their ``2 x params x tokens``
    FLOPs, split over the ranks; two all-reduces per layer plus one for the
    embedding, each ``tokens x hidden`` bf16, at the ring's ``2 (N-1)/N`` traffic,
    plus a small-message latency each. Attention's KV reads are left out (they split
    over the ranks like the weights)."""
    memory = model.params_b * 1e9 * 2 / ranks / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency) * 1e3
    flops = 2 * model.params_b * 1e9 * tokens / ranks / (gpu.bf16_tflops * 1e12 * gpu.mma_efficiency) * 1e3
    compute = max(memory, flops)
    if ranks == 1:
        return compute, 0.0
    count = 2 * model.layers + 1
    size = tokens * model.hidden * 2
    per = gpu.latency(ranks) * 1e-3 + size * 2 * (ranks - 1) / ranks / (gpu.allreduce_busbw_gbps * 1e9) * 1e3
    return compute, count * per


def paper_table(tokens_per_step: list[int]) -> str:
    gpu = PaperGpu()
    lines = [f"On paper, {gpu.name}: HBM {gpu.hbm_gbps:.0f} GB/s at {gpu.hbm_efficiency:.0%}, all-reduce "
             f"{gpu.allreduce_busbw_gbps:.0f} GB/s bus bandwidth + {gpu.latency(2):.0f}/{gpu.latency(4):.0f}/"
             f"{gpu.latency(8):.0f} us latency at 2/4/8 GPUs; bf16 weights; 2 all-reduces per layer + 1 "
             "(the counts measured above), CUDA graphs off under tensor parallelism (launch time not counted).",
             "", "| model | tokens / step | GPUs | compute ms | all-reduce ms | step ms | speed-up vs the fewest GPUs |",
             "|---|---|---|---|---|---|---|"]
    for model in PAPER_MODELS:
        for tokens in tokens_per_step:
            base = None
            for ranks in (1, 2, 4, 8):
                compute, comm = paper_step_ms(model, gpu, ranks, tokens)
                if model.params_b * 2 / ranks > 80 * 0.9:
                    lines.append(f"| {model.name} | {tokens} | {ranks} | does not fit 80 GB | | | |")
                    continue
                step = compute + comm
                base = base or (ranks, step)
                speedup = f"{base[1] / step:.2f}x (vs {base[0]})"
                lines.append(f"| {model.name} | {tokens} | {ranks} | {compute:.2f} | {comm:.2f} | {step:.2f} | {speedup} |")
    return "\n".join(lines)


# ------------------------------------------------------------------- output
def markdown(model: str, dtype: str, cells: list[Measured]) -> str:
    lines = [f"Model {model}, {dtype}, decode steps (greedy), mean of the timed steps. One rank with OpenMP's "
             "defaults, several with OMP_WAIT_POLICY=PASSIVE (unless --no-passive).", "",
             "| ranks | batch | step ms | rank 0 in collectives ms | other rank in collectives ms | "
             "all-reduces / step | all-reduce KiB / step | gather KiB / step |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c.ranks} | {c.batch} | {c.step_ms:.1f} | {c.collective_ms:.1f} | {c.collective_ms_other:.1f} | "
                     f"{c.all_reduces_per_step:.0f} | {c.all_reduce_kib_per_step:.1f} | {c.gather_kib_per_step:.1f} |")
    lines += ["", "| ranks | weights MiB per rank | KV cache MiB per rank (256 MiB budget) | KV blocks |", "|---|---|---|---|"]
    seen = set()
    for c in cells:
        if c.ranks not in seen:
            seen.add(c.ranks)
            lines.append(f"| {c.ranks} | {' / '.join(f'{w:.1f}' for w in c.weights_mib)} | "
                         f"{' / '.join(f'{k:.1f}' for k in c.kv_cache_mib)} | {c.kv_blocks} |")
    return "\n".join(lines)


def plot(cells: list[Measured], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"N={c.ranks}\nB={c.batch}" for c in cells]
    comm = [c.collective_ms for c in cells]
    rest = [c.step_ms - c.collective_ms for c in cells]
    fig, ax = plt.subplots(figsize=(1.2 * len(cells) + 2, 3.5))
    ax.bar(labels, rest, label="compute + host")
    ax.bar(labels, comm, bottom=rest, label="collectives (rank 0)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("Tensor parallelism on a 2-core CPU: where a step goes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="packaged name or folder")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per cell")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-passive", action="store_true",
                        help="start the multi-rank runs without OMP_WAIT_POLICY=PASSIVE (rank 0 then uses "
                             "numba's workqueue pool)")
    parser.add_argument("--paper-only", action="store_true", help="print the on-paper GPU estimate only")
    parser.add_argument("--out", default=str(RESULTS / "cpu_tensor_parallel"), help="output path stem (.md/.json/.png)")
    parser.add_argument("--cells-json", default=None, help=argparse.SUPPRESS)  # one size, in a child process
    args = parser.parse_args(argv)
    paper = paper_table([1, 64, 512])
    if args.paper_only:
        print(paper)
        return 0
    if args.cells_json:
        cells = measure(args.model, args.sizes[0], args.batches, args.steps, args.dtype)
        Path(args.cells_json).write_text(json.dumps([asdict(c) for c in cells]))
        return 0
    cells = [c for ranks in args.sizes for c in measure_in_child(args, ranks)]
    text = markdown(args.model, args.dtype, cells) + "\n\n" + paper + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps([asdict(c) for c in cells], indent=1))
    plot(cells, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
