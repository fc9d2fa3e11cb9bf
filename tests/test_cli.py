"""The pagedtree command and the scripts answer --help and run on a tiny model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedtree.entrypoints import cli
from pagedtree.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_generate_prints_text_and_rate(tiny_text_model, capsys):
    code = main(["generate", "Hello world", "--model", str(tiny_text_model.path), "--max-tokens", "5", "--ignore-eos"])
    out = capsys.readouterr().out
    assert code == 0
    assert "5 tokens, finish_reason=length" in out
    assert "tokens/s" in out


def test_generate_reports_bad_input(tiny_text_model, capsys):
    code = main(["generate", "Hello", "--model", str(tiny_text_model.path), "--max-tokens", "0"])
    assert code == 2
    assert "max_tokens" in capsys.readouterr().err


def test_generate_with_the_suffix_drafter(tiny_text_model, capsys):
    code = main(["generate", "Hello world, hello world, hello", "--model", str(tiny_text_model.path),
                 "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--spec-drafter", "suffix"])
    assert code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tree speculation:"))
    match = re.fullmatch(r"tree speculation: (\d+) drafts, mean acceptance length ([\d.]+), (\d+) target passes", line)
    assert match, line
    # This run's passes alone (not the load's calibration): the prompt's, then one per
    # remaining token at most.
    assert 1 <= int(match[3]) <= 8


def test_worker_without_a_rendezvous_is_a_clear_error(capsys, monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["worker"]) == 2
    assert "MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK" in capsys.readouterr().err


def test_parallel_options_map_to_the_engine():
    args = cli.build_parser().parse_args(["serve", "-tp", "2", "--draft-tensor-parallel-size", "2",
                                          "--distributed-timeout", "5"])
    kwargs = cli.engine_kwargs(args)
    assert (kwargs["tensor_parallel_size"], kwargs["draft_tensor_parallel_size"], kwargs["distributed_timeout"]) == (2, 2, 5)


def test_the_load_format_and_async_scheduling_map_to_the_engine():
    defaults = cli.engine_kwargs(cli.build_parser().parse_args(["serve"]))
    assert defaults["load_format"] == "auto" and defaults["async_scheduling"] is None
    assert cli.engine_kwargs(cli.build_parser().parse_args(["serve", "--async-scheduling", "on"]))[
        "async_scheduling"] is True
    args = cli.build_parser().parse_args(["serve", "--load-format", "dummy"])
    assert cli.engine_kwargs(args)["load_format"] == "dummy"


def test_the_offload_option_maps_to_the_engine(capsys):
    parse = cli.build_parser().parse_args
    assert cli.engine_kwargs(parse(["serve"]))["offload_weights_gb"] is None
    assert cli.engine_kwargs(parse(["serve", "--offload-weights-gb", "all"]))["offload_weights_gb"] == "all"
    assert cli.engine_kwargs(parse(["serve", "--offload-weights-gb", "12.5"]))["offload_weights_gb"] == 12.5
    with pytest.raises(SystemExit):
        parse(["serve", "--offload-weights-gb", "most"])
    assert "a number of GiB or 'all'" in capsys.readouterr().err


def test_spec_options_map_to_the_engine():
    from pagedtree.entrypoints.cli import build_parser, engine_kwargs

    parser = build_parser()
    kwargs = engine_kwargs(parser.parse_args(["generate", "x", "--spec-preset", "suffix"]))
    assert "draft_model" not in kwargs and kwargs["speculative"]["drafter"] == "suffix"
    kwargs = engine_kwargs(parser.parse_args(["generate", "x", "--draft-model", "d", "--spec-preset",
                                              "adaptive-chain-5+suffix", "--spec-max-nodes", "6"]))
    assert kwargs["draft_model"] == ["d"] and kwargs["speculative"]["drafter"] == "model+suffix"
    assert kwargs["speculative"]["max_nodes"] == 6
    assert "speculative" not in engine_kwargs(parser.parse_args(["generate", "x"]))
    # A draft model and no tree: the engine's own default; a preset: that tree.
    assert engine_kwargs(parser.parse_args(["generate", "x", "--draft-model", "d"]))["speculative"] is None
    kwargs = engine_kwargs(parser.parse_args(["generate", "x", "--draft-model", "d", "--spec-preset",
                                              "adaptive-chain-5"]))
    assert kwargs["speculative"]["drafter"] == "model" and kwargs["speculative"]["max_nodes"] == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--spec-preset", "nope"])
    # How the drafts draft is no tree: the engine's default trees take it.
    kwargs = engine_kwargs(parser.parse_args(["generate", "x", "--draft-model", "d", "--draft-min-prob", "0.5",
                                              "--draft-vocab-size", "4096"]))
    assert kwargs["speculative"] is None
    assert kwargs["draft_settings"] == {"draft_min_prob": 0.5, "draft_vocab_size": 4096}
    assert engine_kwargs(parser.parse_args(["serve", "--draft-min-prob", "0.5"]))["draft_settings"] == {
        "draft_min_prob": 0.5}  # refused by the engine: no draft model


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out


# Every script and command answers --help. One interpreter runs them all in turn
# (runpy, as ``python script --help`` would): a process per script cost seconds each.
SCRIPTS = sorted(str(p.relative_to(ROOT)) for folder in ("benchmarks", "benchmarks/peers", "examples")
                 for p in (ROOT / folder).glob("*.py"))
MODULES = ["-m pagedtree.loadgen.soak", "-m pagedtree.entrypoints.cli", "-m pagedtree.entrypoints.cli worker"]
# What some answers must name besides "usage".
EXPECTED = {
    "benchmarks/kernels.py": ["--peak-gbps", "--quick"],
    "benchmarks/serving.py": ["usage: benchmarks/serving.py", "--max-concurrency"],
}
_HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = {}
for entry in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    words = entry.split()
    sys.argv = ([words[1]] + words[2:] if words[0] == "-m" else [entry]) + ["--help"]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if words[0] == "-m":
                runpy.run_module(words[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(entry, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - reported per script
        code, err = 1, io.StringIO(f"{type(exc).__name__}: {exc}")
    results[entry] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict:
    import json

    entries = SCRIPTS + MODULES
    done = subprocess.run([sys.executable, "-c", _HELP_DRIVER, json.dumps(entries)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS + MODULES)
def test_scripts_have_help(script, help_answers):
    code, out, err = help_answers[script]
    assert code == 0, err
    assert "usage" in out.lower()
    for expected in EXPECTED.get(script, []):
        assert expected in out


def test_the_workload_maps_to_the_engine():
    parse = cli.build_parser().parse_args
    assert cli.engine_kwargs(parse(["serve"]))["workload"] is None  # the entry point's: batch for serve
    assert cli.engine_kwargs(parse(["serve", "--workload", "stream"]))["workload"] == "stream"
    assert cli.engine_kwargs(parse(["generate", "hi", "--workload", "batch"]))["workload"] == "batch"
    with pytest.raises(SystemExit):
        parse(["serve", "--workload", "fast"])
