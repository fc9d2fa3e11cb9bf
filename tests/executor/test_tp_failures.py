"""A tensor-parallel rank that dies or hangs stops the engine with a clear error in
bounded time; start-up failures leave no process behind; shutdown stops every rank."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.distributed.group import TensorParallelError
from tests.conftest import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def requests(count: int = 3):
    return [{"prompt_token_ids": p} for p in random_prompts(count, 256, 3, 12, seed=3)]


@pytest.mark.slow
def test_a_killed_worker_fails_the_engine_with_a_clear_error(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2)
    try:
        llm.generate(requests(), PARAMS, use_tqdm=False)
        worker = llm.engine.tensor_parallel.processes[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate(requests(), PARAMS, use_tqdm=False)
        assert time.monotonic() - started < 10
        with pytest.raises(TensorParallelError):  # and every later step, at once
            llm.generate(requests(1), PARAMS, use_tqdm=False)
        # The failed requests were aborted: nothing holds a block.
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_hung_worker_fails_the_engine_within_the_timeout(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2, distributed_timeout=2)
    worker = llm.engine.tensor_parallel.processes[1]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"Timed out.*rank 1 \(pid \d+\) is alive but did not answer"):
            llm.generate(requests(), PARAMS, use_tqdm=False)
        assert time.monotonic() - started < 2 + 8
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.shutdown()
    assert not worker.is_alive()


@pytest.mark.slow
def test_shutdown_stops_every_rank(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2)
    workers = list(llm.engine.tensor_parallel.processes.values())
    llm.generate(requests(), PARAMS, use_tqdm=False)
    llm.shutdown()
    assert [w.exitcode for w in workers] == [0]
    with pytest.raises(TensorParallelError, match="shut down"):
        llm.generate(requests(1), PARAMS, use_tqdm=False)
    llm.shutdown()  # idempotent


def test_a_model_that_cannot_be_split_fails_at_start_and_leaves_no_process(tiny_llama):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 2 KV heads"):
        LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.slow
def test_rank_0_failing_after_the_workers_loaded_stops_them(tiny_llama, tmp_path):
    # The target loads on every rank, then rank 0 fails on its (whole) draft: the
    # workers, already waiting for commands, must not be left behind.
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="not-a-model"):
        LLM(str(tiny_llama.path), dtype="float32", tensor_parallel_size=2, draft_model=str(tmp_path / "not-a-model"))
    assert set(multiprocessing.active_children()) == before
