"""Steps launched before the previous step is read back (``async_scheduling``): the
same tokens as stepping one at a time, whatever stops, samples, aborts, arrives or
runs out of blocks, and no block left behind."""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.structured_params import StructuredOutputsParams
from tests.conftest import assert_no_leaks, random_prompts


def _llm(model, asynchronous: bool, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=4, max_num_seqs=8) | kwargs
    return LLM(str(model.path), async_scheduling=asynchronous, **options)


def _mixed_batch(vocab: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of several lengths with greedy, seeded, unseeded, n=2, logprobs,
    min_tokens, stop tokens and max_tokens of 1 to 12."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(7, vocab, 2, 11, seed=3)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, max_tokens=9, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=list(range(3, vocab, 4))),
        SamplingParams(temperature=0.7, top_k=5, seed=9, max_tokens=11),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    ]
    return prompts, params


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_async_steps_give_the_tokens_of_one_step_at_a_time(tiny_llama):
    """A mixed batch: every request's tokens (and logprobs) equal the synchronous
    engine's; steps ran ahead; nothing leaks."""
    prompts, params = _mixed_batch(256)
    sync = _llm(tiny_llama, False)
    want = sync.generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llama, True)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in want]
    assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs
    assert llm.engine.async_steps.num_steps_ahead > 5
    assert_no_leaks(llm)
    assert not sync.engine.async_steps.enabled  # off on CPU unless asked for


def test_requests_that_need_the_newest_token_on_the_host_step_in_order(tiny_llama):
    """A repetition penalty keeps the batch stepping one at a time (its history holds
    the newest token); the tokens are still the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 256, 3, 6, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    want = _tokens(_llm(tiny_llama, False).generate(prompts, params, use_tqdm=False))
    llm = _llm(tiny_llama, True)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.async_steps.num_steps_ahead == 0
    assert_no_leaks(llm)


def test_arrivals_aborts_and_a_tight_cache(tiny_llama):
    """Requests added between steps, one aborted while its token is in flight, and a
    cache that forces preemptions: the survivors' tokens are the synchronous
    engine's, the aborted request's output ends there, and every block comes back."""
    def run(asynchronous: bool):
        llm = _llm(tiny_llama, asynchronous, num_kv_blocks=14, max_num_batched_tokens=16)
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        prompts = random_prompts(5, 256, 4, 9, seed=6)
        finished = {}
        ids = [engine.add_parent(engine.input_processor.make_requests(f"r{i}", {"prompt_token_ids": p}, params))
               for i, p in enumerate(prompts[:3])]
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = [c.token_ids for c in out.outputs]
            steps += 1
            if steps == 3:
                for i, p in enumerate(prompts[3:], start=3):
                    ids.append(engine.add_parent(engine.input_processor.make_requests(f"r{i}", {"prompt_token_ids": p}, params)))
            if steps == 6:
                aborted = engine.abort_request("r1")
                finished["r1"] = None if aborted is None else len(aborted.outputs[0].token_ids)
        assert_no_leaks(llm)
        return finished, llm

    want, _ = run(False)
    got, llm = run(True)
    assert set(got) == set(want) == {f"r{i}" for i in range(5)}
    assert {k: v for k, v in got.items() if k != "r1"} == {k: v for k, v in want.items() if k != "r1"}
    assert got["r1"] is not None and got["r1"] < 10
    assert llm.engine.scheduler.num_preemptions > 0 or llm.engine.async_steps.num_steps_ahead > 0


@pytest.mark.triton_interpreter
def test_fed_tokens_reach_padded_static_steps(tiny_llama):
    """Decode steps padded to the CUDA graphs' static shapes (capture off on a CPU):
    the tokens in flight are written into the shape's input buffer on the device."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 256, 2, 5, seed=7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = _tokens(_llm(tiny_llama, False, attention_backend="triton").generate(prompts, params, use_tqdm=False))
    llm = _llm(tiny_llama, True, attention_backend="triton", max_num_seqs=4)
    llm.engine.runner.enable_cuda_graphs(4, llm.engine.max_model_len, 1, capture=False)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.runner.graphs.num_steps >= 4 and llm.engine.async_steps.num_steps_ahead >= 4


def test_speculation_switched_on_reads_the_launched_step_back_first(tiny_llama, tmp_path):
    """An engine with a drafter steps ahead while speculation is off and goes back to
    one step at a time when it is switched on, the launched step read back first."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 256, 3, 6, seed=8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = _llm(tiny_llama, True, speculative={"drafter": "suffix", "max_nodes": 4, "adaptive": False})
    want = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert llm.engine.async_steps.num_steps_ahead == 0  # speculation on: one step at a time
    llm.engine.set_speculation(False)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.engine.async_steps.num_steps_ahead > 0
    engine = llm.engine
    engine.add_parent(engine.input_processor.make_requests("x", prompts[0], params))
    engine.step()
    assert engine.async_steps.pending is not None
    engine.set_speculation(True)
    engine.step()  # reads the launched step back
    assert engine.async_steps.pending is None
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_the_option_is_checked():
    from pagedtree.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="one process"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


def test_structured_outputs_step_in_order(tiny_text_model):
    """A constrained request keeps the batch stepping one at a time: its grammar's
    mask follows the newest token."""
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _tokens(_llm(tiny_text_model, False).generate(["Is it?", "Hello"], [params, plain], use_tqdm=False))
    llm = _llm(tiny_text_model, True)
    assert _tokens(llm.generate(["Is it?", "Hello"], [params, plain], use_tqdm=False)) == want
    assert_no_leaks(llm)


def test_async_scheduling_switched_off_and_on_in_one_engine(tiny_llama):
    """``set_async_scheduling``: the same engine steps one at a time, then ahead again,
    with the same tokens; a launched step is read back before the switch takes hold."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 256, 3, 6, seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    llm = _llm(tiny_llama, True)
    engine = llm.engine
    want = _tokens(llm.generate(prompts, params, use_tqdm=False))
    ahead = engine.async_steps.num_steps_ahead
    engine.set_async_scheduling(False)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert engine.async_steps.num_steps_ahead == ahead
    engine.set_async_scheduling(True)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert engine.async_steps.num_steps_ahead > ahead
    engine.add_parent(engine.input_processor.make_requests("x", prompts[0], params))
    engine.step()
    engine.set_async_scheduling(False)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.async_steps.pending is None
    assert_no_leaks(llm)
