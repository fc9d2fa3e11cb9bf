"""Offloaded decoding: plain, with token trees, and resident, in one run.

A target larger than its GPU streams its decoder layers from pinned host memory
every pass (``offload_weights_gb``); a pass then costs about the same whatever it
verifies, which is where token trees pay most (SpecInfer's offloading mode). Random
weights in real shapes (no weights travel to a GPU machine): a Llama-3-8B-shaped bf16
target forced into offload (every layer streamed), the Qwen2.5-0.5B-shaped draft
(with the 8B's vocabulary) resident. Per section:

- bandwidth: the machine's pinned host-to-device copy bandwidth (1 GiB, best of 5):
  the figure the streamed layers are held to;
- resident: the 8B shape decoding plainly, nothing streamed, batch 1 and 16;
- offloaded: the same target with every layer streamed, plain decoding at batch 1
  and 16: ms a target pass, and the host-to-device bandwidth the pass reaches (the
  streamed bytes over the pass's time: a lower bound on the copies' own rate);
- trees: the offloaded target verifying 64-node dynamic trees drafted by the
  resident 0.5B shape, every step, at batch 1 and 16: ms a step against the plain
  offloaded step, and the speed-up that cost gives at the mean acceptance length
  measured on CPU with the real Qwen2.5-Coder 1.5B/0.5B pair (``--acceptance``;
  random weights accept what they accept, so their own acceptance is shown but not
  used). The method: speed-up = acceptance length x plain step / tree step;
- peer: transformers with accelerate's ``cpu_offload`` (the layers' weights moved
  to the GPU for each forward), plain ``generate`` at batch 1, when accelerate is
  installed (vLLM's ``--cpu-offload-gb`` where vLLM is: neither is on the lent GPU
  image, and the row says so).

One table, as text and markdown, and JSON. Under 5 minutes on an H100.

    python benchmarks/offload_bench.py                        # on a GPU: every section
    python benchmarks/offload_bench.py --sections bandwidth,offloaded --json out.json
    python benchmarks/offload_bench.py --device cpu --tiny    # a dry run on CPU (tiny shapes)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_bench import (  # noqa: E402
    LLAMA_8B,
    QWEN_0_5B,
    TINY,
    TINY_DRAFT,
    Figure,
    bench_device,
    bench_parser,
    generate_seconds,
    chosen_sections,
    free,
    report,
    run_sections,
    weight_bytes,
    write_config,
)

SECTIONS = ("bandwidth", "resident", "offloaded", "trees", "peer")
# Mean acceptance length (tokens a step, the target's own included) of 64-node dynamic
# trees (top-k 8, depth 8) with the real Qwen2.5-Coder 1.5B/0.5B pair on a coding
# prompt, greedy, batch 1, measured on CPU with `benchmarks/spec_decode.py --configs
# chain-4,dynamic-64 --batch-sizes 1 --output-len 64` (chain-4: 4.85 in the same run;
# benchmarks/results/offload/offload_acceptance.md).
CPU_ACCEPTANCE = 7.88
DRAFT_8B_VOCAB = dict(QWEN_0_5B, vocab_size=LLAMA_8B["vocab_size"], bos_token_id=LLAMA_8B["bos_token_id"],
                      eos_token_id=LLAMA_8B["eos_token_id"], max_position_embeddings=LLAMA_8B["max_position_embeddings"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, SECTIONS)
    parser.add_argument("--acceptance", type=float, default=CPU_ACCEPTANCE,
                        help="mean acceptance length of the 64-node trees measured on CPU with the real pair "
                             "(default %(default)s)")
    parser.add_argument("--plot", default=None, help="write a bar chart of the step times here (PNG)")
    args = parser.parse_args(argv)
    args.chosen = chosen_sections(parser, args, SECTIONS)
    if not args.acceptance >= 1:
        parser.error("--acceptance is tokens a step, at least 1")
    return args


class Bench:
    """Engines of the 8B shape on one device, and their step times."""

    def __init__(self, args: argparse.Namespace, device: str, folder: Path):
        self.tiny = args.tiny
        self.device = device
        self.target_config = TINY if self.tiny else LLAMA_8B
        self.target = write_config(folder / "target", self.target_config)
        self.draft = write_config(folder / "draft", TINY_DRAFT if self.tiny else DRAFT_8B_VOCAB)
        self.vocab = self.target_config["vocab_size"]
        self.label = "tiny shape" if self.tiny else "8B shape"
        self.prompt_len = 8 if self.tiny else 64
        # Offloaded passes take hundreds of ms: a few steps time them well.
        self.lengths = (2, 4) if self.tiny else (2, 10)
        self._seed = 0

    def llm(self, max_num_seqs: int, **kwargs):
        from pagedtree import LLM

        extra = dict(attention_backend="triton") if self.device == "cpu" else {}
        return LLM(self.target, load_format="dummy", dtype="bfloat16", device=self.device, max_num_seqs=max_num_seqs,
                   max_model_len=self.prompt_len + self.lengths[1] + 80, enable_prefix_caching=False,
                   gpu_memory_utilization=0.85, **extra, **kwargs)

    def step(self, llm, batch: int) -> dict:
        """Seconds a step takes at ``batch``: two generations of different lengths, the
        difference over the extra target passes."""
        import torch

        from pagedtree import SamplingParams

        runs = {}
        for length in self.lengths:
            self._seed += 1
            gen = torch.Generator().manual_seed(self._seed)
            prompts = [{"prompt_token_ids": torch.randint(10, self.vocab - 10, (self.prompt_len,),
                                                          generator=gen).tolist()} for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            before = llm.stats()
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            after = llm.stats()
            runs[length] = (seconds, after["num_target_forward_passes"] - before["num_target_forward_passes"],
                            after["num_generated_tokens"] - before["num_generated_tokens"])
        (s0, p0, t0), (s1, p1, t1) = runs[self.lengths[0]], runs[self.lengths[1]]
        passes = max(1, p1 - p0)
        return dict(step_seconds=(s1 - s0) / passes, tokens_per_step=(t1 - t0) / passes,
                    tokens_per_second=(t1 - t0) / max(s1 - s0, 1e-9))


def pinned_bandwidth(device: str, tiny: bool) -> float:
    """Bytes/s of a pinned host-to-device copy (best of 5); on a CPU, a host copy."""
    import torch

    size = (64 << 20) if tiny else (1 << 30)
    cuda = device == "cuda"
    host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    target = torch.empty(size, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return size / best


def section_bandwidth(bench: Bench, state: dict) -> list[Figure]:
    bandwidth = pinned_bandwidth(bench.device, bench.tiny)
    state["pinned"] = bandwidth
    return [Figure("bandwidth", "pinned host-to-device copy, 1 GiB" if not bench.tiny else "host copy, 64 MiB",
                   f"{bandwidth / 1e9:.1f} GB/s", "best of 5", dict(bytes_per_second=bandwidth))]


def section_resident(bench: Bench, state: dict) -> list[Figure]:
    figures = []
    llm = bench.llm(max_num_seqs=16, offload_weights_gb=0)
    for batch in (1,) if bench.tiny else (1, 16):
        t = bench.step(llm, batch)
        state[("resident", batch)] = t["step_seconds"]
        figures.append(Figure("resident", f"{bench.label}, batch {batch}", f"{t['step_seconds'] * 1e3:.2f} ms a step",
                              f"{t['tokens_per_second']:.0f} tokens/s", t))
    free(llm)
    return figures


def section_offloaded(bench: Bench, state: dict) -> list[Figure]:
    figures = []
    llm = bench.llm(max_num_seqs=16, offload_weights_gb="all")
    streamer = llm.engine.runner.model.layer_streamer
    streamed = streamer.bytes_per_pass
    for batch in (1,) if bench.tiny else (1, 16):
        t = bench.step(llm, batch)
        state[("offloaded", batch)] = t["step_seconds"]
        reached = streamed / t["step_seconds"]
        pinned = state.get("pinned")
        versus = f"{reached / 1e9:.1f} GB/s streamed" + (f" = {reached / pinned:.0%} of the pinned copy's"
                                                          if pinned else "")
        resident = state.get(("resident", batch))
        if resident:
            versus += f"; {t['step_seconds'] / resident:.1f}x a resident step"
        figures.append(Figure("offloaded", f"every layer streamed, batch {batch}",
                              f"{t['step_seconds'] * 1e3:.1f} ms a pass", versus,
                              t | dict(streamed_bytes=streamed, reached_bytes_per_second=reached)))
    free(llm)
    return figures


def section_trees(bench: Bench, state: dict, acceptance: float) -> list[Figure]:
    figures = []
    from pagedtree.speculative.presets import tree_preset  # after the device choice (the interpreter's flag)

    # The offloaded default's 64-node trees at their full size every step.
    llm = bench.llm(max_num_seqs=16, offload_weights_gb="all", draft_model=bench.draft,
                    speculative=tree_preset("dynamic-64"))
    for batch in (1,) if bench.tiny else (1, 16):
        t = bench.step(llm, batch)
        plain = state.get(("offloaded", batch))
        if plain:
            ratio = t["step_seconds"] / plain
            versus = (f"{ratio:.2f}x a plain offloaded step; {acceptance / ratio:.2f}x plain offloaded at the CPU's "
                      f"acceptance {acceptance}")
        else:
            ratio, versus = float("nan"), "(run the offloaded section for the ratio)"
        figures.append(Figure("trees", f"64-node dynamic trees, batch {batch}",
                              f"{t['step_seconds'] * 1e3:.1f} ms a step",
                              versus + f" (random weights: {t['tokens_per_step']:.2f} tokens a step)",
                              t | dict(vs_plain=ratio, acceptance=acceptance)))
    free(llm)
    return figures


def section_peer(bench: Bench, state: dict) -> list[Figure]:
    import torch

    try:
        from accelerate import cpu_offload, init_empty_weights
    except ImportError:
        return [Figure("peer", "transformers + accelerate cpu_offload", "not run",
                       "accelerate is not installed here (nor vLLM)")]
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if bench.device == "cuda" else "cpu"
    config = AutoConfig.from_pretrained(bench.target)
    with init_empty_weights():  # storage without initialising 8B weights (only the time is read)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    cpu_offload(model, execution_device=torch.device(device))
    ids = torch.randint(10, bench.vocab - 10, (1, bench.prompt_len), device=device)
    generate_seconds(model, ids, 2, device)  # warm-up
    times = {length: generate_seconds(model, ids, length, device) for length in bench.lengths}
    step = (times[bench.lengths[1]] - times[bench.lengths[0]]) / (bench.lengths[1] - bench.lengths[0])
    plain = state.get(("offloaded", 1))
    del model
    return [Figure("peer", "transformers + accelerate cpu_offload, batch 1", f"{step * 1e3:.1f} ms a step",
                   f"{step / plain:.2f}x pagedtree's offloaded step" if plain else "", dict(step_seconds=step))]


def plot(figures: list[Figure], path: str, title: str) -> None:
    """Bars of ms a step per configuration and batch (resident, offloaded, trees), and
    the trees' speed-up at the CPU's acceptance above theirs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [f for f in figures if f.section in ("resident", "offloaded", "trees") and "step_seconds" in f.detail]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{f.section}\n{f.case.rsplit(', ', 1)[-1]}" for f in rows]
    bars = ax.bar(labels, [f.detail["step_seconds"] * 1e3 for f in rows],
                  color=[{"resident": "tab:gray", "offloaded": "tab:blue", "trees": "tab:green"}[f.section]
                         for f in rows])
    for bar, f in zip(bars, rows):
        if f.section == "trees" and f.detail.get("vs_plain", 0) > 0:
            speedup = f.detail["acceptance"] / f.detail["vs_plain"]
            ax.annotate(f"{speedup:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom")
    ax.set(ylabel="ms a step (a tree step verifies up to 64 nodes a request)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = bench_device(args.device, args.tiny)
    if device is None:
        return 2
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (host memory standing in for the device)"
    state: dict = {}
    with tempfile.TemporaryDirectory(prefix="pagedtree-offload-bench-") as folder:
        bench = Bench(args, device, Path(folder))
        runs = {"bandwidth": section_bandwidth, "resident": section_resident, "offloaded": section_offloaded,
                "trees": lambda b, st: section_trees(b, st, args.acceptance), "peer": section_peer}
        figures, seconds = run_sections(args.chosen, lambda section: runs[section](bench, state), "offload bench",
                                        args.no_progress)
    shape = "tiny shapes" if args.tiny else f"Llama-3-8B shape ({weight_bytes(LLAMA_8B) / 2**30:.1f} GiB bf16)"
    header = (f"pagedtree offload bench on {name}; torch {torch.__version__}; {shape}, random weights, prompts of "
              f"{bench.prompt_len} tokens, steps timed over {bench.lengths[1] - bench.lengths[0]} extra tokens")
    status = report(figures, header, seconds, args.markdown, args.json)
    if args.plot:
        plot(figures, args.plot, f"Offloaded decoding on {name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
