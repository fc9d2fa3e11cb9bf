"""Greedy exactness of tree speculation: same tokens as plain decoding and transformers."""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from tests.conftest import assert_no_leaks, hf_greedy, random_prompts

MAX_TOKENS = 20
TREES = {
    "static": SpeculativeConfig(tree="static", expansion=(2, 2, 1, 1), max_nodes=10, adaptive=False),
    "chain": SpeculativeConfig(tree="chain", depth=4, adaptive=False),
    "dynamic": SpeculativeConfig(tree="dynamic", top_k=3, depth=4, max_nodes=10, adaptive=False),
    "sequoia": SpeculativeConfig(tree="sequoia", depth=5, max_nodes=12, adaptive=False),
    "adaptive": SpeculativeConfig(tree="static", expansion=(3, 2, 1, 1), max_nodes=12, adaptive=True),
}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 256, 2, 40, seed=5)


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts):
    return [hf_greedy(tiny_llama.hf_model, p, MAX_TOKENS) for p in prompts]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_free(llm: LLM) -> None:
    assert_no_leaks(llm)
    stats = llm.stats()
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"], stats
    for draft in llm.engine.speculation.drafts:
        draft.block_manager.check_invariants()
        assert draft.num_requests == 0


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("block_size,max_num_seqs", [(4, 8), (16, 3), (1, 8)])
def test_greedy_tree_speculation_matches_transformers(
    tiny_llama, tiny_llama_draft, prompts, reference, tree, block_size, max_num_seqs
):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=block_size, max_num_seqs=max_num_seqs,
        draft_model=str(tiny_llama_draft.path), speculative=TREES[tree],
    )
    assert _generate(llm, prompts) == reference
    stats = llm.stats()
    if tree == "adaptive":
        # Draft and target cost the same on these tiny models: speculation must not pay,
        # and the adaptive mode is right to switch it off.
        assert stats["num_steps_speculation_off"] > 0
        factors = stats["plan_acceptance_factor"]
        assert set(factors) == {"greedy", "sampling"} and all(f > 0 for f in factors.values())
        _assert_all_free(llm)
        return
    assert stats["num_accepted_tokens"] > 0, "the draft never helped: the test would not see bugs in acceptance"
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"], "acceptance should be partial"
    _assert_all_free(llm)


def test_greedy_speculation_under_preemption(tiny_llama, tiny_llama_draft, prompts, reference):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=24, max_num_seqs=8,
        draft_model=str(tiny_llama_draft.path), num_draft_kv_blocks=30, speculative=TREES["static"],
    )
    assert _generate(llm, prompts) == reference
    assert llm.stats()["num_preemptions"] > 0
    _assert_all_free(llm)


def test_merged_trees_of_two_drafts(tiny_llama, tiny_llama_draft, tiny_llama_draft2, prompts, reference):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4,
        draft_model=[str(tiny_llama_draft.path), str(tiny_llama_draft2.path)], speculative=TREES["static"],
    )
    assert _generate(llm, prompts) == reference
    assert len(llm.engine.speculation.drafts) == 2
    _assert_all_free(llm)


def test_metrics_and_per_request_figures(tiny_llama, tiny_llama_draft, prompts):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama_draft.path), speculative=TREES["chain"])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_drafts"] == sum(o.metrics["spec_num_drafts"] for o in outs)
    assert stats["num_accepted_tokens"] == sum(o.metrics["spec_num_accepted_tokens"] for o in outs)
    assert sum(stats["accepted_tokens_per_position"]) == stats["num_accepted_tokens"]
    assert len(stats["accepted_tokens_per_position"]) <= 4
    assert stats["mean_acceptance_length"] == pytest.approx(1 + stats["num_accepted_tokens"] / stats["num_drafts"])
    # Fewer target passes than tokens: that is the point of speculation.
    assert stats["num_target_forward_passes"] < stats["num_generated_tokens"]
    assert sum(stats["tree_sizes_per_step"]) == stats["num_draft_tokens"]
    # Every generated token either came with a verify pass or was accepted from a tree.
    assert stats["num_generated_tokens"] == 3 * MAX_TOKENS


def test_stops_inside_an_accepted_path_cut_exactly(tiny_llama, tiny_llama_draft, prompts, reference):
    """A stop token or max_tokens in the middle of an accepted path ends the output
    exactly where plain decoding would."""
    plain = LLM(str(tiny_llama.path), dtype="float32", device="cpu")
    spec = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama_draft.path), speculative=TREES["chain"])
    for prompt, ref in zip(prompts, reference):
        stop = ref[7]
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=True)
        a = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        b = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert a.token_ids == b.token_ids == ref[: ref.index(stop) + 1]
        assert b.finish_reason == "stop" and b.stop_reason == stop
    for max_tokens in (1, 2, 5):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        b = spec.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0]
        assert b.token_ids == reference[0][:max_tokens] and b.finish_reason == "length"
    _assert_all_free(spec)


def test_speculation_can_be_switched_off(tiny_llama, tiny_llama_draft, prompts, reference):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama_draft.path), speculative=TREES["static"])
    llm.engine.set_speculation(False)
    assert _generate(llm, prompts) == reference
    assert llm.stats()["num_drafts"] == 0
    llm.engine.set_speculation(True)
    assert _generate(llm, prompts) == reference
    assert llm.stats()["num_drafts"] > 0


def test_bad_speculative_settings_are_clear_errors(tiny_llama, tiny_qwen2):
    with pytest.raises(ValueError, match="tree must be one of"):
        SpeculativeConfig(tree="bush")
    with pytest.raises(ValueError, match="expansion"):
        SpeculativeConfig(expansion=(2, 0))
    with pytest.raises(ValueError, match="no draft_model"):
        LLM(str(tiny_llama.path), dtype="float32", device="cpu", speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="speculative: "):
        LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama.path), speculative={"bogus": 1})


def test_draft_with_another_vocabulary_is_rejected(tiny_llama, tmp_path):
    from tests.conftest import save_tiny_model

    other = save_tiny_model(tmp_path / "other", "llama", seed=3, with_tokenizer=False, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(other.path))


def test_a_draft_failure_costs_only_the_failing_request(tiny_llama, tiny_llama_draft, prompts, reference, caplog, monkeypatch):
    """Drafting that raises for one request: it decodes without speculation (same
    tokens), every other request of the same steps still speculates."""
    from pagedtree.speculative.drafting.draft_worker import DraftWorker

    bad = prompts[2]
    real = DraftWorker.propose

    def flaky(self, jobs):
        if any(job.request.prompt_token_ids == bad for job in jobs):
            raise RuntimeError("injected draft failure")
        return real(self, jobs)

    monkeypatch.setattr(DraftWorker, "propose", flaky)
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama_draft.path), speculative=TREES["static"])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with caplog.at_level("WARNING", logger="pagedtree"):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    drafts = [o.metrics["spec_num_drafts"] for o in outs]
    assert drafts[2] == 0 and all(d > 0 for i, d in enumerate(drafts) if i != 2)
    failures = [r.getMessage() for r in caplog.records if "failed for request" in r.getMessage()]
    assert failures and all(f"request {outs[2].request_id} " in f for f in failures)
    _assert_all_free(llm)
