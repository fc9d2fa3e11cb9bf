"""Greedy outputs equal transformers' generate, token for token, in every engine mode."""

from __future__ import annotations

import functools

import pytest

from pagedtree import LLM, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy, random_prompts

NEW_TOKENS = 12
NUM_PROMPTS = 16


@functools.lru_cache(maxsize=None)
def _reference(model_key: str, hf_model_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and transformers' greedy outputs for them (computed once per model)."""
    model = _MODELS[model_key]
    prompts = random_prompts(NUM_PROMPTS, vocab=256, min_len=1, max_len=70, seed=7)
    return prompts, [hf_greedy(model.hf_model, p, NEW_TOKENS) for p in prompts]


_MODELS: dict = {}


@pytest.fixture(params=["llama", "qwen2"])
def model(request, tiny_llama, tiny_qwen2):
    m = tiny_llama if request.param == "llama" else tiny_qwen2
    _MODELS[request.param] = m
    return request.param, m


def _run(model_path, prompts, **engine_kwargs):
    llm = LLM(str(model_path), **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("max_num_seqs", [1, 5, 16])
def test_greedy_matches_transformers(model, block_size, chunked, max_num_seqs):
    key, m = model
    prompts, expected = _reference(key, id(m.hf_model))
    llm, got = _run(
        m.path,
        prompts,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=24 if chunked else 512,
    )
    assert got == expected
    assert_no_leaks(llm)


def test_greedy_matches_transformers_under_preemption(model):
    key, m = model
    prompts, expected = _reference(key, id(m.hf_model))
    # 30 blocks of 4 tokens cannot hold 16 sequences of up to 82 tokens at once.
    llm, got = _run(m.path, prompts, block_size=4, num_kv_blocks=30, max_num_batched_tokens=32)
    assert got == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leaks(llm)


def test_prefix_cache_hits_give_same_tokens(model):
    key, m = model
    prompts, expected = _reference(key, id(m.hf_model))
    llm = LLM(str(m.path), block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert llm.stats()["prefix_cache_hits"] > hits_before
    assert first == expected and second == expected
    assert_no_leaks(llm)
