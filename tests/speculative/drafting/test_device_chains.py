"""Chains drafted with each level's child fed from the device and every level read back
at once (``DraftWorker.device_chains``, what a GPU does): the same trees, tokens and
acceptance as drafting level by level, for greedy, seeded and unseeded requests, in
eager steps and in the padded static steps CUDA graphs replay."""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from tests.conftest import assert_no_leaks, random_prompts

CHAIN = SpeculativeConfig(tree="chain", depth=4, max_nodes=4, adaptive=False)


def _run(model, draft, device_chains: bool, params, prompts, static: bool = False, **kwargs):
    llm = LLM(str(model.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=4, seed=3,
              draft_model=[str(draft.path)], speculative=kwargs.pop("speculative", CHAIN), **kwargs)
    engine = llm.engine
    worker = engine.speculation.drafts[0]
    worker.device_chains = device_chains
    if static:
        from pagedtree.executor.shards import DRAFT_GRAPH_TOKENS

        engine.runner.enable_cuda_graphs(4, engine.max_model_len, 5, capture=False)
        worker.runner.enable_cuda_graphs(16, engine.max_model_len, DRAFT_GRAPH_TOKENS, capture=False)
    levels = []
    stage = type(worker)._propose_chains

    def counted(self, jobs):
        levels.append(len(jobs))
        return stage(self, jobs)

    worker._propose_chains = counted.__get__(worker)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert_no_leaks(llm)
    return [[c.token_ids for c in o.outputs] for o in outs], stats, levels


@pytest.fixture
def prompts():
    return [{"prompt_token_ids": p} for p in random_prompts(3, 256, 3, 8, seed=11)]


def test_device_chains_draft_what_level_by_level_drafts(tiny_llama, tiny_llama_draft, prompts):
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)]
    want, want_stats, none = _run(tiny_llama, tiny_llama_draft, False, params, prompts)
    got, stats, levels = _run(tiny_llama, tiny_llama_draft, True, params, prompts)
    assert none == [] and levels  # the chain path ran (and only where asked)
    assert got == want
    for key in ("num_draft_tokens", "num_accepted_tokens", "num_target_forward_passes"):
        assert stats[key] == want_stats[key], key
    assert stats["num_draft_tokens"] > 0


@pytest.mark.triton_interpreter
def test_device_chains_through_padded_static_steps(tiny_llama, tiny_llama_draft, prompts):
    """The fed tokens reach the static input buffers of the draft's padded steps."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want, want_stats, _ = _run(tiny_llama, tiny_llama_draft, False, params, prompts[:2], attention_backend="triton")
    got, stats, levels = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], static=True,
                              attention_backend="triton")
    # Verification keeps the tokens exact whatever is drafted: the drafts' acceptance
    # shows the fed tokens were the drawn ones.
    assert got == want and levels and stats["num_draft_tokens"] > 0
    assert stats["num_accepted_tokens"] == want_stats["num_accepted_tokens"] > 0


def test_trees_other_than_chains_draft_level_by_level(tiny_llama, tiny_llama_draft, prompts):
    """A static tree with two children at the root is not a chain: level by level."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tree = SpeculativeConfig(tree="static", expansion=(2, 1), max_nodes=4, adaptive=False)
    want, _, _ = _run(tiny_llama, tiny_llama_draft, False, params, prompts[:2], speculative=tree)
    got, _, levels = _run(tiny_llama, tiny_llama_draft, True, params, prompts[:2], speculative=tree)
    assert got == want and levels == []
