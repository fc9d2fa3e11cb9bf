"""The pagedtree command and the scripts answer --help and run on a tiny model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    assert "qwen2.5-coder-1.5b-instruct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "script", ["benchmarks/throughput.py", "benchmarks/precision.py", "benchmarks/step_profile.py",
               "examples/offline_generate.py",
               "-m pagedtree.entrypoints.cli"]
)
def test_scripts_have_help(script):
    args = script.split() if script.startswith("-m") else [str(ROOT / script)]
    result = subprocess.run([sys.executable, *args, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
