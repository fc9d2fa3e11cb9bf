"""The GPU-day check (``pagedtree.diagnostics``) on a CPU: its check functions in the
smallest shapes under the Triton interpreter, a planted wrong kernel failing it, and
the command end to end (``--device cpu --quick``, slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pagedtree.diagnostics import dense_check, engine_checks, gpu_check, kernel_bench, kernel_check, sync_check  # noqa: E402
from pagedtree.diagnostics.kernel_check import KernelCase, KernelMatrix  # noqa: E402
from pagedtree.diagnostics.reference import paged_reference  # noqa: E402
from pagedtree.diagnostics.report import FAIL, INFO, PASS, SKIPPED, Row, format_table  # noqa: E402

CPU = torch.device("cpu")
# The Triton kernels on CPU tensors, in Triton's interpreter.
INTERPRETER = pytest.mark.triton_interpreter
ROOT = Path(__file__).resolve().parents[1]
# The smallest matrix that still has a padded group (3 of 4 heads) and both dtypes.
TINY_MATRIX = KernelMatrix(("fp16", "bf16"), (1, 3), (16,), (5,), (16,), cover="pairwise")


@pytest.fixture
def tiny_checks(monkeypatch):
    """The check's CPU sizes cut to the smallest: two kernel cases, one short prompt,
    one context of the benchmark."""
    monkeypatch.setattr(kernel_check, "CPU_QUICK", TINY_MATRIX)
    small_setup = engine_checks.engine_setup

    def setup(device_type, quick, target, draft, seed=0):
        full = small_setup(device_type, quick, target, draft, seed)
        return engine_checks.EngineSetup(full.target, full.draft, full.device, full.prompts[:1], 4, 1, 32,
                                         speculative=full.speculative)

    monkeypatch.setattr(engine_checks, "engine_setup", setup)
    monkeypatch.setattr(kernel_bench, "bench_plan", lambda device_type, quick: kernel_bench.BenchPlan(
        1, (40,), (16,), 2, 1, 16, 16, torch.float32, warmup=0, iters=1))


def test_the_reference_agrees_with_the_torch_backend():
    """The diagnostics' float64 reference and the engine's torch backend (the tests'
    reference) give the same attention on a tree, a causal run and a decode."""
    from pagedtree.attention import torch_backend
    from pagedtree.step_data import AttentionMetadata

    case = KernelCase("fp16", 3, 16, 7, 16, tree_prefix=21)
    step = kernel_check.build_step(case, CPU)
    q, k, v = step.query.float(), step.key_cache.float(), step.value_cache.float()
    meta = AttentionMetadata(16, torch.zeros(step.query.shape[0], dtype=torch.long), step.query_start_loc,
                             step.context_lens, step.block_tables, step.tree_parents)
    expected = torch_backend.paged_attention(q, k, v, torch_backend.build_reference_plan(meta), step.scale)
    got = paged_reference(q, k, v, step.query_start_loc, step.context_lens, step.block_tables,
                          step.tree_parents, step.scale)
    torch.testing.assert_close(got.float(), expected, atol=1e-5, rtol=1e-5)


@INTERPRETER
@pytest.mark.parametrize("dtype,group", [("fp16", 1), ("bf16", 3)])
def test_a_kernel_case_passes_with_the_default_tile(dtype, group):
    result = kernel_check.run_case(KernelCase(dtype, group, 16, 5, 16, tree_prefix=21), CPU)
    assert result.error is None and result.ok, result
    assert 0 < result.max_error <= result.tolerance and result.tile


def test_case_matrices():
    full = kernel_check.kernel_cases(kernel_check.CUDA_FULL)
    assert len(full) == 2 * 8 * 2 * 4 * 2
    assert {c.group for c in full} == set(range(1, 9)) and {c.query_len for c in full} == {16, 17, 64, 65}
    assert 0 < sum(c.tree_prefix == 700 for c in full) < len(full)  # split-KV and single-segment launches
    quick = kernel_check.kernel_cases(kernel_check.CUDA_QUICK)
    assert len(quick) < len(full) // 4
    pairs = {(c.group, c.query_len) for c in quick} | {(c.dtype, c.head_dim) for c in quick}
    assert len(pairs) == 8 * 4 + 2 * 2  # every pair of two dimensions' values is covered


@INTERPRETER
def test_a_planted_wrong_kernel_fails_the_check_and_the_exit_status(monkeypatch, tiny_checks, tmp_path, capsys):
    from pagedtree.kernels import triton_ops

    real = triton_ops.unified_attention

    def wrong(query, *args, **kwargs):
        out = real(query, *args, **kwargs)
        out[-1, 0, 0] += 0.25  # one element of the decode's first head
        return out

    monkeypatch.setattr(triton_ops, "unified_attention", wrong)
    rows = kernel_check.check_kernels(CPU, quick=True)
    assert rows and all(row.verdict == FAIL for row in rows)
    report = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--quick", "--checks", "kernels", "--no-progress",
                           "--json", str(report)])
    assert code == 1
    data = json.loads(report.read_text())
    assert data["passed"] is False and {row["verdict"] for row in data["rows"]} == {FAIL}
    assert "FAILED" in capsys.readouterr().out


@INTERPRETER
def test_a_product_whose_rows_depend_on_the_batch_fails_the_dense_check(monkeypatch):
    """A planted batch-dependent product (one row's bits nudged when it shares a launch
    with others) fails its shape's row; the honest kernels pass."""
    from pagedtree.kernels import dense_ops

    # The rotating q/k/v row has a planted-fault test of its own (below).
    monkeypatch.setattr(dense_check, "_rotary_epilogue_row", lambda device, gen: Row(
        dense_check.CHECK, "rotating q/k/v", "not run here", "-", PASS))
    honest = dense_check.invariance_rows(CPU, quick=True)
    assert [row.verdict for row in honest] == [PASS] * len(honest)
    real = dense_ops.invariant_linear

    def batch_dependent(x, weight, bias, config, split=None, rotary=None):
        out = real(x, weight, bias, config, split, rotary)
        if out.shape[0] > 1 and rotary is None:
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf"), dtype=out.dtype))
        return out

    monkeypatch.setattr(dense_ops, "invariant_linear", batch_dependent)
    rows = dense_check.invariance_rows(CPU, quick=True)
    products = len(dense_check.TINY)
    assert [row.verdict for row in rows[:products]] == [FAIL] * products
    assert "differ" in rows[0].result


