"""The GPU-day check: one command that says whether pagedtree's CUDA path works here.

It runs, in order, and prints one table (check, case, result, figure, verdict):

1. kernels: the Triton attention kernel against a float64 reference, fp16 and bf16,
   with the tile shape the launch code picks on this GPU, over a matrix of query
   heads per KV head, block sizes, query runs (trees with a root, causal runs, a
   decode) and head dims;
2. dense: the batch-invariant products and norms of the real layer shapes, a row's
   bits alone and in batches of 1 to 2,080 rows, then their speed against cuBLAS
   and eager ops (``dense_check.py``);
3. graphs: greedy tokens with CUDA graphs against eager steps (plain decoding and
   tree speculation) on a tiny random Llama built in-process, and (sm_90 and later)
   with launches overlapping against launches one after another;
4. speculation: greedy tree speculation against plain decoding in bf16, token for token;
5. syncs: host-device syncs per speculative step (the engine's sync guard over torch's
   sync debug mode), one expected;
6. bench: tree/decode kernel time ratios from ``benchmarks/kernels.py``'s measurement.

It exits with status 1 when any row fails (2 on bad arguments). ``--device cpu`` runs
the same checks in small shapes under the Triton interpreter (started in a child
process when this one cannot switch it on), with a "skipped (no CUDA)" row for what
needs a GPU (graph capture, sync debug mode).

    python -m pagedtree.diagnostics.gpu_check                 # on a GPU: the full matrix
    python -m pagedtree.diagnostics.gpu_check --quick         # pairwise kernel matrix, shorter runs
    python -m pagedtree.diagnostics.gpu_check --device cpu --quick --json report.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedtree.diagnostics.report import Row, any_failed, failed_run, format_table, summary_line, write_json

CHECKS = ("kernels", "dense", "graphs", "speculation", "syncs", "bench")
KERNELS_MODULE = "pagedtree.kernels.triton_kernels"


@dataclass(frozen=True, slots=True)
class Settings:
    """What one run of the check does."""

    device: torch.device
    quick: bool
    checks: tuple[str, ...]
    workers: int
    seed: int = 0
    model: str | None = None
    draft_model: str | None = None
    progress: bool = True


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = argparse.ArgumentParser(prog=prog or "python -m pagedtree.diagnostics.gpu_check",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cuda, or cpu (the Triton interpreter, small shapes); auto: cuda when available")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced matrix: pairwise-covering kernel cases, fewer prompts and timing iterations")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table (with per-case detail) here")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all, in that order)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes for the kernel cases, whose compiles overlap (default: up to 8 on "
                             "CUDA, 1 on CPU)")
    parser.add_argument("--model", default=None,
                        help="target model for the engine checks (a packaged name or a folder; default: a tiny "
                             "random Llama built in-process)")
    parser.add_argument("--draft-model", default=None, help="its draft (default: the tiny model's perturbed "
                                                            "copy, or --model itself)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cases, models and prompts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_checks(text: str) -> tuple[str, ...]:
    """The selected checks in the canonical order (ValueError naming an unknown one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise ValueError(f"unknown check(s) {unknown}; choose from {','.join(CHECKS)}")
    return tuple(n for n in CHECKS if n in names)


def resolve_device(name: str) -> str:
    """``cuda`` or ``cpu`` for ``--device`` (ValueError for cuda without a GPU)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu for the interpreter)")
    return name


def default_workers(device_type: str) -> int:
    """Kernel-case processes: up to 8 (half the cores) on CUDA, 1 in the interpreter."""
    if device_type != "cuda":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def interpreter_ready(device_type: str) -> bool:
    """Whether ``TRITON_INTERPRET`` is as the device needs it (on for cpu, off for cuda)."""
    return (os.environ.get("TRITON_INTERPRET") == "1") == (device_type == "cpu")


def prepare_interpreter(device_type: str) -> bool:
    """Switch Triton's interpreter on (cpu) or off (cuda) for this process; False when
    that is no longer possible (the kernels are defined already: a child must run)."""
    if interpreter_ready(device_type):
        return True
    if KERNELS_MODULE in sys.modules:
        return False
    if device_type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    return True


def run_in_child(argv: Sequence[str], device_type: str) -> int:
    """Run the check in a new Python process with the interpreter set for the device."""
    env = dict(os.environ)
    if device_type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "pagedtree.diagnostics.gpu_check", *argv]
    return subprocess.run(command, env=env, check=False).returncode


def environment(device: torch.device) -> dict:
    """The machine and the versions the report was made with."""
    import triton

    info = dict(device=str(device), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), triton_interpret=os.environ.get("TRITON_INTERPRET", ""))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"sm_{props.major}{props.minor}",
                    multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info.update(name=f"CPU ({platform.machine()}), Triton interpreter")
    return info


def header(info: dict, settings: Settings) -> str:
    """The line printed above the table."""
    where = info["name"] + (f", {info['capability']}, {info['multiprocessors']} SMs" if "capability" in info else "")
    matrix = "quick matrix" if settings.quick else "full matrix"
    return f"# pagedtree GPU-day check on {where}; torch {info['torch']}, triton {info['triton']}; {matrix}"


class EngineModels:
    """The engine checks' models, made on first use: a tiny random pair in a
    temporary folder, or the models named on the command line."""

    def __init__(self, settings: Settings, stack: contextlib.ExitStack):
        self.settings = settings
        self._stack = stack
        self._setup = None
        self._runs = None

    def setup(self):
        """The ``EngineSetup`` of the engine checks."""
        from pagedtree.diagnostics.engine_checks import engine_setup
        from pagedtree.diagnostics.tiny_models import CPU_SHAPE, CUDA_SHAPE, save_model_pair

        if self._setup is None:
            s = self.settings
            if s.model is not None:
                target, draft = s.model, s.draft_model or s.model
            else:
                folder = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedtree-gpu-check-"))
                shape = CUDA_SHAPE if s.device.type == "cuda" else CPU_SHAPE
                pair = save_model_pair(folder, shape, s.seed)
                target, draft = str(pair.target), s.draft_model or str(pair.draft)
            self._setup = engine_setup(s.device.type, s.quick, target, draft, s.seed)
        return self._setup

    def runs(self):
        """The greedy runs shared by the graph and speculation checks."""
        from pagedtree.diagnostics.engine_checks import EngineRuns

        if self._runs is None:
            self._runs = EngineRuns(self.setup())
        return self._runs


def check_functions(settings: Settings, models: EngineModels,
                    progress: Callable[[str], None]) -> dict[str, Callable[[], list[Row]]]:
    """Each check's function, by name; ``progress`` takes a short status text."""
    from pagedtree.diagnostics import dense_check, engine_checks, kernel_bench, kernel_check, sync_check

    def kernels() -> list[Row]:
        return kernel_check.check_kernels(settings.device, settings.quick, settings.workers, settings.seed,
                                          progress=lambda done, total: progress(f"kernels {done}/{total}"))

    return {
        "kernels": kernels,
        "dense": lambda: dense_check.dense_rows(settings.device, settings.quick, settings.seed),
        "graphs": lambda: engine_checks.graph_rows(models.runs()) + engine_checks.overlap_rows(models.runs()),
        "speculation": lambda: engine_checks.speculation_rows(models.runs()) + engine_checks.flashinfer_rows(
            models.runs()),
        "syncs": lambda: sync_check.sync_rows(models.setup(), settings.quick),
        "bench": lambda: kernel_bench.bench_rows(settings.device, settings.quick, settings.seed),
    }


CHECK_TITLES = {"kernels": "kernel vs reference", "dense": "dense kernels", "graphs": "cuda graphs vs eager",
                "speculation": "speculative vs plain", "syncs": "syncs per step", "bench": "tree/decode kernel time"}


def run_checks(settings: Settings, seconds: dict[str, float] | None = None) -> list[Row]:
    """Every selected check in order, one progress bar over them; a check that raises
    becomes a failing row and the others still run. ``seconds`` gets each check's
    wall time."""
    from tqdm.auto import tqdm

    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        models = EngineModels(settings, stack)
        bar = stack.enter_context(tqdm(total=len(settings.checks), desc="gpu check", unit="check",
                                       file=sys.stderr, disable=not settings.progress))
        functions = check_functions(settings, models, bar.set_postfix_str)
        for name in settings.checks:
            bar.set_postfix_str(name)
            started = time.perf_counter()
            try:
                rows += functions[name]()
            except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
                rows.append(failed_run(CHECK_TITLES[name], "-", exc))
            if seconds is not None:
                seconds[name] = round(time.perf_counter() - started, 2)
            bar.update(1)
    return rows


def settings_from(args: argparse.Namespace, device_type: str) -> Settings:
    """``Settings`` from parsed arguments."""
    workers = args.workers if args.workers is not None else default_workers(device_type)
    if workers < 1:
        raise ValueError("--workers must be >= 1")
    return Settings(device=torch.device(device_type), quick=args.quick, checks=parse_checks(args.checks),
                    workers=workers, seed=args.seed, model=args.model, draft_model=args.draft_model,
                    progress=not args.no_progress)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Run the check; 0 when every row passed (or was skipped or informational),
    1 when any failed, 2 on bad arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        device_type = resolve_device(args.device)
        settings = settings_from(args, device_type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not prepare_interpreter(device_type):
        return run_in_child(argv, device_type)
    started = time.perf_counter()
    info = environment(settings.device)
    print(header(info, settings), flush=True)
    check_seconds: dict[str, float] = {}
    rows = run_checks(settings, check_seconds)
    seconds = time.perf_counter() - started
    print(format_table(rows))
    print(summary_line(rows, seconds), flush=True)
    if args.json:
        write_json(args.json, rows, info | dict(quick=settings.quick, checks=list(settings.checks),
                                                check_seconds=check_seconds), seconds)
    return 1 if any_failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
