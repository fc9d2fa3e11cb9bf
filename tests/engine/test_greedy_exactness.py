"""Greedy outputs equal transformers' generate, token for token, in every engine mode."""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from tests.conftest import assert_no_leaks, hf_greedy, random_prompts

NEW_TOKENS = 12
NUM_PROMPTS = 16


_REFERENCES: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_llama, tiny_qwen2):
    """``(name, tiny model, prompts, transformers' greedy outputs)``, computed once per model."""
    # Kept in a dict, not only by pytest: a test that parametrizes ``model`` itself
    # (test_greedy_matches_transformers) gets a fresh fixture instance per case.
    if request.param not in _REFERENCES:
        m = tiny_llama if request.param == "llama" else tiny_qwen2
        prompts = random_prompts(NUM_PROMPTS, vocab=256, min_len=1, max_len=70, seed=7)
        expected = [hf_greedy(m.hf_model, p, NEW_TOKENS) for p in prompts]
        _REFERENCES[request.param] = (request.param, m, prompts, expected)
    return _REFERENCES[request.param]


def _run(model_path, prompts, **engine_kwargs):
    llm = LLM(str(model_path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


# (model, block size, chunked prefill, max_num_seqs): every pair of values of two of
# these four settings appears in one of the six default cases (a pairwise covering);
# -m slow runs the other 18 of the 24 combinations.
_PAIRWISE = {
    ("llama", 1, True, 1), ("llama", 16, False, 5), ("llama", 1, False, 16),
    ("qwen2", 16, False, 1), ("qwen2", 1, True, 5), ("qwen2", 16, True, 16),
}


@pytest.mark.parametrize("model,block_size,chunked,max_num_seqs", [
    pytest.param(name, block_size, chunked, max_num_seqs, id=f"{name}-{block_size}-{chunked}-{max_num_seqs}",
                 marks=() if (name, block_size, chunked, max_num_seqs) in _PAIRWISE else pytest.mark.slow)
    for name in ("llama", "qwen2") for max_num_seqs in (1, 5, 16) for chunked in (True, False)
    for block_size in (1, 16)
], indirect=["model"])
def test_greedy_matches_transformers(model, block_size, chunked, max_num_seqs):
    _, m, prompts, expected = model
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


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_greedy_matches_transformers_with_eager_ops(model, attention_backend):
    """``enforce_eager``: every op in torch (no fused CPU kernels), still exact."""
    _, m, prompts, expected = model
    llm, got = _run(m.path, prompts, block_size=4, max_num_seqs=5, enforce_eager=True,
                    attention_backend=attention_backend, max_num_batched_tokens=24)
    assert llm.engine.runner.model.fused_forward is None
    assert got == expected
    assert_no_leaks(llm)


def test_greedy_matches_transformers_under_preemption(model):
    _, m, prompts, expected = model
    # 30 blocks of 4 tokens cannot hold 16 sequences of up to 82 tokens at once.
    llm, got = _run(m.path, prompts, block_size=4, num_kv_blocks=30, max_num_batched_tokens=32)
    assert got == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leaks(llm)


def test_prefix_cache_hits_give_same_tokens(model):
    _, m, prompts, expected = model
    llm = LLM(str(m.path), dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert llm.stats()["prefix_cache_hits"] > hits_before
    assert first == expected and second == expected
    assert_no_leaks(llm)


@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (12, 2), (15, 3)], ids=["G7-qwen2.5-0.5b", "G6-qwen2.5-1.5b",
                                                                            "G5-qwen2.5-14b"])
def test_real_models_head_groupings_match_transformers(tmp_path, heads, kv_heads):
    """Query heads per KV head as the real models have them (Qwen2.5: 7, 6, 5), on a
    tiny Qwen2 with 16-wide heads: plain decoding on both CPU attention backends and
    tree speculation all equal transformers."""
    from tests.conftest import save_tiny_model

    m = save_tiny_model(tmp_path / "grouped", "qwen2", seed=5, with_tokenizer=False,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=16 * heads)
    prompts = random_prompts(6, vocab=256, min_len=1, max_len=40, seed=11)
    expected = [hf_greedy(m.hf_model, p, NEW_TOKENS) for p in prompts]
    for backend in ("cpu", "torch"):
        llm, got = _run(m.path, prompts, block_size=4, attention_backend=backend)
        assert got == expected, backend
        assert_no_leaks(llm)
    llm, got = _run(m.path, prompts, block_size=4, draft_model=str(m.path),
                    speculative={"tree": "static", "expansion": (2, 1), "max_nodes": 4, "adaptive": False})
    assert got == expected and llm.stats()["num_accepted_tokens"] > 0
    assert_no_leaks(llm)
