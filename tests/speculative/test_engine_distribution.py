"""The whole engine keeps the target's distribution with speculation on.

A tiny-vocabulary model (8 tokens) whose exact distributions transformers computes;
thousands of requests with speculation on must pass a chi-square test against them.
The first generated token comes from the prefill pass, so the tests look at the
next two, ``(t2, t3)``: both come out of the first verify pass (an accepted node or
the bonus token) of a tree with siblings at the root and a second level.

Unseeded requests exercise stochastic verification (SpecInfer's multi-step
speculative sampling), one engine seed making the run repeatable; seeded requests
exercise coupled verification, whose tokens must equal plain decoding's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.verification import rules as verify_module
from tests.conftest import save_tiny_model
from tests.speculative.conftest import save_perturbed_copy

VOCAB = 8
DRAWS = 5000
PROMPT = [3, 5, 1, 6]
TEMPERATURE = 0.9
# Leaves a budget of 3 nodes for the first tree (max_tokens - 1 prefill token - 1 bonus).
MAX_TOKENS = 5
P_MIN = 0.001


def _target(folder, seed: int, logit_scale: float):
    """A tiny 8-token Llama whose output logits are scaled by ``logit_scale``."""
    target = save_tiny_model(folder / "target", "llama", seed=seed, with_tokenizer=False, vocab_size=VOCAB)
    with torch.no_grad():
        target.hf_model.lm_head.weight.mul_(logit_scale)
    target.hf_model.save_pretrained(str(target.path))
    return target


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vocab")
    # Spread the logits less than the default tiny models so that every cell of the
    # 8x8 table is likely enough to be tested.
    target = _target(folder, seed=7, logit_scale=0.4)
    draft = save_perturbed_copy(target, folder / "draft", noise=0.6, seed=8)
    return target, draft


def _exact_joint(hf_model, temperature: float = TEMPERATURE) -> np.ndarray:
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2)."""

    def probs(prefixes):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].double()
        return torch.softmax(logits / temperature, -1)

    first = probs([[]])[0]
    second = probs([[a] for a in range(VOCAB)])  # [t1, t2]
    third = probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", first, second, third).numpy()


def _exact_first_pair(hf_model, temperature: float = TEMPERATURE) -> np.ndarray:
    """P(t1, t2) = p(t1) p(t2 | t1): the second token's conditional distribution."""
    with torch.no_grad():
        prefixes = [PROMPT] + [PROMPT + [a] for a in range(VOCAB)]
        logits = hf_model(torch.tensor([p + [0] * (len(PROMPT) + 1 - len(p)) for p in prefixes])).logits.double()
    first = torch.softmax(logits[0, len(PROMPT) - 1] / temperature, -1)
    second = torch.softmax(logits[1:, len(PROMPT)] / temperature, -1)
    return (first[:, None] * second).numpy()


def _sampled_joint(
    llm: LLM, seeded: bool = False, draws: int = DRAWS, temperature: float = TEMPERATURE, first: int = 1
) -> tuple[np.ndarray, list[list[int]]]:
    """Counts of (t2, t3) (or of the pair from token ``first``) over ``draws``
    requests, and every request's tokens."""
    params = [
        SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=i if seeded else None, ignore_eos=True)
        for i in range(draws)
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * draws, params, use_tqdm=False)
    counts = np.zeros((VOCAB, VOCAB))
    tokens = [out.outputs[0].token_ids for out in outs]
    for t in tokens:
        counts[t[first], t[first + 1]] += 1
    return counts, tokens


def _pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    expected = joint.flatten() * counts.sum()
    observed = counts.flatten()
    # Pool cells too rare for the chi-square approximation into one.
    rare = expected < 5
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    return float(chisquare(observed, expected).pvalue)


def _llm(target, drafts, max_num_seqs: int = 256, **spec) -> LLM:
    return LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, 4 * max_num_seqs),
        seed=1, draft_model=[str(d.path) for d in drafts], speculative=SpeculativeConfig(adaptive=False, **spec),
    )


