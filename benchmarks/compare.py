"""Same workload, several engines, one run: a table and plots to choose an engine by.

Offline part: every engine configuration runs in its own fresh process
(``benchmarks/engine_runner.py``) over the same cells, batch size x temperature, with
the same token-id prompts and exactly ``--output-len`` new tokens per request (EOS
ignored). Engines:

- ``pagedtree``               plain decoding
- ``pagedtree-batch``         plain decoding built for batches (``workload="batch"``, what
                              ``pagedtree serve`` builds: a GGUF's weights in the format this
                              CPU runs batches fastest in)
- ``pagedtree-eager``         plain decoding with every op eager (``enforce_eager``: no
                              fused CPU element-wise kernels), for the A/B
- ``pagedtree-spec:PRESET``   tree speculation with a preset of
                              ``pagedtree.speculative.presets`` (chain-5, dynamic-16, ...)
- ``transformers``            Hugging Face ``generate`` (left-padded batches)
- ``transformers-assisted``   assisted generation with the draft (batch 1 only)
- ``vllm``                    vLLM's offline ``LLM`` (from ``--vllm-python``'s venv)
- ``vllm-spec``               vLLM with draft-model speculation (``--vllm-spec-tokens``)
- ``vllm-ngram``              vLLM's model-free n-gram (prompt-lookup) speculation
                              (``--vllm-spec-tokens``; n-grams of 2-4 tokens): the peer of
                              pagedtree's suffix drafter
- ``llamacpp``                llama.cpp (llama-cpp-python, from ``--llamacpp-python``'s venv)
                              on the model's GGUF file, batch 1 only; labelled with the
                              GGUF's quantization, e.g. ``llamacpp:Q4_K_M``
- ``llamacpp-lookup``         llama.cpp with llama-cpp-python's own speculation,
                              prompt-lookup drafting (``--llamacpp-lookup-tokens``)

Serving part (``--serve-rates``): ``pagedtree serve`` and vLLM's OpenAI server are
started one after the other and driven over HTTP by ``benchmarks/serving.py`` at each
request rate, with the same prompts.

Outputs under ``--out-dir``: ``TAG.md`` (tables), ``TAG.json`` (everything), and
``TAG_throughput.png``, ``TAG_speedup.png``, ``TAG_acceptance.png``,
``TAG_serving.png``. All ratios compare engines measured in this same run.

    python benchmarks/compare.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --batch-sizes 1,8 --temperatures 0,0.8

vLLM comes from its own environment: ``bash benchmarks/peers/setup_vllm.sh`` creates
``.venv-vllm`` (the default ``--vllm-python``); vLLM engines are skipped, with a note
in the table, when it is missing.

llama.cpp comes from its own environment too: ``bash benchmarks/peers/setup_llamacpp.sh``
builds ``.venv-llamacpp`` (the default ``--llamacpp-python``; 7-15 minutes on 2
cores), and the ``llamacpp`` engine is skipped, with a note, when it is missing. It
runs a GGUF file: a packaged model's assembled GGUF, or ``--model`` when that is a
.gguf file (for any other model it is skipped, with a note). It uses every core unless
``--llamacpp-threads`` says otherwise; batches larger than 1 are listed as skipped.

    python benchmarks/compare.py --model qwen2.5-coder-1.5b-instruct --draft-model '' \\
        --engines pagedtree-int4,llamacpp --batch-sizes 1 --temperatures 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedtree.loadgen.datasets import PROMPT_SETS, chat_token_ids
from pagedtree.process_env import foreign_environment
from pagedtree.speculative.presets import tree_preset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent



@dataclass
class EngineSpec:
    """One engine configuration: which runner engine, options, and the Python to use."""

    label: str
    engine: str
    python: str
    draft: bool = False
    spec: dict[str, Any] | None = None
    baseline: str | None = None  # the plain engine this speculative one is compared with
    quantization: str | None = None  # pagedtree's weight-only int8/int4
    model: str | None = None  # the runner's --model when not the HF folder (llamacpp: the GGUF file)
    threads: int | None = None  # llamacpp's n_threads (None: every core)
    eager: bool = False  # pagedtree with enforce_eager (no fused CPU kernels)
    engine_workload: str | None = None  # pagedtree's workload (the format a GGUF runs in by default)


@dataclass
class EngineRun:
    """A finished (or failed) engine run."""

    spec: EngineSpec
    result: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0
    cells: dict[tuple[int, float], dict[str, Any]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------


def build_prompts(args: argparse.Namespace, folder: Path) -> list[list[int]]:
    """Token ids of the prompts: a chat-templated prompt set (coding, prose, edit), or
    random tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if args.dataset == "random":
        import random

        rng = random.Random(args.seed)
        hi = min(len(tokenizer), 30000)
        return [[rng.randrange(100, hi) for _ in range(args.input_len)] for _ in range(max(args.batch_sizes))]
    return [chat_token_ids(tokenizer, chat) for chat in PROMPT_SETS[args.dataset]]


