"""The GPU benchmark and the product kernel's tile sweep as CI can take them: their
``--device cpu --tiny`` dry runs, every section end to end on tiny random-weight
models with the Triton kernels in the interpreter (the figures mean nothing here; the
code paths a GPU run takes are the same)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.loadgen.conftest import load_benchmark

pytestmark = pytest.mark.triton_interpreter


def test_the_gpu_bench_dry_run_gives_every_section(tmp_path):
    bench = load_benchmark("gpu_bench")
    out = tmp_path / "bench.json"
    code = bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out),
                       "--sections", "plain,speculation,suffix,llama8b,transformers"])
    report = json.loads(out.read_text())
    assert code == 0, report
    sections = {f["section"] for f in report["figures"]}
    assert sections == {"plain", "speculation", "suffix", "llama8b", "transformers"}
    spec = [f for f in report["figures"] if f["section"] == "speculation"]
    # Each speculative step's cost is against the plain step of its batch, with the
    # speed-up at the acceptance lengths measured on CPU.
    whole = [f for f in spec if "level by level" not in f["case"] and "a graph per level" not in f["case"]]
    # (A step's time is the difference of two timed generations: on a tiny CPU model
    # noise can give it any sign, so the dry run checks that each figure was measured.)
    assert len(whole) == 2 and all(math.isfinite(f["detail"]["vs_plain"]) and "CPU's acceptance" in f["versus"]
                                   for f in whole)
    # And each drafted level by level in the same engine, against its whole drafts.
    by_level = [f for f in spec if "level by level" in f["case"]]
    assert len(by_level) == 2 and all(math.isfinite(f["detail"]["whole_speedup"]) for f in by_level)
    # And with a graph per level against the whole draft's two graphs (here, one
    # uncaptured static program in two parts).
    per_level = [f for f in spec if "a graph per level" in f["case"]]
    assert len(per_level) == 2 and all(math.isfinite(f["detail"]["one_graph_speedup"]) for f in per_level)
    # with the host's fill of a level's buffers timed where whole drafts ran
    assert any(f["detail"]["fill_seconds_per_level"] > 0 for f in per_level)
    # (The tiny chain's short generations draft once each, from the prompt: too long a
    # catch-up for a padded step; the tree's later drafts run as one program.)
    assert any(f["detail"]["one_program_drafts"] > 0 for f in per_level)


def test_the_flashinfer_section_times_both_backends_in_one_run(tmp_path, monkeypatch):
    """Where FlashInfer runs (here its stand-in, on CPU), plain decoding is timed with
    it attending and with the Triton kernels, both eager; where it does not, the
    section says why."""
    from tests.attention import fake_flashinfer
    from pagedtree.attention.flashinfer_backend import FlashInferPagedAttention

    bench = load_benchmark("gpu_bench")
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out), "--sections",
                       "flashinfer"]) == 0
    skipped = json.loads(out.read_text())["figures"]
    assert [f["case"] for f in skipped] == ["skipped"] and "CUDA" in skipped[0]["versus"]
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(FlashInferPagedAttention, "unavailable", classmethod(lambda cls, device, dtype: None))
    assert bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out), "--sections",
                       "flashinfer"]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert [f["case"] for f in figures] == ["1.5B, batch 1, eager steps"]
    assert all(math.isfinite(f["detail"]["flashinfer"]["step_seconds"])
               and math.isfinite(f["detail"]["triton"]["step_seconds"])
               for f in figures)


def test_the_tiles_section_times_each_key_tile_rule_with_the_rule_in_force(tmp_path, monkeypatch):
    """An engine per rule, timed while the rule holds (its graphs are captured under it);
    the launch code's own rule back in place afterwards."""
    from pagedtree.kernels import tiles

    bench = load_benchmark("gpu_bench")
    seen = []
    step_time = bench.Runner.step_time

    def recording(self, llm, batch, vocab):
        seen.append((tiles.SM90_KEY_TILES, tiles.SM90_WIDE_WAVE))
        return step_time(self, llm, batch, vocab)

    monkeypatch.setattr(bench.Runner, "step_time", recording)
    shipped = (tiles.SM90_KEY_TILES, tiles.SM90_WIDE_WAVE)
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out), "--sections", "tiles"]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert [f["case"] for f in figures] == [f"{rule}, batch 1" for rule in bench.TILE_RULES]
    assert seen == [shipped, (shipped[0], 1e9), ((), shipped[1])]
    assert (tiles.SM90_KEY_TILES, tiles.SM90_WIDE_WAVE) == shipped


