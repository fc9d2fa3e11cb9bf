"""The GPU benchmark: plain decoding, speculative step costs and peers, in one run.

Random weights in real shapes (no weights travel to a GPU machine): the
Qwen2.5-Coder-1.5B target and its 0.5B draft, and a Llama-3-8B, loaded with
``load_format="dummy"`` from config-only folders made here. Per section:

- plain: decode tokens/s and ms a step at batch 1, 16 and 64 (a step's time from
  two generations of different lengths: the difference over the extra steps, so
  prefill and start-up cancel out), with each step launched ahead of the previous
  one's readback (async scheduling) against the same engine one step at a time,
  and the 0.5B draft's own decode step (one draft level at batch 1);
- overlap: plain decoding at batch 1, 16 and 64, the 0.5B draft's step and a
  chain-4 step at batch 1, with launches one after another and overlapping
  (programmatic dependent launch, sm_90 and later; ``PAGEDTREE_PDL=1``), an engine
  each, graphs captured under the setting; skipped on older GPUs;
- speculation: a forced chain of 4 and the 16-node static tree at batch 1 and 16,
  each also drafted level by level in the same engine (what whole drafts save)
  and, where the draft has graphs, with a graph per level instead of the whole
  draft's two (the first level, then the rest: what the whole-draft graphs save):
  ms a step (time over target passes), against the plain step of the same batch,
  and the speed-up those costs give at the mean acceptance lengths measured on
  CPU with the real Qwen pair (``--acceptance``; random weights accept what they
  accept, so their own acceptance is reported but not used);
- tiles: plain decoding at batch 1, 16 and 64 under three rules for the attention
  kernel's key tiles on sm_90, an engine each (its graphs captured under the rule):
  the launch code's own (the widest key tiles that do not spill, in launches of up
  to half a wave of programs), those tiles in every launch, and 16-key tiles
  everywhere; each row with its graph's replay and the rest of the step (the rules
  differ on sm_90 only; elsewhere the section says so and is skipped);
- suffix: the model-free suffix drafter (16 nodes, fixed) at batch 1, its step cost;
- flashinfer: plain decoding at batch 1, 16 and 64 with FlashInfer's kernels
  attending (``attention_backend="flashinfer"``), against the Triton kernels in the
  same run, both eager (FlashInfer's steps are not captured); skipped where
  FlashInfer does not import;
- llama8b: plain decoding of the 8B shape at batch 1 and 16;
- transformers: ``generate`` of the same 1.5B shape (bf16, random weights) at batch
  1 and 16 in the same run, after a warm-up.

The weight-stream floor (the weights' bytes over the GPU's memory bandwidth) is
printed beside each plain figure. One table, as text and markdown, and JSON.

    python benchmarks/gpu_bench.py                         # on a GPU: every section (< 5 minutes)
    python benchmarks/gpu_bench.py --sections plain,speculation --json out.json
    python benchmarks/gpu_bench.py --device cpu --tiny     # a dry run on CPU (tiny shapes, interpreter)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# In the order they run: what a time-bounded run most needs first.
SECTIONS = ("plain", "overlap", "speculation", "tiles", "suffix", "flashinfer", "llama8b", "transformers")
# Mean acceptance lengths (tokens a step, the target's own included) of the real
# Qwen2.5-Coder 1.5B/0.5B pair on coding prompts, greedy, batch 1, bf16, measured on
# CPU with `benchmarks/spec_decode.py --configs chain-4,static-16 --batch-sizes 1
# --output-len 64` (benchmarks/RESULTS.md, "The batch-invariant kernels on an H100").
CPU_ACCEPTANCE = {"chain-4": 4.85, "static-16": 5.17}
# HBM bandwidth of the GPUs the floors are quoted for (bytes/s), by name fragment.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}

QWEN_1_5B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                 num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151_936,
                 max_position_embeddings=32_768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, hidden_act="silu", bos_token_id=151_643, eos_token_id=151_645)
QWEN_0_5B = dict(QWEN_1_5B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14_336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128_256,
                max_position_embeddings=8192, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                hidden_act="silu", bos_token_id=128_000, eos_token_id=128_001)
TINY = dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
TINY_DRAFT = dict(TINY, num_hidden_layers=1)
TINY_FLASHINFER = dict(TINY, hidden_size=256)  # head dim 64, FlashInfer's smallest
TINY_BATCHES = (1,)  # the dry run's batches: every code path, at one batch size


@dataclass(slots=True)
class Figure:
    """One line of the table."""

    section: str
    case: str
    value: str
    versus: str = ""
    detail: dict = field(default_factory=dict)


def bench_parser(doc: str, sections: tuple[str, ...]) -> argparse.ArgumentParser:
    """A GPU benchmark's parser with the options they share (``--device``, ``--tiny``,
    ``--sections``, ``--json``, ``--markdown``, ``--no-progress``); ``doc`` is the
    script's docstring (its first paragraph the description, the rest the epilog)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="\n\n".join(doc.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU dry run)")
    parser.add_argument("--sections", default=",".join(sections), help=f"comma-separated subset of {sections}")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--markdown", default=None, help="write the table here as markdown")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def chosen_sections(parser: argparse.ArgumentParser, args: argparse.Namespace, sections: tuple[str, ...]) -> list[str]:
    """``--sections`` in the script's order (a parser error names unknown ones)."""
    asked = args.sections.split(",")
    unknown = [s for s in asked if s not in sections]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(sections)}")
    return [s for s in sections if s in asked]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, SECTIONS)
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; tiny 8)")
    parser.add_argument("--output-len", type=int, default=None, help="tokens a long run generates (default 64; "
                                                                       "tiny 6)")
    parser.add_argument("--acceptance", default=",".join(f"{k}={v}" for k, v in CPU_ACCEPTANCE.items()),
                        help="mean acceptance lengths measured on CPU with the real pair, name=value,...")
    parser.add_argument("--profile", action="store_true", help="also print where the host's time goes in batch-1 "
                                                                   "decode steps (cProfile) and torch.profiler's "
                                                                   "tables of host and GPU time")
    args = parser.parse_args(argv)
    args.chosen = chosen_sections(parser, args, SECTIONS)
    try:
        args.acceptance_lengths = {k: float(v) for k, v in (item.split("=") for item in args.acceptance.split(",")
                                                            if item)}
    except ValueError:
        parser.error("--acceptance takes name=value pairs, e.g. chain-4=3.9,static-16=4.2")
    return args