@INTERPRETER
def test_an_epilogue_rotation_that_differs_from_the_rotary_kernel_fails_the_dense_check(monkeypatch):
    """A planted fault in the rotating q/k/v product (one element nudged when it
    rotates in its epilogue) fails that row (the honest kernel passes it in the whole
    check below)."""
    from pagedtree.kernels import dense_ops

    real = dense_ops.invariant_linear

    def off_by_one(x, weight, bias, config, split=None, rotary=None):
        out = real(x, weight, bias, config, split, rotary)
        if rotary is not None:
            out[-1, -1] = torch.nextafter(out[-1, -1], torch.tensor(float("inf"), dtype=out.dtype))
        return out

    monkeypatch.setattr(dense_ops, "invariant_linear", off_by_one)
    row = dense_check._rotary_epilogue_row(CPU, torch.Generator().manual_seed(0))
    assert row.verdict == FAIL and "epilogue" in row.case and "differ" in row.result


def test_a_library_that_does_not_run_is_a_finding_not_a_failure():
    """The glue rows time each library's version where it runs and name the ones that
    did not, beside ours and eager."""
    found = dense_check._alternatives(CPU, {"works": lambda: (lambda: None),
                                            "missing": lambda: __import__("no_such_library")})
    assert isinstance(found["works"], float) and found["missing"].startswith("ModuleNotFoundError")
    result, figure, detail = dense_check._versus(2e-6, 4e-6, found, "")
    assert result.startswith("2.0 us (eager 4.0 us; works ") and "missing did not run" in result
    assert figure.startswith("2.00x eager, ") and figure.endswith("x works")
    assert detail["libraries"] is found


@INTERPRETER
def test_flashinfer_in_the_engine_gives_its_tokens_beside_the_triton_kernels(tmp_path, monkeypatch):
    """Where FlashInfer runs (its stand-in here, on the GPU model's head dim 64), its
    plain tokens are set against the Triton kernels' and its speculation against its
    plain decoding, informational; without it the row says why it was skipped."""
    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention
    from pagedtree.diagnostics.tiny_models import CUDA_SHAPE, save_model_pair
    from tests.attention import fake_flashinfer

    pair = save_model_pair(str(tmp_path), CUDA_SHAPE, 0)
    setup = engine_checks.engine_setup("cpu", True, str(pair.target), str(pair.draft))
    assert [row.verdict for row in engine_checks.flashinfer_rows(engine_checks.EngineRuns(setup))] == [SKIPPED]
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(FlashInferPagedAttention, "unavailable", classmethod(lambda cls, device, dtype: None))
    rows = engine_checks.flashinfer_rows(engine_checks.EngineRuns(setup))
    assert [row.verdict for row in rows] == [INFO, INFO]
    assert all("tokens equal" in row.result for row in rows), [row.result for row in rows]
    assert rows[1].detail["draft_tokens"] > 0


