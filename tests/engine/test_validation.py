"""Bad input fails alone, early, with a message naming the problem."""

from __future__ import annotations

import math

import pytest
import torch

from pagedtree import LLM, SamplingParams
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(str(tiny_text_model.path), block_size=4, max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": 5}, "stop"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -1}, "seed"),
        ({"n": 10**6}, "n"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"stop": "a\ud800"}, "stop"),
        ({"stop": ["ok", "\udfff"]}, "stop"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1] * 64}, "max_model_len"),
        ({"prompt_token_ids": [10**6]}, "vocabulary"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        (42, "prompt must be"),
        ({"foo": 1}, "prompt"),
        ("Hello \ud800 world", "prompt is not valid Unicode text: character 6 is a lone UTF-16 surrogate"),
        ({"prompt": "\udc80"}, "not valid Unicode"),
    ],
)
def test_bad_prompts_raise_before_any_work(llm, prompt, message):
    good = "Hello world"
    before = llm.stats()["num_forward_passes"]
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["num_forward_passes"] == before
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_error_names_the_prompt_index(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["ok", ""], use_tqdm=False)


def test_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_wrong_params_type(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]


def test_engine_config_rejects_bad_values(tiny_llama):
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(tiny_llama.path), block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(tiny_llama.path), dtype="int3")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(tiny_llama.path), attention_backend="magic")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_llama.path), max_model_len=10**6)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_text_prompt_needs_tokenizer(tiny_llama):
    llm = LLM(str(tiny_llama.path))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(stop=["x"]), use_tqdm=False)


def test_runtime_failure_of_one_request_spares_the_batch(tiny_llama, monkeypatch):
    """A request whose forward pass raises ends with an error; the others finish."""
    llm = LLM(str(tiny_llama.path), block_size=4)
    model = llm.engine.runner.model
    poison = 250
    original = model.forward

    def faulty_forward(input_ids, positions, attention):
        # Only the poisoned prompt has this token at position 1 (outputs start later).
        if bool(((input_ids == poison) & (positions == 1)).any()):
            raise RuntimeError("injected fault")
        return original(input_ids, positions, attention)

    monkeypatch.setattr(model, "forward", faulty_forward)
    prompts = [[5, 6, 7], [8, poison, 9], [10, 11], [12] * 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "injected fault" in outs[1].error
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert outs[i].outputs[0].finish_reason == "length"
        assert len(outs[i].outputs[0].token_ids) == 6
    assert llm.stats()["num_failed_requests"] == 1
    assert_no_leaks(llm)

    # The survivors' tokens are the same as in a clean run.
    monkeypatch.setattr(model, "forward", original)
    clean = llm.generate([{"prompt_token_ids": prompts[i]} for i in (0, 2, 3)], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in clean] == [outs[i].outputs[0].token_ids for i in (0, 2, 3)]


def test_generation_stops_at_context_limit(tiny_llama):
    llm = LLM(str(tiny_llama.path), max_model_len=20, block_size=4)
    out = llm.generate([{"prompt_token_ids": list(range(3, 18))}], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20
    assert torch.tensor(out.outputs[0].token_ids).max() < 256


def test_tiny_temperatures_are_greedy_and_tiny_top_p_keeps_the_top_token(llm):
    """A temperature of 1e-45 overflowed the logits (NaN, finish_reason "error");
    below 1e-5 it is greedy now. A top_p that rounds to 0 keeps the top token."""
    assert SamplingParams(temperature=1e-45).greedy and SamplingParams(temperature=1e-300).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy
    greedy = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tiny = llm.generate(
        ["Hello", "Hello"],
        [SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True),
         SamplingParams(temperature=0.7, top_p=1e-300, max_tokens=6, ignore_eos=True, seed=3)],
        use_tqdm=False,
    )
    for out in tiny:
        assert out.error is None and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logprobs_are_capped_by_max_logprobs(tiny_text_model):
    llm = LLM(str(tiny_text_model.path), block_size=4, max_model_len=64, max_logprobs=5)
    with pytest.raises(ValueError, match="logprobs must be <= 5"):
        llm.generate(["Hello"], SamplingParams(logprobs=10**9), use_tqdm=False)
    out = llm.generate(["Hello"], SamplingParams(logprobs=5, max_tokens=2), use_tqdm=False)[0]
    assert all(len(top) >= 5 for top in out.outputs[0].logprobs)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (5, None, "prompts must be"),
        (None, None, "prompts must be"),
        (["a"], {"temperature": 0}, "sampling_params must be .* got dict"),
        (["a"], "greedy", "sampling_params must be .* got str"),
        (["a", "b"], [SamplingParams(), "x"], "sampling_params must be"),
    ],
)
def test_generate_argument_errors_name_the_argument(llm, prompts, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]