def write_config(folder: Path, config: dict) -> str:
    """A model folder holding only ``config.json`` (weights come from ``load_format="dummy"``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    return str(folder)


def weight_bytes(config: dict) -> int:
    """Bytes of a Llama-family model's bf16 weights (the stream a decode step reads)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    vocab = config["vocab_size"] * h * (1 if config["tie_word_embeddings"] else 2)
    return 2 * (layers * per_layer + vocab + h)


class Runner:
    """Builds engines on the chosen device and times their decode steps."""

    def __init__(self, args: argparse.Namespace, device: str, folder: Path):
        self.args = args
        self.device = device
        self.folder = folder
        self.tiny = args.tiny
        self.prompt_len = args.prompt_len or (8 if self.tiny else 128)
        self.output_len = args.output_len or (6 if self.tiny else 64)
        self.short_len = 2 if self.tiny else 8
        self.target = write_config(folder / "target", TINY if self.tiny else QWEN_1_5B)
        self.draft = write_config(folder / "draft", TINY_DRAFT if self.tiny else QWEN_0_5B)
        self.llama = write_config(folder / "llama8b", TINY if self.tiny else LLAMA_8B)
        self.flashinfer_target = write_config(folder / "flashinfer", TINY_FLASHINFER) if self.tiny else self.target
        self._prompt_seed = 0

    def llm(self, model: str, max_num_seqs: int, **kwargs):
        from pagedtree import LLM

        extra = dict(attention_backend="triton") if self.device == "cpu" and "attention_backend" not in kwargs else {}
        return LLM(model, load_format="dummy", dtype="bfloat16", device=self.device, max_num_seqs=max_num_seqs,
                   max_model_len=self.prompt_len + self.output_len + 80, enable_prefix_caching=False,
                   gpu_memory_utilization=0.6, **extra, **kwargs)

    def prompts(self, batch: int, vocab: int) -> list[dict]:
        """Distinct random token-id prompts (a new set per call)."""
        import torch

        self._prompt_seed += 1
        gen = torch.Generator().manual_seed(self._prompt_seed)
        return [{"prompt_token_ids": torch.randint(10, vocab - 10, (self.prompt_len,), generator=gen).tolist()}
                for _ in range(batch)]

    def step_time(self, llm, batch: int, vocab: int) -> dict:
        """Seconds a decode step takes at ``batch``: two generations of different lengths,
        the difference over the extra target passes (and the extra tokens)."""
        from pagedtree import SamplingParams

        runs = {}
        for length in (self.short_len, self.output_len):
            params = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)
            llm.generate(self.prompts(batch, vocab), params, use_tqdm=False)  # warm this length and batch
            before = llm.stats()
            started = time.perf_counter()
            llm.generate(self.prompts(batch, vocab), params, use_tqdm=False)
            seconds = time.perf_counter() - started
            after = llm.stats()
            runs[length] = (seconds, after["num_target_forward_passes"] - before["num_target_forward_passes"],
                            after["num_generated_tokens"] - before["num_generated_tokens"])
        (s0, p0, t0), (s1, p1, t1) = runs[self.short_len], runs[self.output_len]
        step = (s1 - s0) / max(1, p1 - p0)
        return dict(step_seconds=step, tokens_per_second=(t1 - t0) / (s1 - s0), tokens_per_step=(t1 - t0) / max(
            1, p1 - p0))