@INTERPRETER
def test_overlapping_launches_are_switched_on_for_their_runs_only(tmp_path, monkeypatch):
    """Where a GPU can overlap launches, the check builds and runs one engine with
    them on and one with them off (the switch set for each whole run, graphs
    included) and sets their tokens side by side; elsewhere the row is skipped."""
    from pagedtree.diagnostics.tiny_models import CPU_SHAPE, save_model_pair
    from pagedtree.kernels import launch_overlap

    pair = save_model_pair(str(tmp_path), CPU_SHAPE, 0)
    setup = engine_checks.engine_setup("cpu", True, str(pair.target), str(pair.draft))
    assert [row.verdict for row in engine_checks.overlap_rows(engine_checks.EngineRuns(setup))] == [SKIPPED]
    monkeypatch.setattr(launch_overlap, "supported", lambda device: True)
    monkeypatch.setattr(launch_overlap, "active", lambda device: False)  # the interpreter runs no PTX
    seen, make_llm = [], engine_checks.make_llm
    monkeypatch.setattr(engine_checks, "make_llm", lambda *a, **k: seen.append(launch_overlap.enabled()) or
                        make_llm(*a, **k))
    rows = engine_checks.overlap_rows(engine_checks.EngineRuns(setup))
    assert [row.check for row in rows] == ["overlapping launches"] * 2
    assert [row.verdict for row in rows] == [PASS, PASS], [row.result for row in rows]
    assert seen == [False, True, False, True] and not launch_overlap.enabled()


@INTERPRETER
def test_the_whole_check_in_process(tiny_checks, tmp_path, capsys):
    """Every check in the smallest shapes: kernels and engine runs pass, graph capture
    and the sync count are skipped without CUDA, the timings are informational."""
    report = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--quick", "--no-progress", "--json", str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [Row(**row) for row in json.loads(report.read_text())["rows"]]
    by_check = {}
    for row in rows:
        by_check.setdefault(row.check, []).append(row.verdict)
    assert by_check == {
        "kernel vs reference": [PASS, PASS],
        "cuda graphs vs eager": [PASS, PASS, SKIPPED],
        "overlapping launches": [SKIPPED],  # sm_90 and later
        "async vs ordered steps": [PASS],
        "speculative vs plain": [PASS, PASS],
        "FlashInfer in the engine": [SKIPPED],  # CUDA only
        "syncs per step": ([PASS] if sync_check.default_recorder(CPU)[0] == "SyncGuard" else []) + [SKIPPED],
        # products, norm, rotating q/k/v; then speed: products x 2 row counts, the
        # rotating q/k/v, norm and rotary at 1 row (a GPU: 1 and 64)
        "dense kernels": [PASS] * (len(dense_check.TINY) + 2) + [INFO] * (2 * len(dense_check.TINY) + 1 + 2),
        "tree/decode kernel time": [INFO, INFO],  # decode and tree
    }, out
    assert "skipped (no CUDA)" in out and "PASSED" in out
    assert format_table(rows).splitlines()[0].split() == ["check", "case", "result", "figure", "verdict"]


def test_token_comparison_names_the_first_difference():
    ref = engine_checks.RunResult(tokens=[[5, 6, 7], [8, 9]], gaps=[[1.0, 2.0, 3.0], [0.5, 0.01]])
    assert engine_checks.compare_tokens(ref, ref).same
    other = engine_checks.RunResult(tokens=[[5, 6, 7], [8, 4]], gaps=[[], []])
    comparison = engine_checks.compare_tokens(ref, other)
    assert not comparison.same and comparison.first_difference == (1, 1) and comparison.gap == 0.01
    assert comparison.describe() == "4/5 equal; prompt 1 differs at token 1, top-2 gap 0.01"


def test_sync_rows_pass_at_one_sync_per_step():
    one = [sync_check.StepSyncs(window=1, whole=3)] * 3
    assert sync_check.sync_row("x", one).verdict == PASS
    assert sync_check.sync_row("x", one + [sync_check.StepSyncs(2, 4)]).verdict == FAIL
    assert sync_check.sync_row("x", []).verdict == FAIL