SINGLE_DRAFT_SPECS = [
    dict(tree="static", expansion=(2, 1), draft_sampling="without_replacement"),
    dict(tree="static", expansion=(2, 1), draft_sampling="iid"),
    dict(tree="static", expansion=(2, 1), draft_sampling="topk"),
    dict(tree="chain", depth=3, draft_sampling="without_replacement"),
    dict(tree="dynamic", top_k=2, depth=2, max_nodes=3),
    dict(tree="sequoia", depth=2, max_nodes=3, draft_sampling="iid", acceptance_rates=(0.4, 0.3, 0.2)),
]
FAST_DRAWS = 1500


def _spec_id(spec: dict) -> str:
    return f"{spec['tree']}-{spec.get('draft_sampling', 'topk')}"


# Every rule and tree kind at full power (5,000 draws) under -m slow; a static tree
# and a chain with a cut draft vocabulary with fewer draws in the default suite.
@pytest.mark.parametrize(
    "spec,draws",
    [pytest.param(s, DRAWS, marks=pytest.mark.slow, id=_spec_id(s)) for s in SINGLE_DRAFT_SPECS]
    + [pytest.param(SINGLE_DRAFT_SPECS[0], FAST_DRAWS, id=f"{_spec_id(SINGLE_DRAFT_SPECS[0])}-fast"),
       pytest.param(SINGLE_DRAFT_SPECS[4], FAST_DRAWS, id=f"{_spec_id(SINGLE_DRAFT_SPECS[4])}-fast",
                    marks=pytest.mark.slow)]
    # a draft whose head keeps half the vocabulary: it cannot propose the other half
    + [pytest.param(dict(SINGLE_DRAFT_SPECS[3], draft_vocab_size=VOCAB // 2), FAST_DRAWS, id="chain-cut-vocab")],
)
def test_engine_samples_the_target_distribution(tiny_vocab_pair, spec, draws):
    target, draft = tiny_vocab_pair
    llm = _llm(target, [draft], **spec)
    counts, _ = _sampled_joint(llm, draws=draws)
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert _pvalue(counts, _exact_joint(target.hf_model)) > P_MIN
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_engine_with_a_wrong_rule_fails(tiny_vocab_pair, monkeypatch):
    """Verifying random draws as if q were uniform over the vocabulary is wrong."""
    class Wrong(verify_module.RowTests):
        def __init__(self, tree, probs, generator):
            for draw in tree.draws:
                if draw.probs is not None:
                    draw.probs = torch.full_like(draw.probs, 1.0 / draw.probs.numel())
            super().__init__(tree, probs, generator)

    monkeypatch.setattr("pagedtree.speculative.verification.verifier.RowTests", Wrong)
    target, draft = tiny_vocab_pair
    llm = _llm(target, [draft], tree="static", expansion=(2, 1), draft_sampling="iid")
    counts, _ = _sampled_joint(llm, draws=FAST_DRAWS)  # the default suite's power must see it
    assert _pvalue(counts, _exact_joint(target.hf_model)) < 1e-4


# ----------------------------------------------------------------- two drafts
@pytest.fixture(scope="module")
def peaked_models(tmp_path_factory):
    """A peaked target (a few likely tokens per position, where coupled draws of two
    drafts show) and two drafts: a perturbed copy, and a copy of that copy perturbed
    a little more (correlated with the first)."""
    folder = tmp_path_factory.mktemp("peaked")
    target = _target(folder, seed=27, logit_scale=2.5)
    # Chosen (seeds, scale, noise) so that treating a repeated draw as a fresh one
    # moves the first verified token's distribution far: the test has power.
    draft = save_perturbed_copy(target, folder / "draft", noise=1.0, seed=18)
    other = save_perturbed_copy(draft, folder / "draft2", noise=0.1, seed=19)
    return target, draft, other


TWO_DRAFT_DRAWS = 4000


# All eight combinations under -m slow (about 10 s each); one with fewer draws in the
# default suite.
_DEFAULT_TWO_DRAFT = {("same-draft-twice", "chain", "without_replacement")}


@pytest.mark.parametrize(
    "pair,tree,rule,draws",
    [pytest.param(p, t, r, FAST_DRAWS, id=f"{p}-{t}-{r}-fast")
     for p, t, r in sorted(_DEFAULT_TWO_DRAFT)]
    + [pytest.param(p, t, r, TWO_DRAFT_DRAWS, id=f"{p}-{t}-{r}", marks=pytest.mark.slow)
       for p in ("same-draft-twice", "correlated-drafts") for t in ("chain", "static")
       for r in ("without_replacement", "iid")],
)
def test_two_drafts_sample_the_target_distribution(peaked_models, pair, tree, rule, draws):
    """Each draft draws from its own random stream, and verification replays every
    draft's proposals against that draft's q: the merged tree keeps the target's
    distribution. (With both drafts on one stream, the same draft twice proposed the
    same tokens twice and the second-token distribution was far off.)"""
    target, draft, other = peaked_models
    drafts = [draft, draft] if pair == "same-draft-twice" else [draft, other]
    spec = dict(tree="chain", depth=3) if tree == "chain" else dict(tree="static", expansion=(2, 1))
    # Every request in one batch: all first trees are verified in the same step.
    llm = _llm(target, drafts, max_num_seqs=draws, draft_sampling=rule, **spec)
    counts, _ = _sampled_joint(llm, draws=draws, first=0)
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert _pvalue(counts, _exact_first_pair(target.hf_model)) > P_MIN
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]


def test_two_drafts_with_a_budget_of_one_still_speculate(peaked_models, caplog):
    """max_tokens=3 leaves one node per tree after the first token; two drafts share
    it (random draws) or both propose and the merge keeps the best (top-k)."""
    target, draft, other = peaked_models
    for rule in ("without_replacement", "iid", "topk"):
        llm = _llm(target, [draft, other], tree="chain", depth=3, draft_sampling=rule)
        params = [SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True) for _ in range(50)]
        params.append(SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        with caplog.at_level("WARNING", logger="pagedtree"):
            outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
        stats = llm.stats()
        assert stats["num_drafts"] > 0 and set(stats["tree_sizes_per_step"]) - {0}
        assert max(stats["tree_sizes_per_step"]) <= len(params)  # one node per request
        assert not [r for r in caplog.records if "fail" in r.getMessage()], rule


# ---------------------------------------------------------- seeded (coupled)
SEEDED_SPECS = [
    dict(tree="static", expansion=(2, 1)),
    dict(tree="chain", depth=3),
    dict(tree="dynamic", top_k=2, depth=2, max_nodes=3),
]


# Token-for-token equality is checked request by request, so 400 seeded requests
# (each tree accepting and rejecting many times) show a coupling bug as well as
# 1,000; the distribution of the plain seeded sampler itself is tested at 5,000
# draws below. -m slow runs 1,000 requests per tree.
@pytest.mark.parametrize(
    "spec,draws",
    [pytest.param(s, 400, id=s["tree"]) for s in SEEDED_SPECS]
    + [pytest.param(s, 1000, id=f"{s['tree']}-1000", marks=pytest.mark.slow) for s in SEEDED_SPECS],
)
def test_seeded_requests_draw_the_plain_tokens_with_speculation(tiny_vocab_pair, spec, draws):
    """Seeded sampling draws by Gumbel-max with noise keyed by (seed, position), and
    coupled verification draws the same token at every tree node: with speculation
    the tokens are exactly plain decoding's, which follow the target's distribution."""
    target, draft = tiny_vocab_pair
    plain = LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=256, max_num_batched_tokens=8192)
    spec_llm = _llm(target, [draft], **spec)
    counts, plain_tokens = _sampled_joint(plain, seeded=True, draws=draws)
    _, spec_tokens = _sampled_joint(spec_llm, seeded=True, draws=draws)
    assert spec_tokens == plain_tokens
    stats = spec_llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert _pvalue(counts, _exact_joint(target.hf_model)) > P_MIN


def test_seeded_sampling_follows_the_target_distribution(tiny_vocab_pair):
    """The seeded (Gumbel-max) sampler on its own, at another temperature."""
    target, _ = tiny_vocab_pair
    plain = LLM(str(target.path), dtype="float32", device="cpu", max_num_seqs=256, max_num_batched_tokens=8192)
    counts, _ = _sampled_joint(plain, seeded=True, draws=DRAWS, temperature=1.3)
    assert _pvalue(counts, _exact_joint(target.hf_model, temperature=1.3)) > P_MIN
