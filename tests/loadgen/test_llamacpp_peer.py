"""compare.py's optional llama.cpp engine, without llama.cpp: which GGUF it gets, the
skip notes, the runner's command line, and the runner's token loop on a stand-in
``llama_cpp`` module (no model is loaded)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from pagedtree.loading import packaged_models as pm
from tests.loadgen.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare():
    return load_benchmark("compare")


def _gguf(path: Path, file_type: int) -> Path:
    """A GGUF file with metadata only (no tensors): enough for the quantization label."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fake_python(tmp_path: Path) -> Path:
    """A stand-in interpreter that records its command line and exits 0."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path / "argv.txt"}\n')
    python.chmod(0o755)
    return python


def test_llamacpp_skipped_with_a_note_without_its_venv(compare, tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    args = compare.parse_args(["--model", "smollm2-135m-instruct", "--draft-model", "", "--engines",
                               "llamacpp", "--llamacpp-python", str(missing)])
    specs, notes = compare.engine_specs(args)
    assert specs == []
    assert notes == [f"llamacpp: skipped, no llama.cpp environment at {missing} "
                     "(run `bash benchmarks/peers/setup_llamacpp.sh`)"]
    # The default is the repository's own .venv-llamacpp.
    assert compare.parse_args([]).llamacpp_python == str(ROOT / ".venv-llamacpp" / "bin" / "python")


def test_llamacpp_runs_the_packaged_models_gguf(compare, tmp_path, monkeypatch):
    python = _fake_python(tmp_path)
    # Named without its quantization: the label comes from general.file_type (15 = Q4_K_M).
    gguf_file = _gguf(tmp_path / "packaged.gguf", 15)
    asked = []
    monkeypatch.setattr(pm, "gguf_path", lambda model: asked.append(model.name) or gguf_file)
    args = compare.parse_args(["--model", "qwen2.5-coder-1.5b-instruct", "--draft-model", "", "--engines",
                               "pagedtree,llamacpp", "--llamacpp-python", str(python), "--llamacpp-threads", "1",
                               "--out-dir", str(tmp_path), "--tag", "t"])
    specs, notes = compare.engine_specs(args)
    assert notes == [] and asked == ["qwen2.5-coder-1.5b-instruct"]
    spec = specs[1]
    assert (spec.label, spec.engine, spec.python) == ("llamacpp:Q4_K_M@threads1", "llamacpp", str(python))
    assert spec.model == str(gguf_file) and spec.threads == 1 and not spec.draft
    # The runner gets the GGUF file (not the converted folder) and the thread count.
    workload = tmp_path / "w.json"
    workload.write_text("{}")
    run = compare.run_engine(args, spec, tmp_path / "hf-folder", None, workload, tmp_path)
    argv = (tmp_path / "argv.txt").read_text().split("\n")
    assert run.error is None
    assert argv[argv.index("--engine") + 1] == "llamacpp"
    assert argv[argv.index("--model") + 1] == str(gguf_file)
    assert argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--label") + 1] == "llamacpp:Q4_K_M@threads1"


def test_llamacpp_model_is_a_gguf_file_or_skipped(compare, tmp_path, monkeypatch):
    python = _fake_python(tmp_path)
    own = _gguf(tmp_path / "model-Q8_0.gguf", 7)  # 7 = Q8_0

    def specs_for(model: str):
        return compare.engine_specs(compare.parse_args(["--model", model, "--draft-model", "", "--engines",
                                                        "llamacpp", "--llamacpp-python", str(python)]))

    specs, notes = specs_for(str(own))
    assert [s.label for s in specs] == ["llamacpp:Q8_0"] and specs[0].model == str(own) and notes == []
    assert specs[0].threads is None  # every core
    specs, notes = specs_for(str(tmp_path))  # a Hugging Face folder: nothing for llama.cpp to run
    assert specs == [] and notes[0].startswith("llamacpp: skipped, --model") and "GGUF" in notes[0]
    specs, notes = specs_for(str(tmp_path / "absent.gguf"))
    assert specs == [] and "GGUF file not found" in notes[0]

    def not_installed(model):
        raise pm.ModelNotInstalledError(f"model {model.name!r} is not installed")

    monkeypatch.setattr(pm, "gguf_path", not_installed)
    specs, notes = specs_for("qwen2.5-coder-0.5b-instruct")
    assert specs == [] and "not installed" in notes[0]
    # The quantization from the file name when the metadata has none.
    assert compare.gguf_quantization(tmp_path / "absent-q4_k_m.gguf") == "Q4_K_M"
    assert compare.gguf_quantization(tmp_path / "absent.gguf") == "gguf"


class _FakeLlama:
    """Just enough of llama_cpp.Llama: generate() yields EOS forever, as a model might."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.resets = 0
        self.calls: list[tuple[list[int], dict]] = []
        _FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def generate(self, tokens, **kwargs):
        self.calls.append((list(tokens), kwargs))
        while True:
            yield 2  # EOS