def test_child_ids_cannot_collide(llm):
    """With n=2, "victim" owns "victim#0" and "victim#1": another request may take
    none of them (a clash handed one request's blocks to another and killed the
    engine thread)."""
    engine = llm.engine
    engine.add_request("victim", "Hello", SamplingParams(n=2, max_tokens=3))
    for rid, n in (("victim#0", 1), ("victim", 1), ("victim#1", 3), ("vic", 1)):
        if rid == "vic":
            engine.add_request(rid, "Hello", SamplingParams(max_tokens=2))
            continue
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(rid, "Hello", SamplingParams(n=n, max_tokens=2))
    # A parent whose children would take an existing id is refused too.
    engine.add_request("x#0", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "Hello", SamplingParams(n=2, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


@pytest.mark.parametrize("penalty", [1e-300, 1e-38, 5e-324, 1e300, 1.7e308])
def test_extreme_repetition_penalties_sample_valid_tokens(llm, penalty):
    """A penalty of 1e-300 is 0 in fp32: the penalised logits were infinite, the
    probabilities NaN and the draw index V (an IndexError). Penalties are applied in
    float64 and kept finite now, so every penalty > 0 samples valid tokens."""
    vocab = llm.engine.vocab_size
    params = [SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, repetition_penalty=penalty),
              SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, repetition_penalty=penalty, seed=5),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=penalty)]
    outs = llm.generate(["Hello hello world"] * 3, params, use_tqdm=False)
    for out in outs:
        assert out.error is None and out.outputs[0].finish_reason == "length", out.error
        assert all(0 <= t < vocab for t in out.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_a_non_finite_distribution_fails_its_request_alone(tiny_llama, monkeypatch):
    """Logits that are NaN for one request (a model that overflowed) give no token: the
    request fails with a clear error, its neighbours finish, no block leaks."""
    from pagedtree.sampling import NonFiniteDistributionError

    import pagedtree.worker.model_runner as model_runner

    llm = LLM(str(tiny_llama.path), block_size=4)
    poison = 250
    real_sample_rows = model_runner.sample_rows

    def poisoned_sample_rows(logits, rows):
        # The poisoned prompt's rows get NaN logits (its history starts [8, 250, 9]:
        # a repetition penalty keeps the history in the sampling rows).
        logits = logits.clone()
        for i, row in enumerate(rows):
            if poison in row.history[:3]:
                logits[i] = float("nan")
        return real_sample_rows(logits, rows)

    monkeypatch.setattr("pagedtree.worker.model_runner.sample_rows", poisoned_sample_rows)
    prompts = [[5, 6, 7], [8, poison, 9], [10, 11]]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, repetition_penalty=1.1),
              SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, repetition_penalty=1.1),
              SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True, repetition_penalty=1.1, seed=1)]
    for p in params:
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
        assert outs[1].outputs[0].finish_reason == "error"
        assert str(NonFiniteDistributionError()) in outs[1].error
        assert [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [5, 5]
        assert outs[0].error is None and outs[2].error is None
    assert_no_leaks(llm)