def test_the_overlap_section_times_each_setting_with_it_in_force(tmp_path, monkeypatch):
    """Launches one after another, then overlapping: an engine each (the 1.5B at every
    batch, the draft alone, a chain-4 step), timed while the switch holds; the
    process's own setting back afterwards."""
    from pagedtree.kernels import launch_overlap

    bench = load_benchmark("gpu_bench")
    seen = []
    step_time = bench.Runner.step_time

    def recording(self, llm, batch, vocab):
        seen.append(launch_overlap.enabled())
        return step_time(self, llm, batch, vocab)

    monkeypatch.setattr(bench.Runner, "step_time", recording)
    before = launch_overlap.enabled()
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--tiny", "--no-progress", "--json", str(out), "--sections",
                       "overlap"]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert [f["case"] for f in figures] == [f"{case}, launches overlapping" for case in (
        "1.5B, batch 1", "0.5B draft alone, batch 1", "chain-4, batch 1")]
    assert seen == [False] * 3 + [True] * 3 and launch_overlap.enabled() == before
    assert all(math.isfinite(f["detail"]["apart"]["step_seconds"])
               and math.isfinite(f["detail"]["overlapping"]["step_seconds"])
               for f in figures)


def test_a_bad_section_or_acceptance_is_refused(capsys):
    bench = load_benchmark("gpu_bench")
    with pytest.raises(SystemExit):
        bench.parse_args(["--sections", "plain,nope"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--acceptance", "chain-4"])
    assert "unknown sections" in capsys.readouterr().err


def test_the_attention_tile_sweep_dry_run(tmp_path, capsys):
    """Every variant of the default tile is timed and checked against the default's
    output; the default first, as the baseline of each workload."""
    sweep = load_benchmark("attention_sweep")
    out = tmp_path / "attention.json"
    code = sweep.main(["--device", "cpu", "--quick", "--no-progress", "--contexts", "80", "--tile-n", "16,64",
                       "--split-factors", "1,2", "--warps", "default", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 0
    assert len(rows) == 2 * 4  # decode and a 16-node tree, the default and 3 variants each
    assert all(not r["wrong"] and r["microseconds"] > 0 for r in rows)
    assert [r["default"] for r in rows[:4]] == [True, False, False, False]
    assert "best tile per workload" in capsys.readouterr().out


def test_the_attention_sweep_times_flashinfer_beside_the_tiles(tmp_path, capsys, monkeypatch):
    """FlashInfer's rows run through the engine's backend on the workload's cache and
    plan, and are checked against the default tile: here the stand-in that reads
    FlashInfer's arguments as its documentation does (a GPU runs FlashInfer)."""
    from tests.attention import fake_flashinfer

    sweep = load_benchmark("attention_sweep")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(sweep, "want_flashinfer", lambda choice, device: True)
    out = tmp_path / "attention.json"
    code = sweep.main(["--device", "cpu", "--quick", "--no-progress", "--contexts", "80", "--head-dim", "64",
                       "--tile-n", "16", "--split-factors", "1", "--warps", "default", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 0
    theirs = [(r["nodes"], r["kernel"]) for r in rows if r["kernel"] != "triton"]
    assert theirs == [(1, "flashinfer-decode"), (1, "flashinfer-decode-tc"), (16, "flashinfer-prefill")]
    assert all(not r["wrong"] and r["microseconds"] > 0 for r in rows)
    assert "FlashInfer's fastest" in capsys.readouterr().out


def test_the_tile_sweep_dry_run(tmp_path):
    sweep = load_benchmark("dense_sweep")
    out = tmp_path / "sweep.json"
    assert sweep.main(["--device", "cpu", "--tiny", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results and all(r["seconds"] and r["error"] is None for r in results)
