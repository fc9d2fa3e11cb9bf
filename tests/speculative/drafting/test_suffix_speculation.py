"""The suffix drafter in the engine: exact greedy output, the target's distribution
when sampling, seeded output equal to plain decoding, nothing leaked."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from tests.conftest import assert_no_leaks, hf_greedy, random_prompts
from tests.speculative.test_engine_distribution import (
    FAST_DRAWS,
    MAX_TOKENS,
    P_MIN,
    PROMPT,
    VOCAB,
    _exact_joint,
    _pvalue,
    _sampled_joint,
    _target,
)
from tests.speculative.conftest import save_perturbed_copy

GREEDY_TOKENS = 24


def repetitive_prompts() -> list[list[int]]:
    """Random prompts with a repeated segment (what the suffix drafter feeds on), and
    plain random ones."""
    base = random_prompts(6, 256, 4, 16, seed=21)
    return [p + p + p[: len(p) // 2] for p in base[:4]] + base[4:]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return [hf_greedy(tiny_llama.hf_model, p, GREEDY_TOKENS) for p in repetitive_prompts()]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in repetitive_prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_suffix_drafter_greedy_matches_transformers(tiny_llama, reference, block_size):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=block_size, max_num_seqs=4,
              speculative=SpeculativeConfig(drafter="suffix", max_nodes=8, adaptive=False))
    assert _greedy(llm) == reference
    # Twice: the second run also draws on the global tree of the first run's outputs.
    assert _greedy(llm) == reference
    stats = llm.stats()
    assert stats["suffix_num_proposals"] > 0
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["suffix_global_tokens"] > 0 and stats["suffix_num_requests"] == 0
    assert stats["num_draft_forward_passes"] == 0  # model-free
    assert_no_leaks(llm)


def test_suffix_and_draft_model_trees_merge_exactly(tiny_llama, tiny_llama_draft, reference):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=6,
              draft_model=str(tiny_llama_draft.path),
              speculative=SpeculativeConfig(drafter="model+suffix", tree="chain", depth=3, max_nodes=8, adaptive=False))
    assert _greedy(llm) == reference
    stats = llm.stats()
    assert stats["suffix_num_proposals"] > 0 and stats["num_draft_forward_passes"] > 0
    assert_no_leaks(llm)
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]


def _suffix_llm(target, drafts=(), **spec) -> LLM:
    spec = dict(drafter="suffix" if not drafts else "model+suffix", adaptive=False, max_nodes=3,
                suffix_min_prob=0.0, suffix_alpha=4.0) | spec
    return LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=256, max_num_batched_tokens=8192,
               seed=1, draft_model=[str(d.path) for d in drafts] or None, speculative=SpeculativeConfig(**spec))


@pytest.fixture(scope="module")
def peaked_pair(tmp_path_factory):
    """An 8-token target peaked enough that suffix proposals are often accepted (with
    a near-uniform one, accepting 1.5x too often went unnoticed), and a draft."""
    folder = tmp_path_factory.mktemp("suffix_vocab")
    target = _target(folder, seed=7, logit_scale=1.5)
    return target, save_perturbed_copy(target, folder / "draft", noise=0.6, seed=8)


@pytest.mark.parametrize("with_draft", [False, True], ids=["suffix", "model+suffix-iid"])
def test_suffix_drafter_samples_the_target_distribution(peaked_pair, with_draft):
    """Deterministic suffix proposals (alone, or merged with a draft's random draws)
    verified by rejection sampling keep the target's distribution."""
    target, draft = peaked_pair
    llm = _suffix_llm(target, [draft] if with_draft else (), tree="static", expansion=(2, 1), draft_sampling="iid")
    counts, _ = _sampled_joint(llm, draws=FAST_DRAWS)
    stats = llm.stats()
    assert stats["suffix_num_proposals"] > FAST_DRAWS // 4
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert _pvalue(counts, _exact_joint(target.hf_model)) > P_MIN
    assert_no_leaks(llm)


def test_seeded_requests_with_the_suffix_drafter_equal_plain_decoding(peaked_pair):
    target, _ = peaked_pair
    plain = LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=64, seed=1)
    params = [SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True) for i in range(200)]
    prompts = [{"prompt_token_ids": PROMPT}] * len(params)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _suffix_llm(target)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.stats()["suffix_num_proposals"] > 0
    assert np.all(np.array([len(t) for t in got]) == MAX_TOKENS) and max(max(t) for t in got) < VOCAB


def test_suffix_config_is_validated():
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeConfig(drafter="ngram")
    with pytest.raises(ValueError, match="suffix_max_match"):
        SpeculativeConfig(drafter="suffix", suffix_max_match=0)
    with pytest.raises(ValueError, match="suffix_global_tokens"):
        SpeculativeConfig(drafter="suffix", suffix_global_tokens=-1)
    for bad in (0, 9, 2.5, True):
        with pytest.raises(ValueError, match="suffix_min_match"):
            SpeculativeConfig(drafter="suffix", suffix_max_match=8, suffix_min_match=bad)
    from pagedtree.config import EngineConfig

    with pytest.raises(ValueError, match="model\\+suffix"):
        EngineConfig(draft_model="x", speculative=SpeculativeConfig(drafter="suffix"))
    with pytest.raises(ValueError, match="no draft_model"):
        EngineConfig(speculative=SpeculativeConfig(drafter="model"))


