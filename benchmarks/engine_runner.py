"""Run one engine over a workload of cells and write the timings as JSON.

``benchmarks/compare.py`` starts this script once per engine configuration, in a
fresh process (so engines never share memory or threads), with the Python of the
environment that has the engine: the project's ``.venv`` for pagedtree and
transformers, ``.venv-vllm`` for vLLM (which must not import pagedtree),
``.venv-llamacpp`` for llama.cpp (no torch there). At the top level it only needs
the standard library; each engine's loader imports the engine itself (and torch,
transformers where that engine uses them).

A workload file is JSON: ``{"output_len": N, "cells": [{"batch_size": B,
"temperature": T, "rounds": R, "repeats": K, "prompts": [[ids...], ...]}, ...]}``. A
cell is timed as R ``generate`` calls one after another, each with B prompts submitted
together, so "batch B" means the same thing for every engine: B sequences decode side
by side. Every request produces exactly ``output_len`` tokens (EOS ignored). With
K > 1 (default 1) the cell is timed K times and the median timing is reported, the
others kept in ``repeat_tokens_per_s`` (these machines are noisy); speculation
counters are those of the median timing.

    python benchmarks/engine_runner.py --engine pagedtree --model DIR \\
        --workload w.json --out r.json [--draft-model DIR --spec '{"tree": "chain"}']
    .venv-llamacpp/bin/python benchmarks/engine_runner.py --engine llamacpp \\
        --model FILE.gguf --workload w.json --out r.json [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable


@dataclass
class CellResult:
    """Timing of one cell (batch size x temperature) for one engine."""

    batch_size: int
    temperature: float
    num_requests: int
    output_tokens: int
    seconds: float
    # Speculation counters over this cell (absent when the engine does not speculate).
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    accepted_per_position: list[int] | None = None
    num_target_forward_passes: int | None = None
    skipped: str | None = None
    # tokens/s of every timing of the cell when it was repeated (the median is reported).
    repeat_tokens_per_s: list[float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RunInfo:
    """What ran: the engine, its versions and the load time."""

    engine: str
    label: str
    versions: dict[str, str] = field(default_factory=dict)
    load_seconds: float = 0.0
    threads: int = 0
    peak_rss_mib: float = 0.0  # the most resident memory of this process and its children, sampled


class PeakRss:
    """Samples the resident memory of this process plus all its descendants (vLLM runs
    its engine core in a child process) from /proc every ``interval`` seconds and keeps
    the peak. Linux only; elsewhere the peak stays 0."""

    def __init__(self, interval: float = 0.05):
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-rss", daemon=True)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    @property
    def peak_mib(self) -> float:
        """The peak so far in MiB, to one decimal."""
        return round(self.peak_bytes / 2**20, 1)

    def sample(self) -> None:
        """Add up the RSS of the process tree now and keep the maximum."""
        total, pending, seen = 0, [os.getpid()], set()
        while pending:
            pid = pending.pop()
            if pid in seen:
                continue
            seen.add(pid)
            total += _rss_bytes(pid)
            pending.extend(_children(pid))
        self.peak_bytes = max(self.peak_bytes, total)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone, or no /proc
        pass
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return found


# --------------------------------------------------------------------------------------
# Engines. Each returns (info, run_cell) where run_cell(prompts, temperature, output_len)
# -> (output_tokens, speculation counters or None).
# --------------------------------------------------------------------------------------

Counters = dict[str, Any]
RunBatch = Callable[[list[list[int]], float, int], tuple[int, Counters | None]]


def load_pagedtree(args: argparse.Namespace, max_batch: int, max_len: int) -> tuple[RunInfo, RunBatch]:
    """pagedtree's offline ``LLM``, plain or with tree speculation."""
    import pagedtree
    from pagedtree import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(dtype=args.dtype, max_num_seqs=max_batch, max_model_len=max_len, seed=args.seed,
                                  enable_prefix_caching=args.prefix_caching, quantization=args.quantization,
                                  enforce_eager=args.enforce_eager)
    speculating = bool(args.draft_model or args.spec)
    if args.draft_model:
        kwargs["draft_model"] = args.draft_model
    if speculating:
        kwargs["speculative"] = json.loads(args.spec or "{}")
    started = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    load_seconds = time.perf_counter() - started
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forward_passes")

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=args.seed)
        spec = llm.engine.speculator
        if spec is not None and spec.proposer.suffix is not None and not args.keep_suffix_cache:
            # Every timing repeats the same prompts: a suffix tree that remembered the
            # last timing's outputs would predict this one's whole output.
            spec.proposer.suffix.clear_global()
        before = llm.stats()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if not speculating:
            return tokens, None
        counters: Counters = {k: int(after[k] - before[k]) for k in keys}
        per_pos_after = list(after["accepted_tokens_per_position"])
        per_pos_before = list(before["accepted_tokens_per_position"])
        per_pos_before += [0] * (len(per_pos_after) - len(per_pos_before))
        counters["accepted_per_position"] = [int(a - b) for a, b in zip(per_pos_after, per_pos_before)]
        return tokens, counters

    info = RunInfo("pagedtree", args.label, {"pagedtree": pagedtree.__version__}, load_seconds)
    return info, run