def build_workload(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Cells batch size x temperature; batch 1 runs ``--rounds-batch1`` prompts in turn.

    Each cell is timed ``--repeats`` times by the runner, which reports the median.
    """
    cells = []
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            rounds = args.rounds_batch1 if batch == 1 else 1
            cells.append({"batch_size": batch, "temperature": temperature, "rounds": rounds, "repeats": args.repeats,
                          "prompts": prompts})
    return {"output_len": args.output_len, "cells": cells}


def engine_specs(args: argparse.Namespace) -> tuple[list[EngineSpec], list[str]]:
    """The engine configurations to run, and notes on those that cannot run here."""
    own = sys.executable
    vllm_ok = bool(args.vllm_python) and Path(args.vllm_python).exists()
    llamacpp_ok = bool(args.llamacpp_python) and Path(args.llamacpp_python).exists()
    specs, notes = [], []
    for name in args.engines:
        quant = args.pagedtree_quantization
        at = f"@{quant}" if quant else ""
        if name == "pagedtree":
            specs.append(EngineSpec(f"pagedtree{at}", "pagedtree", own, quantization=quant))
        elif name == "pagedtree-batch":
            # What a server builds: the GGUF by name, its format chosen for batches.
            specs.append(EngineSpec(name, "pagedtree", own, model=str(args.model), engine_workload="batch"))
        elif name == "pagedtree-eager":
            specs.append(EngineSpec(name, "pagedtree", own, eager=True))
        elif name in ("pagedtree-int8", "pagedtree-int4", "pagedtree-q8", "pagedtree-q4", "pagedtree-ggml"):
            specs.append(EngineSpec(name, "pagedtree", own, quantization=name.rsplit("-", 1)[1]))
        elif name == "pagedtree-spec":
            for preset in args.spec_presets:
                config = tree_preset(preset)
                specs.append(EngineSpec(f"pagedtree-spec:{preset}{at}", "pagedtree", own,
                                        draft=config.get("drafter", "model") != "suffix",
                                        spec=config, baseline=f"pagedtree{at}", quantization=quant))
        elif name == "transformers":
            specs.append(EngineSpec("transformers", "transformers", own))
        elif name == "transformers-assisted":
            specs.append(EngineSpec("transformers-assisted", "transformers", own, draft=True, baseline="transformers"))
        elif name in ("vllm", "vllm-spec", "vllm-ngram"):
            if not vllm_ok:
                notes.append(f"{name}: skipped, no vLLM environment at {args.vllm_python} "
                             "(run `bash benchmarks/peers/setup_vllm.sh`)")
                continue
            # vLLM keeps cores for its scheduler process by default (on 2 cores: 1 of 2);
            # --vllm-reserved-cpus overrides that, and the label says so.
            tag = "" if args.vllm_reserved_cpus is None else f"@reserved{args.vllm_reserved_cpus}"
            if args.vllm_dtype != args.dtype:
                tag += f"@{args.vllm_dtype}"
            if name == "vllm":
                specs.append(EngineSpec(f"vllm{tag}", "vllm", args.vllm_python))
            elif name == "vllm-ngram":
                specs.append(EngineSpec(f"vllm-ngram:{args.vllm_spec_tokens}{tag}", "vllm", args.vllm_python,
                                        spec={"method": "ngram", "num_speculative_tokens": args.vllm_spec_tokens,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                                        baseline=f"vllm{tag}"))
            else:
                specs.append(EngineSpec(f"vllm-spec:draft-{args.vllm_spec_tokens}{tag}", "vllm", args.vllm_python,
                                        draft=True, spec={"num_speculative_tokens": args.vllm_spec_tokens},
                                        baseline=f"vllm{tag}"))
        elif name in ("llamacpp", "llamacpp-lookup"):
            if not llamacpp_ok:
                notes.append(f"{name}: skipped, no llama.cpp environment at {args.llamacpp_python} "
                             "(run `bash benchmarks/peers/setup_llamacpp.sh`)")
                continue
            gguf, why = llamacpp_gguf(args.model)
            if gguf is None:
                notes.append(f"{name}: skipped, {why}")
                continue
            tag = "" if args.llamacpp_threads is None else f"@threads{args.llamacpp_threads}"
            label = f"llamacpp:{gguf_quantization(gguf)}{tag}"
            if name == "llamacpp":
                specs.append(EngineSpec(label, "llamacpp", args.llamacpp_python, model=str(gguf),
                                        threads=args.llamacpp_threads))
            else:
                tokens = args.llamacpp_lookup_tokens
                specs.append(EngineSpec(f"llamacpp-lookup:{tokens}:{gguf_quantization(gguf)}{tag}", "llamacpp",
                                        args.llamacpp_python, model=str(gguf), threads=args.llamacpp_threads,
                                        spec={"prompt_lookup_tokens": tokens}, baseline=label))
        else:
            raise SystemExit(f"unknown engine {name!r}")
        if specs and specs[-1].draft and not args.draft_model:
            raise SystemExit(f"engine {name} needs --draft-model")
    return specs, notes


def llamacpp_gguf(model: str) -> tuple[Path | None, str]:
    """The GGUF file llama.cpp runs for ``--model``, or None and why not.

    A packaged model's GGUF is assembled (once) into the cache, as for pagedtree's
    quantized engines; a ``--model`` that is a .gguf file is used as it is. A Hugging
    Face folder has no GGUF to give llama.cpp.
    """
    from pagedtree.loading import packaged_models as pm

    if model in pm.PACKAGED_MODELS:
        try:
            return pm.gguf_path(pm.PACKAGED_MODELS[model]), ""
        except pm.ModelNotInstalledError as exc:
            return None, str(exc)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if path.is_file():
            return path.resolve(), ""
        return None, f"GGUF file not found: {path}"
    return None, (f"--model {model} is neither a packaged model nor a .gguf file "
                  "(llama.cpp runs GGUF files only)")


def gguf_quantization(path: Path) -> str:
    """The GGUF's quantization as llama.cpp names it (``general.file_type``: Q4_K_M, Q8_0, ...).

    Falls back to the quantization written in the file name, then to ``gguf``.
    """
    import re

    try:
        from gguf import LlamaFileType

        from pagedtree.loading.gguf_reader import open_gguf

        field = open_gguf(path).fields.get("general.file_type")
        if field is not None:
            name = LlamaFileType(int(field.parts[field.data[0]][0])).name
            return name.removeprefix("MOSTLY_")
    except Exception:  # an old gguf package, an unknown file type, a file it cannot read
        pass
    found = re.search(r"(?i)(?:^|[-_.])((?:I?Q\d+_[0-9A-Z_]*?[0-9A-Z])|BF16|F16|F32)(?:\.gguf)?$", path.name)
    return found.group(1).upper() if found else "gguf"


def vllm_env(python: str, reserved_cpus: int | None = None) -> dict[str, str]:
    """vLLM's recommended CPU set-up: Intel OpenMP and tcmalloc preloaded when present.

    ``reserved_cpus`` sets ``VLLM_CPU_NUM_OF_RESERVED_CPU``: by default vLLM keeps one
    core per worker for its scheduler process and binds compute threads to the rest.
    """
    env = foreign_environment()
    if reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    preload = []
    iomp = Path(python).resolve().parent.parent / "lib" / "libiomp5.so"
    if not iomp.exists():
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        preload.append(str(iomp))
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(cand).exists():
            preload.append(cand)
            break
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


# --------------------------------------------------------------------------------------
# Offline runs
# --------------------------------------------------------------------------------------


def run_engine(args: argparse.Namespace, spec: EngineSpec, model: Path, draft: Path | None,
               workload_path: Path, out_dir: Path) -> EngineRun:
    """Run one engine configuration in a fresh process; its stderr goes to a log file."""
    safe = spec.label.replace(":", "_")
    out = out_dir / f"{args.tag}_{safe}.json"
    log = out_dir / f"{args.tag}_{safe}.log"
    cmd = [spec.python, str(HERE / "engine_runner.py"), "--engine", spec.engine, "--label", spec.label,
           # Quantized engines load a packaged model straight from its GGUF (by name);
           # llama.cpp gets the GGUF file itself.
           "--model", spec.model or str(args.model if spec.quantization else model), "--workload", str(workload_path),
           "--out", str(out), "--dtype", args.vllm_dtype if spec.engine == "vllm" else args.dtype,
           "--seed", str(args.seed)]
    if args.prefix_caching:
        cmd.append("--prefix-caching")
    if spec.draft:
        # Like the target: a quantized engine's draft comes straight from its GGUF (by
        # name), as ``LLM(draft_model=name)`` loads it, not from the converted folder.
        cmd += ["--draft-model", str(args.draft_model if spec.quantization and spec.engine == "pagedtree" else draft)]
    if spec.spec is not None:
        cmd += ["--spec", json.dumps(spec.spec)]
    if spec.quantization is not None:
        cmd += ["--quantization", spec.quantization]
    if spec.threads is not None:
        cmd += ["--threads", str(spec.threads)]
    if spec.eager:
        cmd.append("--enforce-eager")
    if spec.engine_workload is not None:
        cmd += ["--engine-workload", spec.engine_workload]
    if getattr(args, "keep_suffix_cache", False) and spec.engine == "pagedtree":
        cmd.append("--keep-suffix-cache")
    if spec.engine == "vllm":
        env = vllm_env(spec.python, args.vllm_reserved_cpus)
    elif spec.engine == "pagedtree":
        env = dict(os.environ)
    else:  # another engine gets the environment as it was before pagedtree's import set its defaults
        env = foreign_environment()
    if spec.quantization in ("q4", "q8", "ggml") or spec.engine_workload is not None:  # may run q4
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see pagedtree/worker/models/block_quant.py, "Threads"
    started = time.perf_counter()
    run = EngineRun(spec)
    out.unlink(missing_ok=True)
    with open(log, "w") as logf:
        # A session of its own, so that a time limit also stops vLLM's engine and
        # worker processes, not only the runner.
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(out_dir),
                                start_new_session=True)
        try:
            if proc.wait(args.engine_timeout) != 0:
                run.error = f"exit {proc.returncode}: {_tail(log)}"
        except subprocess.TimeoutExpired:
            run.error = f"timed out after {args.engine_timeout} s"
            _stop_group(proc)
    run.seconds = time.perf_counter() - started
    # The runner saves after every cell: a run cut short still reports what it finished.
    if out.exists():
        run.result = json.loads(out.read_text())
        run.cells = {(c["batch_size"], c["temperature"]): c for c in run.result["cells"]}
    return run


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it is still there after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


# --------------------------------------------------------------------------------------
# Serving runs
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout:.0f} s")


def serve_command(engine: str, args: argparse.Namespace, model: Path, port: int, max_len: int) -> tuple[list[str], dict]:
    """The command line that starts ``engine``'s OpenAI-compatible server."""
    dtype = args.dtype
    if engine == "pagedtree" or engine.startswith("pagedtree-spec:"):
        cli = Path(sys.executable).parent / "pagedtree"
        cmd = [str(cli), "serve", "--model", str(model), "--port", str(port), "--dtype", dtype,
               "--max-model-len", str(max_len), "--max-num-seqs", str(max(args.batch_sizes))]
        if engine != "pagedtree":
            preset = engine.split(":", 1)[1]
            cmd += ["--spec-preset", preset]
            if tree_preset(preset).get("drafter", "model") != "suffix":
                cmd += ["--draft-model", str(args.draft_model)]
        return cmd, dict(os.environ)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--dtype", args.vllm_dtype, "--max-model-len", str(max_len), "--max-num-seqs", str(max(args.batch_sizes)),
           "--seed", str(args.seed)]
    return cmd, vllm_env(args.vllm_python, args.vllm_reserved_cpus)