def test_a_confident_suffix_tree_is_verified_without_the_draft_model(tiny_llama, tiny_llama_draft):
    """Beside a draft model (static budget), a request whose suffix tree is confident
    is drafted by it alone: the draft model sits that step out, and the output stays
    exact."""
    base = random_prompts(1, 256, 8, 8, seed=5)[0]
    prompt = base * 4  # seen continued often enough to be confident
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", max_num_seqs=4,
              draft_model=str(tiny_llama_draft.path),
              speculative=SpeculativeConfig(drafter="model+suffix", tree="chain", depth=3, max_nodes=8,
                                            suffix_min_prob=0.0, adaptive=False))
    draft = llm.engine.speculation.drafts[0]
    calls = []
    real_propose = draft.propose

    def spy(jobs):
        calls.append(len(jobs))
        return real_propose(jobs)

    draft.propose = spy
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(tiny_llama.hf_model, prompt, 40)
    stats = llm.stats()
    assert stats["suffix_num_alone"] > 0
    # Batch 1: every tree came either from a draft-model call or from the suffix alone.
    assert len(calls) + stats["suffix_num_alone"] == stats["num_drafts"]
    # The trees verified alone taught the acceptance of their matches, and only it.
    from pagedtree.speculative.budget.suffix_acceptance import SuffixAcceptance

    prior = {f"{c}@{b}": t.rate(1, 0) for (c, b), t in SuffixAcceptance().tables.items()}
    assert stats["suffix_match_rates"].keys() == prior.keys()
    moved = {k for k, rate in stats["suffix_match_rates"].items() if rate != prior[k]}
    assert moved and all(k.startswith("greedy@") for k in moved)
    assert_no_leaks(llm)


def test_a_single_stream_on_a_cpu_drafts_with_the_suffix_drafter_by_default(tiny_llama, tiny_llama_draft, reference):
    """With a draft model and no tree asked for, a stream on a CPU (``LLM``) runs the
    draft's chain beside the suffix drafter; a server's engine (``workload="batch"``)
    and any tree the caller chose keep what they were given; outputs stay exact."""
    from pagedtree.config import CPU_STREAM_SPECULATION, EngineConfig
    from pagedtree.loading.resolve import resolve_config

    def resolved(**kwargs):
        return resolve_config(EngineConfig(model=str(tiny_llama.path), draft_model=str(tiny_llama_draft.path),
                                           device="cpu", **kwargs)).speculative

    stream = SpeculativeConfig(**CPU_STREAM_SPECULATION)
    assert stream.drafter == "model+suffix" and stream.suffix_min_match > 1
    assert resolved() == resolved(workload="stream") == stream
    assert resolved(workload="batch") == SpeculativeConfig()
    # A tree the caller chose stays as chosen, the chain alone included.
    for chosen in (SpeculativeConfig(tree="chain", depth=3, max_nodes=3), SpeculativeConfig()):
        assert resolved(speculative=chosen) == chosen
    # How the drafts draft applies over either: the default's trees stay the default's.
    settings = {"draft_min_prob": 0.5, "draft_vocab_size": 64}
    assert resolved(draft_settings=settings) == SpeculativeConfig(**CPU_STREAM_SPECULATION, **settings)
    assert resolved(draft_settings=settings, workload="batch") == SpeculativeConfig(**settings)
    assert resolved(draft_settings=settings, speculative={"depth": 3}) == SpeculativeConfig(depth=3, **settings)
    for bad in ({"depth": 3}, {"draft_min_prob": 2.0}, [("draft_min_prob", 0.5)]):
        with pytest.raises(ValueError, match="draft_settings|draft_min_prob"):
            resolved(draft_settings=bad)
    with pytest.raises(ValueError, match="no draft_model"):
        EngineConfig(model=str(tiny_llama.path), draft_settings={"draft_min_prob": 0.5})
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=6,
              draft_model=str(tiny_llama_draft.path))
    assert llm.engine.speculation.config == stream
    assert _greedy(llm) == reference
    assert_no_leaks(llm)


def test_the_suffix_drafter_switches_off_and_on_beside_a_draft_model(tiny_llama, tiny_llama_draft, reference):
    """``reconfigure`` to a draft model's preset sits the suffix drafter out (no
    proposals, its requests' trees released) and back on; outputs stay exact."""
    from pagedtree.speculative.presets import tree_preset

    spec = SpeculativeConfig(drafter="model+suffix", tree="chain", depth=3, max_nodes=8, adaptive=False)
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=6,
              draft_model=str(tiny_llama_draft.path), speculative=spec)
    speculator = llm.engine.speculation
    suffix = speculator.proposer.suffix
    assert _greedy(llm) == reference
    before = llm.stats()["suffix_num_proposals"]
    assert before > 0
    speculator.reconfigure(SpeculativeConfig(**tree_preset("chain-3")))
    assert speculator.proposer.suffix is None and speculator.budget.suffix_tree is None
    assert suffix.num_requests == 0
    drafts = llm.stats()["num_drafts"]
    assert _greedy(llm) == reference
    stats = llm.stats()
    assert stats["num_drafts"] > drafts and "suffix_num_proposals" not in stats
    speculator.reconfigure(spec)
    assert speculator.proposer.suffix is suffix  # the same drafter, its outputs remembered
    assert _greedy(llm) == reference
    assert llm.stats()["suffix_num_proposals"] > before
    # Other suffix settings: a new drafter with them.
    speculator.reconfigure(dataclasses.replace(spec, suffix_min_match=2))
    assert speculator.proposer.suffix is not suffix and speculator.proposer.suffix.config.min_match == 2
    assert _greedy(llm) == reference
    with pytest.raises(ValueError, match="drafter 'suffix'"):
        speculator.reconfigure(SpeculativeConfig(drafter="suffix", max_nodes=8))
    assert_no_leaks(llm)