def load_transformers(args: argparse.Namespace, max_batch: int, max_len: int) -> tuple[RunInfo, RunBatch]:
    """transformers ``generate`` (left-padded batches), or assisted generation with a draft."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    assistant = None
    if args.draft_model:
        assistant = AutoModelForCausalLM.from_pretrained(args.draft_model[0], dtype=dtype).eval()
    load_seconds = time.perf_counter() - started
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0
    if isinstance(pad, list):
        pad = pad[0]

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        if assistant is not None and len(prompts) > 1:
            raise NotImplementedError("transformers' assisted generation runs at batch 1 only")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            # top_k=0 and top_p=1 switch off the generation config's defaults so the
            # distribution is the plain temperature one, as in the other engines.
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        extra = {"assistant_model": assistant} if assistant is not None else {}
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=pad, **sampling, **extra)
        return (out.shape[1] - width) * len(prompts), None

    info = RunInfo("transformers", args.label, {"transformers": transformers.__version__}, load_seconds)
    return info, run


def load_vllm(args: argparse.Namespace, max_batch: int, max_len: int) -> tuple[RunInfo, RunBatch]:
    """vLLM's offline ``LLM`` in this process, plain or with draft-model speculation."""
    import vllm
    from vllm import LLM, SamplingParams

    dtype = "float32" if args.dtype == "auto" else args.dtype
    kwargs: dict[str, Any] = dict(model=args.model, dtype=dtype, max_num_seqs=max_batch, max_model_len=max_len,
                                  seed=args.seed, disable_log_stats=False, enable_prefix_caching=args.prefix_caching)
    spec = json.loads(args.spec or "{}")
    speculating = bool(args.draft_model) or spec.get("method") == "ngram"
    if spec.get("method") == "ngram":
        # Model-free prompt lookup: the last n tokens (n from max down to min) are looked
        # up earlier in the request and what followed them is proposed.
        kwargs["speculative_config"] = {"method": "ngram",
                                        "num_speculative_tokens": int(spec.get("num_speculative_tokens", 4)),
                                        "prompt_lookup_min": int(spec.get("prompt_lookup_min", 2)),
                                        "prompt_lookup_max": int(spec.get("prompt_lookup_max", 4))}
    elif args.draft_model:
        kwargs["speculative_config"] = {"method": "draft_model", "model": args.draft_model[0],
                                        "num_speculative_tokens": int(spec.get("num_speculative_tokens", 4))}
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - started

    def counters() -> Counters:
        found: Counters = {}
        for metric in llm.get_metrics():
            name = metric.name.removeprefix("vllm:")
            if name == "spec_decode_num_accepted_tokens_per_pos":
                found["accepted_per_position"] = [int(v) for v in metric.values]
            elif name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                found[name.removeprefix("spec_decode_")] = int(metric.value)
        return found

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=args.seed)
        before = counters() if speculating else {}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if not speculating:
            return tokens, None
        after = counters()
        delta: Counters = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        pos_after = after.get("accepted_per_position", [])
        pos_before = before.get("accepted_per_position", []) + [0] * len(pos_after)
        delta["accepted_per_position"] = [a - b for a, b in zip(pos_after, pos_before)]
        # vLLM scores the draft and the bonus token in one target pass per step.
        delta["num_target_forward_passes"] = None
        return tokens, delta

    info = RunInfo("vllm", args.label, {"vllm": vllm.__version__}, load_seconds)
    return info, run


