"""Tensor parallelism on CPU with gloo: N ranks give the tokens one rank gives.

Every test here spawns real worker processes (torch.multiprocessing, spawn) that
load their own shards; the greedy and seeded outputs are compared token for token
with a one-process engine on the same weights.
"""

from __future__ import annotations

import os
import signal

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.distributed.group import TensorParallelError
from pagedtree.loading import packaged_models as pm
from tests.conftest import random_prompts
from tests.executor.conftest import assert_ranks_in_step, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    shared = random_prompts(1, 256, 40, 40, seed=7)[0]  # four prompts share 40 tokens: prefix-cache hits
    tails = random_prompts(4, 256, 2, 6, seed=8)
    return [{"prompt_token_ids": p} for p in random_prompts(10, 256, 3, 40, seed=5)] + [
        {"prompt_token_ids": shared + tail} for tail in tails
    ]


# 20 blocks of 16 tokens for 14 requests of up to 60 tokens: the scheduler preempts.
SMALL_CACHE = dict(dtype="float32", num_kv_blocks=20, max_num_seqs=16)


@pytest.fixture(scope="module")
def two_ranks(tiny_llama, tp_draft):
    """Two ranks on the small cache, with tree speculation (the draft whole on rank 0).
    One engine for the module: every start spawns a rank that imports torch and
    pagedtree and loads its shard (seconds)."""
    two = LLM(str(tiny_llama.path), tensor_parallel_size=2, draft_model=str(tp_draft.path),
              speculative={"tree": "static", "expansion": [2, 2, 1], "max_nodes": 8, "adaptive": False},
              **SMALL_CACHE)
    yield two
    two.shutdown()


def test_two_ranks_give_one_ranks_greedy_tokens_under_preemption_and_prefix_caching(tiny_llama, two_ranks, prompts):
    one = LLM(str(tiny_llama.path), **SMALL_CACHE)
    expected = token_ids(one.generate(prompts, GREEDY, use_tqdm=False))
    assert one.stats()["num_preemptions"] > 0
    two = two_ranks
    two.engine.set_speculation(False)  # plain decoding on two ranks (the tests below speculate)
    try:
        assert token_ids(two.generate(prompts, GREEDY, use_tqdm=False)) == expected
    finally:
        two.engine.set_speculation(True)
    stats = two.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    report = assert_ranks_in_step(two)
    assert report[1]["models"][0]["forward_passes"] == stats["num_forward_passes"]
    # Each rank holds half of every layer (norms replicated).
    whole = one.engine.runner.memory_bytes()["weights"]
    assert all(0.45 * whole < r["models"][0]["weight_bytes"] < 0.55 * whole for r in report)
    assert all(r["all_reduces"] > 0 for r in report)


@pytest.fixture(scope="module")
def speculative_pair(tiny_llama, two_ranks):
    """One rank decoding plainly, and two ranks with tree speculation on the small
    cache (so they speculate under preemption too)."""
    return LLM(str(tiny_llama.path), dtype="float32"), two_ranks


def test_tree_speculation_on_two_ranks_gives_plain_one_rank_tokens(speculative_pair, prompts):
    one, two = speculative_pair
    expected = token_ids(one.generate(prompts, GREEDY, use_tqdm=False))
    assert token_ids(two.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = two.stats()
    assert stats["num_accepted_tokens"] > 0
    report = assert_ranks_in_step(two)
    assert report[1]["models"][0]["slot_copies"] > 0  # accepted tree paths compacted on every rank


def test_seeded_sampling_on_two_ranks_equals_one_rank(speculative_pair, prompts):
    one, two = speculative_pair
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    expected = token_ids(one.generate(prompts, params, use_tqdm=False))
    assert token_ids(two.generate(prompts, params, use_tqdm=False)) == expected
    assert_ranks_in_step(two)


@pytest.mark.slow
def test_drafts_sharded_with_the_target(tiny_llama, tp_draft, prompts, caplog):
    # Branching trees: the draft forks sequences, so its copy-on-write block copies
    # must reach rank 1's draft cache too. A draft cache gone wrong on any rank
    # would not change the (exact) tokens, but it would change what the draft
    # proposes: the same trees must be proposed and accepted as on one rank.
    settings = dict(dtype="float32", draft_model=str(tp_draft.path),
                    speculative={"tree": "static", "expansion": [2, 2, 1], "max_nodes": 8, "adaptive": False})
    one = LLM(str(tiny_llama.path), **settings)
    expected = token_ids(one.generate(prompts, GREEDY, use_tqdm=False))
    with LLM(str(tiny_llama.path), tensor_parallel_size=2, draft_tensor_parallel_size=2, **settings) as two:
        assert token_ids(two.generate(prompts, GREEDY, use_tqdm=False)) == expected
        for counter in ("num_draft_tokens", "num_accepted_tokens"):
            assert two.stats()[counter] == one.stats()[counter], counter
        report = assert_ranks_in_step(two, num_models=2)
        draft = report[1]["models"][1]
        assert draft["forward_passes"] > 0 and draft["block_copies"] > 0  # the draft ran on rank 1 too
        # A rank that dies while requests decode fails the sharded draft first: that is
        # fatal at once, not a draft failure to retry request by request.
        engine = two.engine
        drafted = engine.stats()["num_drafts"]
        for prompt in prompts[:3]:
            engine.add_request(None, prompt, GREEDY)
        while engine.stats()["num_drafts"] == drafted:  # prefill, then a first tree each
            engine.step()
        worker = engine.tensor_parallel.processes[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        with pytest.raises(TensorParallelError, match="killed by SIGKILL"):
            engine.step()
        assert "one by one" not in caplog.text and "without speculation" not in caplog.text


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads_with_biases_and_tied_embeddings(tiny_qwen2):
    # tiny Qwen2: 4 query heads, 2 KV heads (each on 2 ranks), q/k/v biases, tied embeddings.
    requests = [{"prompt_token_ids": p} for p in random_prompts(4, 256, 3, 20, seed=9)]
    one = LLM(str(tiny_qwen2.path), dtype="float32")
    expected = token_ids(one.generate(requests, GREEDY, use_tqdm=False))
    with LLM(str(tiny_qwen2.path), dtype="float32", tensor_parallel_size=4) as four:
        assert token_ids(four.generate(requests, GREEDY, use_tqdm=False)) == expected
        assert_ranks_in_step(four)


@pytest.mark.slow
def test_smollm2_135m_on_two_ranks_equals_one_rank():
    model = pm.SMOLLM2_135M  # 9 query heads over 3 KV heads: ranks hold 6 and 3 heads
    if not pm.is_installed(model):
        pytest.skip(f"{model.name} not installed: {pm.install_command(model)}")
    prompts = ["def fibonacci(n):", "The capital of France is", "Paged attention stores"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    settings = dict(dtype="float32", max_model_len=256, kv_cache_memory=64 * 2**20)
    one = LLM(model.name, **settings)
    expected = token_ids(one.generate(prompts, params, use_tqdm=False))
    with LLM(model.name, tensor_parallel_size=2, speculative={"drafter": "suffix", "adaptive": False},
             **settings) as two:
        assert token_ids(two.generate(prompts, params, use_tqdm=False)) == expected
        two.engine.set_speculation(False)
        assert token_ids(two.generate(prompts, params, use_tqdm=False)) == expected
        assert_ranks_in_step(two)