@INTERPRETER
def test_the_sync_count_window_holds_the_readback(tmp_path):
    """The window from the target's execute to its readback sees exactly the
    readback's one sync per step; the whole step also sees the draft levels' reads.
    On a CPU the recorder is the sync guard's stand-in (calls that would sync on a GPU)."""
    from pagedtree import SamplingParams
    from pagedtree.diagnostics.tiny_models import CPU_SHAPE, save_model_pair

    pair = save_model_pair(tmp_path, CPU_SHAPE)
    setup = engine_checks.engine_setup("cpu", True, str(pair.target), str(pair.draft))
    llm = engine_checks.make_llm(setup, speculative=True, graphs=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        source, recorder = sync_check.default_recorder(CPU)
        if source != "SyncGuard":
            pytest.skip("no sync guard in this checkout (the debug-mode warnings need CUDA)")
        counts = sync_check.count_step_syncs(llm, setup.prompts[:1], params, steps=2, recorder=recorder)
    finally:
        engine_checks.release(llm)
    assert len(counts) == 2
    assert all(c.window == 1 and c.whole > c.window for c in counts), counts
    assert all("read_back" in c.window_syncs[0] for c in counts), counts


def test_doctor_forwards_to_the_check(monkeypatch):
    from pagedtree.entrypoints import cli

    seen = []
    monkeypatch.setattr(gpu_check, "main", lambda argv, prog=None: seen.append((argv, prog)) or 0)
    assert cli.main(["doctor", "--gpu", "--device", "cpu", "--quick"]) == 0
    assert seen == [(["--device", "cpu", "--quick"], "pagedtree doctor --gpu")]
    assert cli.main(["doctor"]) == 2


def test_the_interpreter_switch(monkeypatch):
    import pagedtree.kernels.triton_kernels  # noqa: F401 - the kernels are defined

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_check.prepare_interpreter("cpu")
    assert not gpu_check.prepare_interpreter("cuda")  # the kernels are defined: a child process must run
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_help(capsys):
    from pagedtree.entrypoints import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["doctor", "--gpu", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: pagedtree doctor --gpu" in out and "--quick" in out and "--json" in out
    assert cli.main(["doctor", "--help"]) == 0 and "--gpu" in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert gpu_check.main(["--checks", "kernels,nothing"]) == 2
    assert "unknown check" in capsys.readouterr().err


@pytest.mark.slow
def test_the_script_answers_help():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The GPU-day check") and "usage:" in proc.stdout and "--device" in proc.stdout


@pytest.mark.parametrize(("script", "words"), [("gpu_day.sh", ["OUTDIR", ".flashinfer/site"]),
                                                ("pack_flashinfer.sh", ["FlashInfer 0.5.3", "PYTHONPATH"]),
                                                ("pack_gpu_wheels.sh", ["xgrammar", "OUTDIR", "PYTHONPATH"])])
def test_the_gpu_day_scripts_answer_help_without_running(script, words):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(word in proc.stdout for word in words) and "set -" not in proc.stdout


@pytest.mark.slow
def test_the_script_end_to_end(tmp_path):
    """``scripts/gpu_check.sh --device cpu --quick`` in a fresh process: exit 0 and
    the JSON table."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the check switches it on
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--quick",
                           "--no-progress", "--json", str(report)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["passed"] and data["environment"]["triton_interpret"] == "1"
    assert {row["check"] for row in data["rows"]} == set(gpu_check.CHECK_TITLES.values())


def test_a_graph_run_without_captured_graphs_fails_on_cuda():
    eager = engine_checks.RunResult(tokens=[[5, 6]], gaps=[[1.0, 1.0]])
    fell_back = engine_checks.RunResult(tokens=[[5, 6]], gaps=[[1.0, 1.0]], graph_steps=0, graphs_active=False)
    assert engine_checks._graph_row("decode", eager, fell_back, cuda=True).verdict == FAIL
    replayed = engine_checks.RunResult(tokens=[[5, 6]], gaps=[[1.0, 1.0]], graph_steps=3, graphs_captured=1,
                                       graphs_active=True)
    assert engine_checks._graph_row("decode", eager, replayed, cuda=True).verdict == PASS


@INTERPRETER
@pytest.mark.slow
def test_kernel_cases_in_worker_processes():
    """The process pool the GPU run compiles in: same results, in the cases' order."""
    cases = kernel_check.kernel_cases(TINY_MATRIX)
    results = kernel_check.run_cases(cases, CPU, workers=2)
    assert [r.case for r in results] == cases and all(r.ok for r in results)


@pytest.mark.slow
def test_a_child_process_runs_when_the_interpreter_cannot_be_switched_here():
    assert gpu_check.run_in_child(["--checks", "nothing"], "cpu") == 2


def crash_or_hang(case):
    """A worker function for the isolation test: dies on "die", hangs on "hang"."""
    if case == "die":
        os._exit(3)
    if case == "hang":
        time.sleep(600)
    return case * 10


@pytest.mark.slow
def test_a_case_that_kills_or_hangs_its_worker_fails_alone():
    from pagedtree.diagnostics.case_workers import run_in_workers

    results = run_in_workers(crash_or_hang, [1, "die", 2, "hang", 3, 4], workers=2,
                             on_failure=lambda case, why: why, timeout_s=5)
    assert results[0] == 10 and results[2] == 20 and results[4:] == [30, 40]
    assert results[1] == "worker process died (exit code 3)" and results[3] == "timed out after 5 s"