def test_llamacpp_runner_ignores_eos_and_runs_batch_1_only(tmp_path, monkeypatch):
    runner = load_benchmark("engine_runner")
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama, __version__="0.0-test"))
    _FakeLlama.instances.clear()
    prompts = [[1, 5, 6], [1, 7]]
    cells = [{"batch_size": b, "temperature": t, "rounds": 2 if b == 1 else 1, "prompts": prompts}
             for t in (0.0, 0.8) for b in (1, 2)]
    args = runner.parse_args(["--engine", "llamacpp", "--model", "m.gguf", "--workload", "w", "--out", "o",
                              "--threads", "3", "--seed", "7"])
    result = runner.run_workload(args, {"output_len": 6, "cells": cells})
    json.dumps(result)
    (llm,) = _FakeLlama.instances
    assert llm.kwargs["model_path"] == "m.gguf" and llm.kwargs["n_threads"] == 3 and llm.kwargs["seed"] == 7
    assert llm.kwargs["n_ctx"] >= 3 + 6
    assert result["info"]["threads"] == 3 and result["info"]["versions"]["llama-cpp-python"] == "0.0-test"
    by_cell = {(c["batch_size"], c["temperature"]): c for c in result["cells"]}
    for t in (0.0, 0.8):
        assert by_cell[(1, t)]["output_tokens"] == 2 * 6 and by_cell[(1, t)]["skipped"] is None
        assert by_cell[(2, t)]["skipped"] == "llama-cpp-python decodes one sequence at a time: batch 1 only"
    # Warm-up, then two prompts per batch-1 cell; every request starts from an empty cache.
    assert len(llm.calls) == 1 + 2 * 2 and llm.resets == len(llm.calls)
    assert [c[0] for c in llm.calls[1:3]] == prompts
    greedy, sampled = llm.calls[1][1], llm.calls[3][1]
    assert greedy["temp"] == 0.0
    assert sampled["temp"] == 0.8 and sampled["top_k"] == 0 and sampled["top_p"] == 1.0 and sampled["min_p"] == 0.0
    assert greedy["repeat_penalty"] == sampled["repeat_penalty"] == 1.0


def test_peers_start_without_the_environment_pagedtree_sets_for_itself(compare, tmp_path, monkeypatch):
    """llama.cpp's OpenMP threads slept after every operation under the OpenMP wait
    policy that importing pagedtree sets, a third of its speed: a peer gets the
    environment as it was before that import; pagedtree's runner keeps it."""
    from pagedtree import process_env

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    seen = tmp_path / "env.txt"
    python.write_text(f'#!/bin/sh\necho "${{OMP_WAIT_POLICY:-unset}} ${{USER_SETTING:-unset}}" >> {seen}\n')
    python.chmod(0o755)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setitem(process_env._SET_HERE, "OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("USER_SETTING", "kept")
    workload = tmp_path / "w.json"
    workload.write_text("{}")
    args = compare.parse_args(["--model", "smollm2-135m-instruct", "--draft-model", "", "--out-dir", str(tmp_path),
                               "--tag", "t"])
    for engine in ("llamacpp", "vllm", "transformers", "pagedtree"):
        spec = compare.EngineSpec(engine, engine, str(python), model="m")
        assert compare.run_engine(args, spec, tmp_path / "m", None, workload, tmp_path).error is None
    assert seen.read_text().splitlines() == ["unset kept"] * 3 + ["PASSIVE kept"]
    # A value the user set, not pagedtree, reaches every engine.
    monkeypatch.delitem(process_env._SET_HERE, "OMP_WAIT_POLICY")
    assert process_env.foreign_environment()["OMP_WAIT_POLICY"] == "PASSIVE"