def run_serving(args: argparse.Namespace, engine: str, model: Path, out_dir: Path) -> dict[str, Any]:
    """Start ``engine``'s server, run the serving benchmark at every rate, stop it."""
    port = _free_port()
    max_len = args.input_len + args.output_len + 64
    cmd, env = serve_command(engine, args, model, port, max_len)
    log = out_dir / f"{args.tag}_serve_{engine}.log"
    results: dict[str, Any] = {"engine": engine, "rates": {}}
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(out_dir),
                                start_new_session=True)
        try:
            _wait_ready(f"http://127.0.0.1:{port}", proc, args.server_timeout)
            for rate in args.serve_rates:
                path = out_dir / f"{args.tag}_serve_{engine}_{rate}.json"
                bench = [sys.executable, str(HERE / "serving.py"), "--backend", "openai",
                         "--base-url", f"http://127.0.0.1:{port}", "--model", str(model),
                         "--dataset", "random", "--input-len", str(args.input_len),
                         "--output-len", str(args.output_len), "--num-prompts", str(args.serve_num_prompts),
                         "--request-rate", str(rate), "--ignore-eos", "--seed", str(args.seed),
                         "--temperature", "0", "--save-result", str(path), "--disable-tqdm"]
                proc_b = subprocess.run(bench, capture_output=True, text=True, timeout=args.engine_timeout)
                if proc_b.returncode != 0:
                    results["rates"][str(rate)] = {"error": proc_b.stderr.strip().splitlines()[-1:]}
                else:
                    results["rates"][str(rate)] = json.loads(path.read_text())
        except Exception as exc:  # a server that does not start is a result to report, not a crash
            results["error"] = f"{type(exc).__name__}: {exc} (log: {log.name})"
        finally:
            _stop_group(proc)
    return results


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def acceptance_length(cell: dict[str, Any]) -> float | None:
    """Mean tokens per target pass on speculative steps: 1 + accepted / drafts."""
    drafts = cell.get("num_drafts")
    if not drafts:
        return None
    return 1.0 + cell["num_accepted_tokens"] / drafts