def _vocab(tiny: bool, config: dict) -> int:
    return TINY["vocab_size"] if tiny else config["vocab_size"]


def graph_replay_seconds(llm, shape: tuple[int, int] = (1, 1), replays: int = 50) -> float | None:
    """GPU seconds of one replay of the engine's CUDA graph of ``shape`` (the model's
    forward alone, no host work): the step's device floor. None without graphs."""
    import torch

    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.capture or shape not in graphs._graphs:
        return None
    graph = graphs._graphs[shape][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def host_profile(llm, run: "Runner", vocab: int, steps: int = 32, top: int = 14) -> str:
    """Where the host's time goes in ``steps`` batch-1 decode steps (cProfile, own time
    per function, the largest first): what a step spends beside the GPU."""
    import cProfile
    import io
    import pstats

    from pagedtree import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(run.prompts(1, vocab), params, use_tqdm=False)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue() + device_timeline(llm, run, vocab, steps // 4)


def device_timeline(llm, run: "Runner", vocab: int, steps: int) -> str:
    """torch.profiler over ``steps`` batch-1 decode steps: the operations and kernels by
    their own time on the host and on the GPU (what runs outside the graph, and how
    long the GPU waits)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedtree import SamplingParams

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    with profile(activities=activities) as prof:
        llm.generate(run.prompts(1, vocab), params, use_tqdm=False)
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    tables = [prof.key_averages().table(sort_by=sort, row_limit=18)]
    if torch.cuda.is_available():
        tables.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    return "\n".join(tables)


def free(llm) -> None:
    """Shut an engine down and give its memory back before the next one is built."""
    import torch

    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def floor_ms(config: dict, gpu_name: str) -> str:
    """The weight-stream floor of a decode step on this GPU (weights over bandwidth)."""
    peak = next((bw for key, bw in PEAK_BANDWIDTH.items() if key in gpu_name), None)
    if peak is None:
        return ""
    return f"floor {weight_bytes(config) / peak * 1e3:.2f} ms"


def section_plain(run: Runner, gpu: str) -> tuple[list[Figure], dict]:
    figures = []
    plain_steps = {}
    llm = run.llm(run.target, max_num_seqs=4 if run.tiny else 64)
    for batch in (TINY_BATCHES if run.tiny else (1, 16, 64)):
        # The same engine one step at a time first (the baseline of this row), then
        # with each step launched ahead of the previous one's readback.
        llm.engine.set_async_scheduling(False)
        ordered = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
        llm.engine.set_async_scheduling(True)
        t = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
        plain_steps[batch] = t["step_seconds"]
        figures.append(Figure("plain", f"1.5B, batch {batch}", f"{t['tokens_per_second']:.0f} tokens/s",
                              f"{t['step_seconds'] * 1e3:.2f} ms a step; "
                              + floor_ms(TINY if run.tiny else QWEN_1_5B, gpu)
                              + f"; one step at a time {ordered['tokens_per_second']:.0f} tokens/s "
                              f"({ordered['step_seconds'] / t['step_seconds']:.2f}x)",
                              t | dict(ordered=ordered)))
        replay = graph_replay_seconds(llm, (batch, 1))
        if replay is not None:
            figures.append(Figure("plain", f"1.5B, batch {batch}: the graph's replay alone",
                                  f"{replay * 1e3:.3f} ms", f"the rest of the step: "
                                  f"{(t['step_seconds'] - replay) * 1e3:.2f} ms", dict(replay_seconds=replay)))
    if run.args.profile:
        print(host_profile(llm, run, _vocab(run.tiny, QWEN_1_5B)), flush=True)
    free(llm)
    llm = run.llm(run.draft, max_num_seqs=4)
    t = run.step_time(llm, 1, _vocab(run.tiny, QWEN_0_5B))
    figures.append(Figure("plain", "0.5B draft alone, batch 1 (one draft level)",
                          f"{t['step_seconds'] * 1e3:.2f} ms a step",
                          floor_ms(TINY_DRAFT if run.tiny else QWEN_0_5B, gpu), t))
    replay = graph_replay_seconds(llm, (1, 1))
    if replay is not None:
        figures.append(Figure("plain", "0.5B draft alone, batch 1: the graph's replay alone", f"{replay * 1e3:.3f} ms",
                              f"the rest of the step: {(t['step_seconds'] - replay) * 1e3:.2f} ms",
                              dict(replay_seconds=replay)))
    free(llm)
    return figures, plain_steps


def static_steps(llm, max_num_seqs: int, max_tree_tokens: int) -> None:
    """Run the engine's target and draft steps padded to static shapes from static
    buffers, uncaptured (on a CPU: the code paths a GPU's graphs take)."""
    from pagedtree.executor.shards import DRAFT_GRAPH_TOKENS

    engine = llm.engine
    engine.runner.enable_cuda_graphs(max_num_seqs, engine.max_model_len, max_tree_tokens, capture=False)
    for draft in engine.speculation.drafts:
        draft.runner.enable_cuda_graphs(max_num_seqs * 4, engine.max_model_len, DRAFT_GRAPH_TOKENS, capture=False)


# The speculative steps timed: a forced chain of 4 and a static 16-node tree.
SPEC_CONFIGS = {"chain-4": dict(tree="chain", depth=4, max_nodes=4, adaptive=False),
                "static-16": dict(tree="static", expansion=(2, 2, 1, 1, 1, 1), max_nodes=16, adaptive=False)}


def section_speculation(run: Runner, plain_steps: dict, acceptance: dict) -> list[Figure]:
    from pagedtree.speculative import SpeculativeConfig

    figures = []
    for name, spec in SPEC_CONFIGS.items():
        max_num_seqs = 4 if run.tiny else 16
        llm = run.llm(run.target, max_num_seqs=max_num_seqs, draft_model=run.draft,
                      speculative=SpeculativeConfig(**spec))
        worker = llm.engine.speculation.drafts[0]
        if run.device == "cpu":  # the padded static steps graphs replay, uncaptured: what a dry run can take
            static_steps(llm, max_num_seqs, 1 + spec["max_nodes"])
        for batch in ((1,) if run.tiny else (1, 16)):
            t = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
            plain = plain_steps.get(batch)
            ratio = t["step_seconds"] / plain if plain else float("nan")
            length = acceptance.get(name)
            speedup = f"; {length / ratio:.2f}x plain at the CPU's acceptance {length}" if length and plain else ""
            figures.append(Figure("speculation", f"{name}, batch {batch}", f"{t['step_seconds'] * 1e3:.2f} ms a step",
                                  f"{ratio:.2f}x a plain step{speedup} (random weights: "
                                  f"{t['tokens_per_step']:.2f} tokens a step)", t | dict(vs_plain=ratio)))
            # The same engine drafting level by level (a readback and a sync a level)
            # instead of whole (every level queued, one readback): what whole drafts save.
            whole = worker.whole_drafts
            by_level = _step_time_with(run, llm, batch, worker, "whole_drafts", False)
            saved = by_level["step_seconds"] / t["step_seconds"]
            figures.append(Figure("speculation", f"{name}, batch {batch}, drafted level by level",
                                  f"{by_level['step_seconds'] * 1e3:.2f} ms a step",
                                  f"whole drafts {saved:.2f}x faster" if whole else "whole drafts are off here",
                                  by_level | dict(whole_speedup=saved)))
            # Whole drafts with each level its own padded step (a graph replay each)
            # instead of the whole draft as one program (two replays: the first level, the
            # rest, filled while the first runs): what the whole-draft graphs save.
            graphs = getattr(worker.runner, "graphs", None)
            if graphs is not None and graphs.drafts is not None:
                drafts = graphs.drafts
                per_level = _step_time_with(run, llm, batch, graphs, "drafts", None)
                gain = per_level["step_seconds"] / t["step_seconds"]
                # The host's fill of a level's buffers: what the second graph hides
                # behind the first level's run.
                fill = drafts.fill_seconds / max(1, drafts.levels_filled)
                figures.append(Figure("speculation", f"{name}, batch {batch}, a graph per level",
                                      f"{per_level['step_seconds'] * 1e3:.2f} ms a step",
                                      f"whole-draft graphs {gain:.2f}x faster ({drafts.num_drafts} whole drafts "
                                      f"in two graphs each, {drafts.num_captures} graphs captured; host fill "
                                      f"{fill * 1e6:.0f} us a level)",
                                      per_level | dict(one_graph_speedup=gain, one_program_drafts=drafts.num_drafts,
                                                       fill_seconds_per_level=fill)))
        free(llm)
    return figures


def _step_time_with(run: Runner, llm, batch: int, owner, attribute: str, value) -> dict:
    """``run.step_time`` of the 1.5B at ``batch`` with ``owner.attribute`` set to
    ``value`` meanwhile (restored after): the same engine with one part switched."""
    saved = getattr(owner, attribute)
    setattr(owner, attribute, value)
    try:
        return run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
    finally:
        setattr(owner, attribute, saved)


def section_suffix(run: Runner, plain_steps: dict) -> list[Figure]:
    from pagedtree.speculative import SpeculativeConfig

    llm = run.llm(run.target, max_num_seqs=4, speculative=SpeculativeConfig(drafter="suffix", max_nodes=16,
                                                                            adaptive=False))
    t = run.step_time(llm, 1, _vocab(run.tiny, QWEN_1_5B))
    free(llm)
    plain = plain_steps.get(1)
    return [Figure("suffix", "suffix drafter, 16 nodes fixed, batch 1", f"{t['step_seconds'] * 1e3:.2f} ms a step",
                   (f"{t['step_seconds'] / plain:.2f}x a plain step; " if plain else "")
                   + f"{t['tokens_per_step']:.2f} tokens a step on the random model's own repeats", t)]


def section_flashinfer(run: Runner) -> list[Figure]:
    """Plain decoding with FlashInfer attending against the Triton kernels, both eager."""
    import torch

    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention

    reason = FlashInferPagedAttention.unavailable(torch.device(run.device), torch.bfloat16)
    if reason is not None:
        return [Figure("flashinfer", "skipped", "-", reason)]
    batches = TINY_BATCHES if run.tiny else (1, 16, 64)
    steps = {}
    for backend in ("triton", "flashinfer"):
        llm = run.llm(run.flashinfer_target, max_num_seqs=4 if run.tiny else 64, attention_backend=backend,
                      enforce_eager=True)
        for batch in batches:
            steps[backend, batch] = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
        free(llm)
    figures = []
    for batch in batches:
        theirs, ours = steps["flashinfer", batch], steps["triton", batch]
        figures.append(Figure("flashinfer", f"1.5B, batch {batch}, eager steps",
                              f"{theirs['tokens_per_second']:.0f} tokens/s",
                              f"{theirs['step_seconds'] * 1e3:.2f} ms a step; the Triton kernels eager "
                              f"{ours['step_seconds'] * 1e3:.2f} ms "
                              f"({ours['step_seconds'] / theirs['step_seconds']:.2f}x)",
                              dict(flashinfer=theirs, triton=ours)))
    return figures


# The key-tile rules the tiles section compares: name -> the tiles module's settings.
TILE_RULES = {
    "the launch code's rule": {},
    "wide key tiles in every launch": {"SM90_WIDE_WAVE": 1e9},
    "16-key tiles": {"SM90_KEY_TILES": ()},
}


def section_tiles(run: Runner) -> list[Figure]:
    """Plain decoding under each of ``TILE_RULES``, an engine per rule built and timed
    with the rule in force (its CUDA graphs hold the tiles of their capture)."""
    import torch

    from pagedtree.kernels import tiles

    if run.device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        return [Figure("tiles", "skipped", "-", "the key-tile rules differ on sm_90 only")]
    batches = TINY_BATCHES if run.tiny else (1, 16, 64)
    figures, baseline = [], {}
    for name, settings in TILE_RULES.items():
        saved = {key: getattr(tiles, key) for key in settings}
        for key, value in settings.items():
            setattr(tiles, key, value)
        try:
            llm = run.llm(run.target, max_num_seqs=4 if run.tiny else 64)
            for batch in batches:
                t = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
                replay = graph_replay_seconds(llm, (batch, 1))
                baseline.setdefault(batch, t["step_seconds"])
                graph = (f"; graph {replay * 1e3:.3f} ms, the rest {(t['step_seconds'] - replay) * 1e3:.2f} ms"
                         if replay is not None else "")
                figures.append(Figure("tiles", f"{name}, batch {batch}", f"{t['tokens_per_second']:.0f} tokens/s",
                                      f"{t['step_seconds'] * 1e3:.2f} ms a step{graph}; "
                                      f"{baseline[batch] / t['step_seconds']:.2f}x the launch code's rule's speed",
                                      t | dict(replay_seconds=replay, settings=settings)))
            free(llm)
        finally:
            for key, value in saved.items():
                setattr(tiles, key, value)
    return figures


def section_overlap(run: Runner) -> list[Figure]:
    """Plain decoding of the 1.5B at batch 1, 16 and 64, the 0.5B draft's own step and
    a chain-4 speculative step at batch 1, with launches one after another and then
    overlapping (``launch_overlap``), an engine each built and timed under the
    setting (its CUDA graphs hold the launches of their capture)."""
    import torch

    from pagedtree.kernels import launch_overlap
    from pagedtree.speculative import SpeculativeConfig

    if run.device == "cuda" and not launch_overlap.supported(torch.device("cuda")):
        return [Figure("overlap", "skipped", "-", "overlapping launches need a GPU of sm_90 or later")]
    batches = TINY_BATCHES if run.tiny else (1, 16, 64)
    timed: dict[tuple[str, bool], tuple[dict, float | None]] = {}
    for on in (False, True):
        with launch_overlap.overlapping(on):
            llm = run.llm(run.target, max_num_seqs=4 if run.tiny else 64)
            for batch in batches:
                t = run.step_time(llm, batch, _vocab(run.tiny, QWEN_1_5B))
                timed[f"1.5B, batch {batch}", on] = t, graph_replay_seconds(llm, (batch, 1))
            free(llm)
            llm = run.llm(run.draft, max_num_seqs=4)
            t = run.step_time(llm, 1, _vocab(run.tiny, QWEN_0_5B))
            timed["0.5B draft alone, batch 1", on] = t, graph_replay_seconds(llm, (1, 1))
            free(llm)
            spec = SPEC_CONFIGS["chain-4"]
            llm = run.llm(run.target, max_num_seqs=4, draft_model=run.draft, speculative=SpeculativeConfig(**spec))
            if run.device == "cpu":
                static_steps(llm, 4, 1 + spec["max_nodes"])
            timed["chain-4, batch 1", on] = run.step_time(llm, 1, _vocab(run.tiny, QWEN_1_5B)), None
            free(llm)
    figures = []
    for case in dict.fromkeys(case for case, _ in timed):
        (apart, apart_replay), (overlapped, replay) = timed[case, False], timed[case, True]
        graphs = (f"; graph {replay * 1e3:.3f} ms against {apart_replay * 1e3:.3f} ms"
                  if replay is not None and apart_replay is not None else "")
        figures.append(Figure("overlap", f"{case}, launches overlapping",
                              f"{overlapped['step_seconds'] * 1e3:.2f} ms a step",
                              f"{apart['step_seconds'] / overlapped['step_seconds']:.2f}x the speed of launches one "
                              f"after another ({apart['step_seconds'] * 1e3:.2f} ms){graphs}",
                              dict(overlapping=overlapped | dict(replay_seconds=replay),
                                   apart=apart | dict(replay_seconds=apart_replay))))
    return figures


def section_llama(run: Runner, gpu: str) -> list[Figure]:
    figures = []
    llm = run.llm(run.llama, max_num_seqs=4 if run.tiny else 16)
    for batch in ((1,) if run.tiny else (1, 16)):
        t = run.step_time(llm, batch, _vocab(run.tiny, LLAMA_8B))
        figures.append(Figure("llama8b", f"Llama-3-8B shape, batch {batch}", f"{t['tokens_per_second']:.0f} tokens/s",
                              f"{t['step_seconds'] * 1e3:.2f} ms a step; " + floor_ms(TINY if run.tiny else LLAMA_8B,
                                                                                      gpu), t))
    free(llm)
    return figures


def section_transformers(run: Runner) -> list[Figure]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if run.device == "cuda" else "cpu"
    config = AutoConfig.from_pretrained(run.target)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    figures = []
    for batch in ((1,) if run.tiny else (1, 16)):
        ids = torch.randint(10, config.vocab_size - 10, (batch, run.prompt_len), device=device)
        times = {}
        for length in (run.short_len, run.output_len):
            generate_seconds(model, ids, length, device)  # warm-up of this length
            times[length] = generate_seconds(model, ids, length, device)
        step = (times[run.output_len] - times[run.short_len]) / (run.output_len - run.short_len)
        figures.append(Figure("transformers", f"generate, 1.5B shape, batch {batch}", f"{batch / step:.0f} tokens/s",
                              f"{step * 1e3:.2f} ms a step", dict(step_seconds=step)))
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return figures


def generate_seconds(model, ids, length: int, device: str) -> float:
    """Seconds of one greedy transformers ``generate`` of exactly ``length`` new tokens
    from ``ids`` (synchronised around it on CUDA)."""
    import torch

    kwargs = dict(max_new_tokens=length, min_new_tokens=length, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - started


def table(figures: list[Figure], header: str) -> str:
    lines = [header, "", "| section | case | figure | against |", "|---|---|---:|---|"]
    lines += [f"| {f.section} | {f.case} | {f.value} | {f.versus} |" for f in figures]
    return "\n".join(lines)


def bench_device(requested: str, tiny: bool) -> str | None:
    """"cuda" or "cpu" for ``--device`` (None: CUDA asked for and absent, said on
    stderr); a CPU run takes the Triton kernels in the interpreter."""
    device = requested
    if device in ("auto", "cuda"):
        import torch

        if not torch.cuda.is_available():
            if device == "cuda":
                print("error: --device cuda, but no CUDA device is available", file=sys.stderr)
                return None
            device = "cpu"
        else:
            device = "cuda"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels on CPU tensors
        if not tiny:
            print("note: --device cpu runs the Triton kernels in the interpreter; use --tiny", file=sys.stderr)
    return device


def run_sections(sections: list[str], run: Callable[[str], list[Figure]], desc: str,
                 no_progress: bool) -> tuple[list[Figure], dict[str, float]]:
    """Every section through ``run`` (an error becomes that section's one figure, so a
    broken section does not hide the others), printed as it finishes, with its seconds."""
    from tqdm import tqdm

    figures: list[Figure] = []
    seconds: dict[str, float] = {}
    bar = tqdm(sections, desc=desc, unit="section", disable=no_progress, file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        started = time.perf_counter()
        try:
            found = run(name)
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            found = [Figure(name, "error", type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")]
        figures += found
        seconds[name] = round(time.perf_counter() - started, 1)
        print("\n".join(f"  {f.section:12s} {f.case:44s} {f.value:>18s}  {f.versus}" for f in found), flush=True)
    return figures, seconds


def report(figures: list[Figure], header: str, seconds: dict[str, float], markdown: str | None,
           json_path: str | None) -> int:
    """Print the table, write it as markdown and the figures as JSON where asked;
    exit status 1 when a section failed."""
    text = table(figures, header)
    print(text)
    print(f"sections took {seconds}")
    if markdown:
        Path(markdown).write_text(text + "\n")
    if json_path:
        Path(json_path).write_text(json.dumps(dict(header=header, seconds=seconds,
                                                   figures=[asdict(f) for f in figures]), indent=1))
    return 1 if any(f.case == "error" for f in figures) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = bench_device(args.device, args.tiny)
    if device is None:
        return 2
    import torch

    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    with tempfile.TemporaryDirectory(prefix="pagedtree-gpu-bench-") as folder:
        run = Runner(args, device, Path(folder))
        plain_steps: dict = {}

        def section(name: str) -> list[Figure]:
            nonlocal plain_steps
            if name == "plain":
                found, plain_steps = section_plain(run, gpu)
                return found
            if name == "speculation":
                return section_speculation(run, plain_steps, args.acceptance_lengths)
            if name == "suffix":
                return section_suffix(run, plain_steps)
            if name == "flashinfer":
                return section_flashinfer(run)
            if name == "tiles":
                return section_tiles(run)
            if name == "overlap":
                return section_overlap(run)
            if name == "llama8b":
                return section_llama(run, gpu)
            return section_transformers(run)

        figures, seconds = run_sections(args.chosen, section, "gpu bench", args.no_progress)
    header = (f"pagedtree GPU bench on {gpu}; torch {torch.__version__}; bf16, random weights, prompts of "
              f"{run.prompt_len} tokens, steps timed over {run.output_len - run.short_len} extra tokens")
    return report(figures, header, seconds, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
