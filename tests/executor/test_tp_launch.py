"""Ranks that join through torch.distributed's environment, as on several machines:
``pagedtree worker`` processes (MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK) and
torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.distributed.group import TensorParallelError
from tests.entrypoints.test_serve_cli import free_port, http, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 9]}, {"prompt_token_ids": [200, 3, 4, 5, 6, 7, 8]}]


def start_worker(rank: int, size: int, port: int, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
           "RANK": str(rank), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pagedtree.entrypoints.cli", "worker"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank0_env(monkeypatch, port: int, size: int = 2) -> None:
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(size),
                        "RANK": "0"}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.slow
def test_a_worker_joining_through_the_environment(tiny_llama, monkeypatch, tmp_path):
    expected = [o.outputs[0].token_ids for o in
                LLM(str(tiny_llama.path), dtype="float32").generate(PROMPTS, PARAMS, use_tqdm=False)]
    port = free_port()
    worker = start_worker(1, 2, port, cwd=tmp_path)  # starts first: it waits for rank 0's store
    rank0_env(monkeypatch, port)
    try:
        with LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2) as llm:
            assert llm.engine.tensor_parallel.processes == {}  # nothing spawned: the rank came by itself
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == expected
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()


@pytest.mark.slow
def test_a_worker_without_the_model_is_quoted_by_rank_0(tiny_llama, monkeypatch, tmp_path):
    # The model path is relative to rank 0's folder; the worker runs elsewhere (as on
    # a machine where the model sits at another path) and cannot load it.
    monkeypatch.chdir(tiny_llama.path.parent)
    port = free_port()
    worker = start_worker(1, 2, port, cwd=tmp_path)
    rank0_env(monkeypatch, port)
    try:
        with pytest.raises(TensorParallelError, match=rf"rank 1 reported .*{tiny_llama.path.name}"):
            LLM(tiny_llama.path.name, dtype="float32", tensor_parallel_size=2)
        assert worker.wait(timeout=30) == 1
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()


def test_rank_0_refuses_to_be_another_rank(tiny_llama, monkeypatch):
    rank0_env(monkeypatch, free_port())
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="this process is RANK=1"):
        LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2)


@pytest.mark.slow
def test_torchrun_runs_the_same_command_on_every_rank(tiny_text_model):
    command = ["generate", "Hello world", "--model", str(tiny_text_model.path), "--device", "cpu",
               "--dtype", "float32", "--max-tokens", "8", "--ignore-eos"]
    single = subprocess.run([sys.executable, "-m", "pagedtree.entrypoints.cli", *command], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "pagedtree.entrypoints.cli", *command, "--tensor-parallel-size", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    text = [line for line in single.stdout.splitlines() if "tokens/s" not in line]
    assert text and text == [line for line in run.stdout.splitlines() if "tokens/s" not in line]
