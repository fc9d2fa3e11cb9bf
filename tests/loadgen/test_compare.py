"""benchmarks/compare.py end to end on the tiny model: every engine kind, tables, plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.loadgen.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare_run(tiny_text_model, tmp_path_factory):
    compare = load_benchmark("compare")
    out = tmp_path_factory.mktemp("compare")
    folder = str(tiny_text_model.path)
    argv = ["--model", folder, "--draft-model", folder,
            "--engines", "pagedtree,pagedtree-spec,transformers,transformers-assisted,vllm",
            "--spec-presets", "chain-3", "--batch-sizes", "1,2", "--temperatures", "0,0.8",
            "--output-len", "5", "--rounds-batch1", "1", "--repeats", "3", "--vllm-python", str(out / "no-vllm" / "python"),
            "--serve-rates", "4,inf", "--serve-engines", "pagedtree", "--serve-num-prompts", "4",
            "--input-len", "8", "--out-dir", str(out), "--tag", "t"]
    rc = compare.main(argv)
    return rc, out, compare


@pytest.mark.slow
def test_compare_writes_tables_json_and_plots(compare_run):
    rc, out, _ = compare_run
    assert rc == 0
    table = (out / "t.md").read_text()
    data = json.loads((out / "t.json").read_text())
    labels = [r["label"] for r in data["runs"]]
    assert labels == ["pagedtree", "pagedtree-spec:chain-3", "transformers", "transformers-assisted"]
    assert all(r["error"] is None for r in data["runs"])
    for run in data["runs"]:
        cells = run["result"]["cells"]
        assert {(c["batch_size"], c["temperature"]) for c in cells} == {(1, 0.0), (2, 0.0), (1, 0.8), (2, 0.8)}
        for c in cells:
            if c["skipped"]:
                # transformers' assisted generation runs at batch 1 only: reported, not dropped.
                assert run["label"] == "transformers-assisted" and c["batch_size"] == 2
                assert "batch 1 only" in table
            else:
                assert c["output_tokens"] == 5 * c["batch_size"] and c["tokens_per_s"] > 0
                # Timed three times; the reported figure is the median of the three.
                samples = c["repeat_tokens_per_s"]
                assert len(samples) == 3 and abs(c["tokens_per_s"] - sorted(samples)[1]) < 1e-2 * c["tokens_per_s"]
    spec_cells = data["runs"][1]["result"]["cells"]
    greedy = [c for c in spec_cells if c["temperature"] == 0]
    # The draft is the target itself: every drafted token is accepted under greedy decoding.
    assert all(c["num_drafts"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"] for c in greedy)
    assert sum(greedy[0]["accepted_per_position"]) == greedy[0]["num_accepted_tokens"]
    # Counters belong to the one timing reported, not to all three repeats together:
    # accepted draft tokens are a subset of that timing's output tokens.
    assert all(c["num_accepted_tokens"] < c["output_tokens"] for c in greedy)
    assert "vllm: skipped, no vLLM environment" in table
    assert "every cell timed 3 times, median shown" in table
    assert "| pagedtree-spec:chain-3 | 1 | 0 |" in table
    for name in ("throughput", "speedup", "acceptance", "serving"):
        assert (out / f"t_{name}.png").stat().st_size > 1000


@pytest.mark.slow
def test_compare_serving_part_counts_every_request(compare_run):
    _, out, _ = compare_run
    data = json.loads((out / "t.json").read_text())
    (serving,) = data["serving"]
    assert serving["engine"] == "pagedtree" and "error" not in serving
    assert set(serving["rates"]) == {"4", "inf"}
    for result in serving["rates"].values():
        summary = result["summary"]
        assert summary["completed"] == 4 and summary["failed"] == 0 and summary["total_requests"] == 4
        assert summary["total_output_tokens"] == 4 * 5


@pytest.mark.slow
def test_a_small_comparison_writes_its_table_and_json(tiny_text_model, tmp_path):
    """The default suite's comparison: two engines, one cell, one timing (the full
    matrix with peers, repeats, plots and serving runs under -m slow)."""
    compare = load_benchmark("compare")
    folder = str(tiny_text_model.path)
    rc = compare.main(["--model", folder, "--draft-model", folder, "--engines", "pagedtree,pagedtree-batch,pagedtree-spec",
                       "--spec-presets", "chain-3", "--batch-sizes", "1", "--temperatures", "0", "--output-len", "4",
                       "--rounds-batch1", "1", "--repeats", "1", "--serve-rates", "", "--input-len", "8",
                       "--out-dir", str(tmp_path), "--tag", "s"])
    assert rc == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["pagedtree", "pagedtree-batch", "pagedtree-spec:chain-3"]
    for run in data["runs"]:
        (cell,) = run["result"]["cells"]
        assert run["error"] is None and cell["output_tokens"] == 4 and cell["tokens_per_s"] > 0
    assert "| pagedtree-spec:chain-3 | 1 | 0 |" in (tmp_path / "s.md").read_text()


def test_acceptance_length_and_missing_draft_error():
    compare = load_benchmark("compare")
    assert compare.acceptance_length({"num_drafts": 4, "num_accepted_tokens": 6}) == 2.5
    assert compare.acceptance_length({"num_drafts": 0}) is None
    with pytest.raises(SystemExit, match="needs --draft-model"):
        compare.engine_specs(compare.parse_args(["--engines", "pagedtree-spec", "--draft-model", ""]))
    with pytest.raises(SystemExit):
        compare.parse_args(["--repeats", "0"])
    specs, _ = compare.engine_specs(compare.parse_args(["--engines", "pagedtree,pagedtree-eager", "--draft-model", ""]))
    assert [(s.label, s.eager) for s in specs] == [("pagedtree", False), ("pagedtree-eager", True)]
    (batch,), _ = compare.engine_specs(compare.parse_args(["--engines", "pagedtree-batch", "--model", "m.gguf"]))
    assert (batch.engine_workload, batch.model, batch.quantization) == ("batch", "m.gguf", None)


def test_peak_rss_counts_child_processes():
    """The engine runner's memory figure includes children (vLLM's engine core runs in one)."""
    import subprocess
    import sys
    import time

    runner = load_benchmark("engine_runner")
    with runner.PeakRss(interval=0.02) as alone:
        time.sleep(0.1)
    # A child that holds 200 MiB for a moment: measured once it says it holds them
    # (a loaded machine may take a while to start it).
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 * 2**20); print('held', "
                              "flush=True); time.sleep(1.0)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with runner.PeakRss(interval=0.02) as with_child:
            time.sleep(0.5)
    finally:
        child.wait()
    assert alone.peak_bytes > 0
    assert with_child.peak_bytes >= alone.peak_bytes + 150 * 2**20


def test_linear_rows_times_every_format_on_a_small_shape(tmp_path, monkeypatch):
    """The row-curve benchmark runs each format (a thin call into its library) and
    writes its table and plot."""
    pytest.importorskip("onnxruntime")
    module = load_benchmark("linear_rows")
    monkeypatch.setitem(module.SHAPES, "tiny", (256, 96))  # K-quants need rows of 256
    out = tmp_path / "rows.json"
    assert module.main(["--shapes", "tiny", "--rows", "1,2,16", "--reps", "2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    cells = results["cells"]
    # Every format ran, but those whose library is not installed (ggml, zentorch), named.
    skipped = results.get("skipped", {})
    assert {c["format"] for c in cells} | set(skipped) == set(module.FORMATS)
    assert all(name.startswith(("ggml", "zen")) for name in skipped), skipped
    assert all(len(c["ms"]) == 3 and c["rel_error"] < 0.2 for c in cells), cells
    assert out.with_suffix(".png").exists() and "| tiny | q4 |" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_llamacpp_engines_plain_and_prompt_lookup():
    """llama.cpp plain and with its own prompt-lookup speculation, on the model's GGUF:
    the lookup engine carries its draft length to the runner and is compared with the
    plain one."""
    from pagedtree.loading import packaged_models as pm

    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip("smollm2-135m-instruct not installed")
    compare = load_benchmark("compare")
    args = compare.parse_args(["--model", pm.SMOLLM2_135M.name, "--engines", "llamacpp,llamacpp-lookup",
                               "--llamacpp-python", sys.executable, "--llamacpp-lookup-tokens", "3"])
    specs, notes = compare.engine_specs(args)
    assert not notes
    plain, lookup = specs
    assert plain.label == "llamacpp:Q4_1" and plain.spec is None
    assert lookup.label == "llamacpp-lookup:3:Q4_1" and lookup.baseline == plain.label
    assert lookup.spec == {"prompt_lookup_tokens": 3} and lookup.model == plain.model


def test_vllm_dtype_apart_from_pagedtree(tmp_path):
    """--vllm-dtype runs the vLLM engines in their own dtype (e.g. bf16 beside q4), and
    their labels say so; without it every engine shares --dtype."""
    compare = load_benchmark("compare")
    base = ["--model", "m", "--engines", "vllm,pagedtree-q4", "--vllm-python", sys.executable, "--dtype", "float32"]
    args = compare.parse_args(base + ["--vllm-dtype", "bfloat16"])
    specs, notes = compare.engine_specs(args)
    assert not notes and [s.label for s in specs] == ["vllm@bfloat16", "pagedtree-q4"]
    same = compare.parse_args(base)
    assert same.vllm_dtype == "float32" and compare.engine_specs(same)[0][0].label == "vllm"