def load_llamacpp(args: argparse.Namespace, max_batch: int, max_len: int) -> tuple[RunInfo, RunBatch]:
    """llama.cpp through llama-cpp-python, one sequence at a time, on the GGUF file itself.

    ``--model`` is the .gguf file; the weights stay in its own quantization (Q4_K_M,
    ...), so ``--dtype`` does not apply. Each request starts from an empty KV cache
    (no prefix reuse between prompts, like the other engines without
    ``--prefix-caching``) and produces exactly ``output_len`` tokens: the token loop
    is driven here and stopped by count, so EOS never ends it. Greedy at temperature 0,
    otherwise the plain temperature distribution (top-k, top-p, min-p all off).
    """
    import llama_cpp

    if args.draft_model:
        raise SystemExit("the llamacpp engine drafts from the prompt only (--spec '{\"prompt_lookup_tokens\": N}'), "
                         "not with a --draft-model")
    options = json.loads(args.spec) if args.spec else {}
    unknown = set(options) - {"prompt_lookup_tokens", "prompt_lookup_ngram"}
    if unknown:
        raise SystemExit(f"llamacpp --spec takes prompt_lookup_tokens and prompt_lookup_ngram, not {sorted(unknown)}")
    draft = None
    if options:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # llama-cpp-python's own speculation: n-grams of the context looked up in the
        # context (prompt-lookup decoding), verified by the target in one batch.
        draft = LlamaPromptLookupDecoding(max_ngram_size=int(options.get("prompt_lookup_ngram", 2)),
                                          num_pred_tokens=int(options.get("prompt_lookup_tokens", 10)))
    threads = args.threads or os.cpu_count() or 1
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=max_len, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, seed=args.seed, verbose=False, draft_model=draft)
    load_seconds = time.perf_counter() - started

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        if len(prompts) > 1:
            raise NotImplementedError("llama-cpp-python decodes one sequence at a time: batch 1 only")
        if temperature > 0:
            sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)
        else:
            sampling = dict(temp=0.0, top_k=1)
        llm.reset()  # a fresh KV cache for every request
        tokens = 0
        # generate() evaluates the prompt, then samples a token and evaluates it on the
        # next step; it never checks EOS itself (create_completion does), so stopping
        # by count gives exactly output_len tokens, and the last one is not evaluated.
        stream = llm.generate(prompts[0], repeat_penalty=1.0, reset=True, **sampling)
        try:
            for _ in stream:
                tokens += 1
                if tokens >= output_len:
                    break
        finally:
            stream.close()
        if tokens != output_len:
            raise RuntimeError(f"llama.cpp produced {tokens} tokens, expected {output_len}")
        return tokens, None

    info = RunInfo("llamacpp", args.label, {"llama-cpp-python": llama_cpp.__version__}, load_seconds, threads)
    return info, run


LOADERS = {"pagedtree": load_pagedtree, "transformers": load_transformers, "vllm": load_vllm,
           "llamacpp": load_llamacpp}


def run_workload(args: argparse.Namespace, workload: dict, on_cell: Callable[[dict], None] | None = None) -> dict:
    """Load the engine, warm it up, time every cell; returns the JSON-ready result,
    with the peak RSS of the whole run (loading included).

    ``on_cell`` gets the result so far after every cell (the caller saves it, so a run
    stopped by a time limit still reports the cells it finished).
    """
    with PeakRss() as rss:
        return _run_cells(args, workload, rss, on_cell)


