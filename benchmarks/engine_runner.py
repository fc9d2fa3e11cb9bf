"""Run one engine over a workload of cells and write the timings as JSON.

``benchmarks/compare.py`` starts this script once per engine configuration, in a
fresh process (so engines never share memory or threads), with the Python of the
environment that has the engine: the project's ``.venv`` for pagedtree and
transformers, ``.venv-vllm`` for vLLM (which must not import pagedtree),
``.venv-llamacpp`` for llama.cpp (no torch there). The engines are loaded and run by
the adapters of ``benchmarks/engines.py``; like them, this script needs only the
standard library at the top level.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

# Run as a script (by compare.py, also in the vLLM and llama.cpp environments) or
# loaded from a file by the tests: either way the repository root is what makes
# ``benchmarks.engines`` importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engines import LOADERS, Counters, EngineOptions, RunInfo, time_batches  # noqa: E402


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
        pending, seen = [os.getpid()], []
        while pending:
            pid = pending.pop()
            if pid in seen:
                continue
            seen.append(pid)
            pending.extend(_children(pid))
        # One process: its resident set. Several: their proportional sets, which count
        # each page they share once (a forked child shares all its parent's pages until
        # it execs: adding up resident sets counted a helper process's fork of a 3 GB
        # engine as 3 GB more).
        total = _rss_bytes(seen[0]) if len(seen) == 1 else sum(_pss_bytes(pid) for pid in seen)
        self.peak_bytes = max(self.peak_bytes, total)


def _proc_kib_field(path: str, field: str) -> int | None:
    """Bytes of a ``field: N kB`` line of a /proc file (0 without it; None when the
    file cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


def _rss_bytes(pid: int) -> int:
    return _proc_kib_field(f"/proc/{pid}/status", "VmRSS:") or 0  # gone, or no /proc: 0


def _pss_bytes(pid: int) -> int:
    found = _proc_kib_field(f"/proc/{pid}/smaps_rollup", "Pss:")
    return _rss_bytes(pid) if found is None else found  # gone, or no smaps_rollup (Linux < 4.14)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return found


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
    info, run = LOADERS[args.engine](engine_options(args), max_batch, max_prompt + output_len + 16)
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
            groups = [[prompts[(r * batch + i) % len(prompts)] for i in range(batch)] for r in range(rounds)]
            for _ in range(repeats):
                timings.append(time_batches(run, groups, temperature, output_len))
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


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The adapters' options from this script's command line."""
    return EngineOptions(model=args.model, label=args.label, draft_model=args.draft_model,
                         spec=json.loads(args.spec) if args.spec else None, dtype=args.dtype, seed=args.seed,
                         quantization=args.quantization, prefix_caching=args.prefix_caching,
                         enforce_eager=args.enforce_eager, keep_suffix_cache=args.keep_suffix_cache,
                         threads=args.threads, engine_workload=args.engine_workload)


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
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "q8", "q4", "ggml"],
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
    parser.add_argument("--engine-workload", default=None, choices=["stream", "batch"],
                        help="pagedtree: the load its weights' format is chosen for (default: LLM's, stream)")
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