def markdown_tables(args: argparse.Namespace, runs: list[EngineRun], notes: list[str],
                    serving: list[dict[str, Any]], header: str) -> str:
    """The offline table (with same-run ratios) and the serving table."""
    by_label = {r.spec.label: r for r in runs if r.result}
    lines = [header, "", "| engine | batch | temperature | tokens/s | vs pagedtree | vs transformers | "
             "vs own plain | mean acceptance length |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for temperature in args.temperatures:
        for batch in args.batch_sizes:
            key = (batch, temperature)
            for run in runs:
                cell = run.cells.get(key)
                if cell is None:
                    continue
                if cell.get("skipped"):
                    lines.append(f"| {run.spec.label} | {batch} | {temperature:g} | — | | | | ({cell['skipped']}) |")
                    continue
                tps = cell["tokens_per_s"]
                ratios = []
                for base in ("pagedtree", "transformers", run.spec.baseline):
                    other = by_label.get(base).cells.get(key) if base and base in by_label else None
                    ok = other and not other.get("skipped") and other["tokens_per_s"] > 0
                    ratios.append(f"{tps / other['tokens_per_s']:.2f}x" if ok else "")
                length = acceptance_length(cell)
                lines.append(f"| {run.spec.label} | {batch} | {temperature:g} | {tps:.2f} | {ratios[0]} | "
                             f"{ratios[1]} | {ratios[2]} | {f'{length:.2f}' if length else ''} |")
    memory = [(r.spec.label, r.result["info"]) for r in runs if r.result and r.result["info"].get("peak_rss_mib")]
    if memory:
        lines += ["", "| engine | peak RSS (MiB, process and children) | load seconds |", "|---|---:|---:|"]
        lines += [f"| {label} | {info['peak_rss_mib']:.0f} | {info['load_seconds']:.1f} |" for label, info in memory]
    for run in runs:
        if run.error:
            done = f"; the {len(run.cells)} cells it finished are shown" if run.cells else ""
            notes.append(f"{run.spec.label}: failed ({run.error}){done}")
    if serving:
        lines += ["", "Serving (OpenAI completions over HTTP, streamed):", "",
                  "| engine | request rate | completed/sent | output tokens/s | median TTFT ms | median TPOT ms | "
                  "p99 ITL ms |", "|---|---:|---:|---:|---:|---:|---:|"]
        for srv in serving:
            if srv.get("error"):
                notes.append(f"serve {srv['engine']}: {srv['error']}")
            for rate, res in srv["rates"].items():
                if "error" in res:
                    notes.append(f"serve {srv['engine']} at rate {rate}: {res['error']}")
                    continue
                s = _summary(res)
                lines.append(f"| {srv['engine']} | {rate} | {s['completed']}/{s['sent']} | "
                             f"{s['output_throughput']:.2f} | {_fmt(s['ttft_median'])} | {_fmt(s['tpot_median'])} | "
                             f"{_fmt(s['itl_p99'])} |")
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def _summary(res: dict[str, Any]) -> dict[str, Any]:
    """The few serving figures the table and plot use, from serving.py's JSON (vLLM's key names)."""
    summary = res["summary"]
    return {
        "completed": summary["completed"],
        "sent": summary["total_requests"],
        "output_throughput": summary["output_throughput"] or 0.0,
        "ttft_median": summary["median_ttft_ms"],
        "tpot_median": summary["median_tpot_ms"],
        "itl_p99": summary["p99_itl_ms"],
    }


def plot(args: argparse.Namespace, runs: list[EngineRun], serving: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Throughput, speculation speed-up, acceptance per position and serving plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in runs if r.result]
    by_label = {r.spec.label: r for r in done}
    files = []
    temps = args.temperatures

    def cell_tps(run: EngineRun, key: tuple[int, float]) -> float | None:
        c = run.cells.get(key)
        return c["tokens_per_s"] if c and not c.get("skipped") and c["tokens_per_s"] > 0 else None

    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for run in done:
            pts = [(b, cell_tps(run, (b, t))) for b in args.batch_sizes]
            pts = [(b, v) for b, v in pts if v]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=run.spec.label)
        ax.set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title=f"throughput, temperature {t:g}")
        ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / f"{args.tag}_throughput.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    spec_runs = [r for r in done if r.spec.baseline and r.spec.baseline in by_label]
    if spec_runs:
        fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
        for ax, t in zip(axes[0], temps):
            for run in spec_runs:
                base = by_label[run.spec.baseline]
                pts = []
                for b in args.batch_sizes:
                    v, w = cell_tps(run, (b, t)), cell_tps(base, (b, t))
                    if v and w:
                        pts.append((b, v / w))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{run.spec.label} / {run.spec.baseline}")
            ax.axhline(1.0, color="grey", lw=1)
            ax.set(xscale="log", xlabel="batch size", ylabel="speed-up over own plain decoding",
                   title=f"speculation speed-up, temperature {t:g}")
            ax.set_xticks(args.batch_sizes, [str(b) for b in args.batch_sizes])
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        files.append(out_dir / f"{args.tag}_speedup.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in spec_runs:
            drafts, per_pos = 0, []
            for c in run.cells.values():
                if c.get("num_drafts") and c.get("accepted_per_position") and c["temperature"] == temps[0]:
                    drafts += c["num_drafts"]
                    vals = c["accepted_per_position"]
                    per_pos += [0] * (len(vals) - len(per_pos))
                    per_pos = [a + b for a, b in zip(per_pos, vals + [0] * (len(per_pos) - len(vals)))]
            if drafts:
                ax.plot(range(1, len(per_pos) + 1), [v / drafts for v in per_pos], marker="o", label=run.spec.label)
        ax.set(xlabel="draft position (depth)", ylabel="accepted at this position / drafts", ylim=(0, 1.05),
               title=f"acceptance per position, temperature {temps[0]:g}, all batch sizes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        files.append(out_dir / f"{args.tag}_acceptance.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)

    served = [s for s in serving if s["rates"]]
    if served:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for srv in served:
            pts = []
            for i, (rate, res) in enumerate(srv["rates"].items()):
                if "error" in res:
                    continue
                s = _summary(res)
                pts.append((rate, s["output_throughput"], s["tpot_median"]))
            if pts:
                xs = list(range(len(pts)))
                ax1.plot(xs, [p[1] for p in pts], marker="o", label=srv["engine"])
                ax2.plot(xs, [p[2] or 0 for p in pts], marker="o", label=srv["engine"])
                for ax in (ax1, ax2):
                    ax.set_xticks(xs, [p[0] for p in pts])
        ax1.set(xlabel="request rate (req/s)", ylabel="output tokens/s", title="serving throughput")
        ax2.set(xlabel="request rate (req/s)", ylabel="median TPOT (ms)", title="time per output token")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(out_dir / f"{args.tag}_serving.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _csv(kind):
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x.strip()]
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_vllm = ROOT / ".venv-vllm" / "bin" / "python"
    default_llamacpp = ROOT / ".venv-llamacpp" / "bin" / "python"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                        help="packaged name, HF folder or .gguf file (llamacpp needs a packaged name or a .gguf)")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct",
                        help="draft for the speculative engines ('' for none)")
    parser.add_argument("--engines", type=_csv(str),
                        default="pagedtree,pagedtree-spec,transformers,transformers-assisted,vllm,vllm-spec",
                        help="comma-separated, from pagedtree, pagedtree-int8, pagedtree-int4 (weight-only "
                             "quantized, straight from a packaged model's GGUF), pagedtree-q8, pagedtree-q4 (blocks of "
                             "32 with int8 activations, ONNX Runtime's kernels), pagedtree-ggml (the GGUF's own "
                             "blocks through ggml's kernels), pagedtree-batch (built for batches, as a server is), "
                             "pagedtree-spec, transformers, "
                             "transformers-assisted, vllm, vllm-spec, vllm-ngram, llamacpp (llama.cpp on the model's GGUF, "
                             "batch 1 only; from --llamacpp-python's venv), llamacpp-lookup (the same with "
                             "prompt-lookup speculation)")
    parser.add_argument("--pagedtree-quantization", default=None, choices=["int8", "int4", "q8", "q4", "ggml"],
                        help="quantize the pagedtree and pagedtree-spec engines (target and draft; labels get "
                             "@FORMAT); the pagedtree-FORMAT engines are unaffected")
    parser.add_argument("--spec-presets", type=_csv(str), default="chain-5,dynamic-16",
                        help="pagedtree tree presets for pagedtree-spec (see pagedtree.speculative.presets)")
    parser.add_argument("--vllm-spec-tokens", type=int, default=4, help="vLLM draft tokens per step")
    parser.add_argument("--batch-sizes", type=_csv(int), default="1,8")
    parser.add_argument("--temperatures", type=_csv(float), default="0")
    parser.add_argument("--dataset", choices=["coding", "prose", "edit", "random"], default="coding",
                        help="coding: eight chat-templated coding tasks; prose: eight prose/chat requests; "
                             "edit: rewrites with a small change and multi-turn chats that repeat earlier "
                             "answers; random: --input-len random tokens")
    parser.add_argument("--input-len", type=int, default=32, help="random prompts' length (and serving prompts')")
    parser.add_argument("--output-len", type=int, default=32, help="new tokens per request (EOS ignored)")
    parser.add_argument("--rounds-batch1", type=int, default=2, help="prompts timed one after another at batch 1")
    parser.add_argument("--repeats", type=int, default=1,
                        help="time every cell this many times in the same process and report the median")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="one dtype for every engine; auto = pagedtree's CPU default here (bfloat16 on "
                             "CPUs with native bf16, else float32)")
    parser.add_argument("--vllm-dtype", default=None, choices=["float32", "bfloat16"],
                        help="the vLLM engines' dtype (default: --dtype), e.g. vLLM in bf16 beside quantized "
                             "pagedtree engines in their own activation dtype; the label then says @DTYPE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-caching", action="store_true",
                        help="keep pagedtree's and vLLM's prefix caches on in the offline part (off by default: "
                             "the cells repeat the same prompts, and transformers has no such cache)")
    parser.add_argument("--vllm-python", default=str(default_vllm), help="Python of the vLLM environment")
    parser.add_argument("--vllm-reserved-cpus", type=int, default=None,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for vLLM (default: vLLM's own, which keeps 1 "
                             "core for its scheduler; 0 gives every core to the model)")
    parser.add_argument("--llamacpp-python", default=str(default_llamacpp),
                        help="Python of the llama.cpp environment (bash benchmarks/peers/setup_llamacpp.sh)")
    parser.add_argument("--llamacpp-lookup-tokens", type=int, default=2,
                        help="llamacpp-lookup: tokens drafted per step by llama-cpp-python's prompt lookup "
                             "(its documentation advises 2 on CPU-only machines, 10 on GPUs)")
    parser.add_argument("--llamacpp-threads", type=int, default=None,
                        help="llama.cpp's n_threads (default: every core; the label then says @threadsN)")
    parser.add_argument("--serve-rates", type=_csv(str), default=[],
                        help="request rates for the serving part, e.g. 0.5,1,inf (empty: skip)")
    parser.add_argument("--serve-engines", type=_csv(str), default="pagedtree,vllm")
    parser.add_argument("--keep-suffix-cache", action="store_true",
                        help="keep the suffix drafter's global tree of past outputs between the timings of a "
                             "cell (they repeat the same prompts: the later timings then measure repeated "
                             "requests); by default it is cleared before each timing")
    parser.add_argument("--serve-num-prompts", type=int, default=16)
    parser.add_argument("--engine-timeout", type=int, default=3600, help="seconds per engine run")
    parser.add_argument("--server-timeout", type=int, default=600, help="seconds for a server to start")
    parser.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "out"))
    parser.add_argument("--tag", default="compare", help="file name stem of the outputs")
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must be positive")
    if any(t < 0 for t in args.temperatures):
        parser.error("--temperatures must be >= 0")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.llamacpp_threads is not None and args.llamacpp_threads < 1:
        parser.error("--llamacpp-threads must be >= 1")
    if args.dtype == "auto":
        # Resolved once here so every engine (not only pagedtree) runs the same dtype.
        from pagedtree.loading.resolve import cpu_has_native_bf16

        args.dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    if args.vllm_dtype is None:
        args.vllm_dtype = args.dtype
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pagedtree.loading.loader import resolve_model_path

    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model_path(args.model)
    draft = resolve_model_path(args.draft_model) if args.draft_model else None
    specs, notes = engine_specs(args)
    prompts = build_prompts(args, model)
    workload = build_workload(args, prompts)
    workload_path = out_dir / f"{args.tag}_workload.json"
    workload_path.write_text(json.dumps(workload))

    runs = []
    for spec in tqdm(specs, desc="engines", unit="engine"):
        tqdm.write(f"[compare] {spec.label} ...")
        run = run_engine(args, spec, model, draft, workload_path, out_dir)
        tqdm.write(f"[compare] {spec.label}: {'failed: ' + run.error if run.error else 'done'} in {run.seconds:.0f} s")
        runs.append(run)

    serving = []
    for engine in args.serve_engines if args.serve_rates else []:
        if engine == "vllm" and not Path(args.vllm_python).exists():
            notes.append("serve vllm: skipped, no vLLM environment")
            continue
        tqdm.write(f"[compare] serving {engine} at rates {args.serve_rates} ...")
        serving.append(run_serving(args, engine, model, out_dir))

    import torch

    versions = {"torch": torch.__version__}
    for run in runs:
        if run.result:
            versions.update(run.result["info"]["versions"])
    header = (f"Model {args.model}" + (f", draft {args.draft_model}" if args.draft_model else "") +
              f"; {len(prompts)} {args.dataset} prompts (batch 1: the first {min(args.rounds_batch1, len(prompts))}, one "
              f"after another), {args.output_len} new tokens each (EOS ignored); "
              + (f"every cell timed {args.repeats} times, median shown; " if args.repeats > 1 else "") +
              f"prefix caching {'on' if args.prefix_caching else 'off'}; dtype {args.dtype}; {platform.machine()}, "
              f"{os.cpu_count()} CPUs; " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) +
              f".\nCommand: `python benchmarks/compare.py {shlex.join(sys.argv[1:] if argv is None else argv)}`")
    table = markdown_tables(args, runs, notes, serving, header)
    (out_dir / f"{args.tag}.md").write_text(table)
    plots = plot(args, runs, serving, out_dir)
    (out_dir / f"{args.tag}.json").write_text(json.dumps({
        "args": vars(args), "notes": notes,
        "runs": [{"label": r.spec.label, "error": r.error, "seconds": r.seconds, "result": r.result} for r in runs],
        "serving": serving}, indent=2, default=str))
    print(table)
    print("wrote", ", ".join(str(p) for p in [out_dir / f"{args.tag}.md", *plots]))
    return 0 if all(r.error is None for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