def _run_cells(args: argparse.Namespace, workload: dict, rss: PeakRss,
               on_cell: Callable[[dict], None] | None) -> dict:
    cells = workload["cells"]
    output_len = int(workload["output_len"])
    max_batch = max(int(c["batch_size"]) for c in cells)
    max_prompt = max(len(p) for c in cells for p in c["prompts"])
    info, run = LOADERS[args.engine](args, max_batch, max_prompt + output_len + 16)
    # torch only where the engine uses it (llama.cpp's venv has none); the llama.cpp
    # loader reports its own thread count.
    torch = sys.modules.get("torch")
    if torch is not None:
        info.versions["torch"] = torch.__version__
        info.threads = info.threads or torch.get_num_threads()
    # Warm-up: one short request (first-call allocations, vLLM's compiled graphs).
    first = cells[0]["prompts"][0]
    run([first], 0.0, min(4, output_len))
    results: list[CellResult] = []
    for cell in cells:
        batch, temperature, rounds = int(cell["batch_size"]), float(cell["temperature"]), int(cell.get("rounds", 1))
        repeats = int(cell.get("repeats", 1))
        if repeats < 1:
            raise ValueError(f"workload cell repeats must be >= 1, got {repeats}")
        prompts = cell["prompts"]
        try:
            timings: list[tuple[int, float, Counters | None]] = []
            for _ in range(repeats):
                tokens, seconds, totals = 0, 0.0, None
                for r in range(rounds):
                    group = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
                    started = time.perf_counter()
                    n, counters = run(group, temperature, output_len)
                    seconds += time.perf_counter() - started
                    tokens += n
                    totals = _add_counters(totals, counters)
                timings.append((tokens, seconds, totals))
            # The median timing, with its own counters, so every field of the cell
            # describes the same run of it.
            tokens, seconds, totals = sorted(timings, key=lambda t: t[1])[len(timings) // 2]
            result = CellResult(batch, temperature, batch * rounds, tokens, seconds)
            if repeats > 1:
                result.repeat_tokens_per_s = [round(n / s, 3) if s > 0 else 0.0 for n, s, _ in timings]
            if totals:
                for key, value in totals.items():
                    setattr(result, key, value)
        except NotImplementedError as exc:
            result = CellResult(batch, temperature, 0, 0, 0.0, skipped=str(exc))
        results.append(result)
        rss.sample()
        info.peak_rss_mib = rss.peak_mib
        status = result.skipped or f"{result.tokens_per_s:.2f} tokens/s"
        if result.repeat_tokens_per_s:
            status += f" (median of {result.repeat_tokens_per_s})"
        print(f"[{info.label}] batch {batch} temperature {temperature}: {status}", file=sys.stderr, flush=True)
        if on_cell is not None:
            on_cell(_result_json(info, results))
    return _result_json(info, results)


def _result_json(info: RunInfo, results: list[CellResult]) -> dict:
    return {"info": asdict(info), "cells": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]}


def _save(path: str, result: dict) -> None:
    """Write atomically, so a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, path)


def _add_counters(total: Counters | None, new: Counters | None) -> Counters | None:
    """Sum speculation counters over a cell's rounds (lists element-wise)."""
    if new is None:
        return total
    if total is None:
        return dict(new)
    out = dict(total)
    for key, value in new.items():
        if value is None:
            continue
        if isinstance(value, list):
            old = list(out.get(key) or [])
            old += [0] * (len(value) - len(old))
            out[key] = [a + b for a, b in zip(old, value + [0] * (len(old) - len(value)))]
        else:
            out[key] = (out.get(key) or 0) + value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, choices=sorted(LOADERS))
    parser.add_argument("--label", default=None, help="name of this configuration in the tables")
    parser.add_argument("--model", required=True, help="Hugging Face model folder (llamacpp: a .gguf file)")
    parser.add_argument("--draft-model", nargs="+", default=None, help="draft folder(s): speculation on")
    parser.add_argument("--spec", default=None, help="speculation options as JSON (pagedtree SpeculativeConfig "
                        "fields; vLLM: num_speculative_tokens)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "q8", "q4"],
                        help="pagedtree: quantized linear layers")
    parser.add_argument("--keep-suffix-cache", action="store_true",
                        help="pagedtree: keep the suffix drafter's global tree between timings (default: "
                             "cleared, so that a timing cannot draft from the previous timing's outputs)")
    parser.add_argument("--enforce-eager", action="store_true", help="pagedtree: every op eager (no fused CPU kernels)")
    parser.add_argument("--threads", type=int, default=None,
                        help="llamacpp: n_threads and n_threads_batch (default: every core, os.cpu_count())")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep pagedtree's and vLLM's prefix cache on (off: every cell prefills its prompts, "
                             "as transformers does, although the cells repeat the same prompts)")
    parser.add_argument("--workload", required=True, help="workload JSON (see above)")
    parser.add_argument("--out", required=True, help="result JSON")
    args = parser.parse_args(argv)
    args.label = args.label or args.engine
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open(args.workload) as f:
        workload = json.load(f)
    _save(args.out, run_workload(args, workload, on_cell=lambda partial: _save(args.out, partial)))
    return 0


if __name__ == "__main__":  # the guard vLLM needs: it spawns worker processes
    sys.exit(main())
