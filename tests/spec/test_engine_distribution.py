"""The whole engine keeps the target's distribution with speculation on.

A tiny-vocabulary model (8 tokens) whose exact distributions transformers computes;
5,000 seeded requests with speculation on must pass a chi-square test against them.
The first generated token comes from the prefill pass, so the test looks at the next
two, ``(t2, t3)``: both come out of the first verify pass (an accepted node or the
bonus token) of a tree with siblings at the root and a second level.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedtree import LLM, SamplingParams
from pagedtree.spec import SpeculativeConfig
from pagedtree.spec import verify as verify_module
from tests.conftest import save_tiny_model
from tests.spec.conftest import save_perturbed_copy

VOCAB = 8
DRAWS = 5000
PROMPT = [3, 5, 1, 6]
TEMPERATURE = 0.9
# Leaves a budget of 3 nodes for the first tree (max_tokens - 1 prefill token - 1 bonus).
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_vocab_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_vocab")
    target = save_tiny_model(folder / "target", "llama", seed=7, with_tokenizer=False, vocab_size=VOCAB)
    # Spread the logits less than the default tiny models so that every cell of the
    # 8x8 table is likely enough to be tested.
    with torch.no_grad():
        target.hf_model.lm_head.weight.mul_(0.4)
    target.hf_model.save_pretrained(str(target.path))
    draft = save_perturbed_copy(target, folder / "draft", noise=0.6, seed=8)
    return target, draft


def _exact_joint(hf_model) -> np.ndarray:
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2)."""

    def probs(prefixes):
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1].double()
        return torch.softmax(logits / TEMPERATURE, -1)

    first = probs([[]])[0]
    second = probs([[a] for a in range(VOCAB)])  # [t1, t2]
    third = probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    return torch.einsum("a,ab,abc->bc", first, second, third).numpy()


def _sampled_joint(llm: LLM) -> np.ndarray:
    params = [
        SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True) for i in range(DRAWS)
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * DRAWS, params, use_tqdm=False)
    counts = np.zeros((VOCAB, VOCAB))
    for out in outs:
        _, a, b = out.outputs[0].token_ids[:3]
        counts[a, b] += 1
    return counts


def _pvalue(counts: np.ndarray, joint: np.ndarray) -> float:
    expected = joint.flatten() * counts.sum()
    observed = counts.flatten()
    # Pool cells too rare for the chi-square approximation into one.
    rare = expected < 5
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    return float(chisquare(observed, expected).pvalue)


def _llm(pair, **spec) -> LLM:
    target, draft = pair
    return LLM(
        str(target.path), device="cpu", max_num_seqs=256, max_num_batched_tokens=8192,
        draft_model=str(draft.path), speculative=SpeculativeConfig(adaptive=False, **spec),
    )


@pytest.mark.parametrize(
    "spec",
    [
        dict(tree="static", expansion=(2, 1), draft_sampling="without_replacement"),
        dict(tree="static", expansion=(2, 1), draft_sampling="iid"),
        dict(tree="static", expansion=(2, 1), draft_sampling="topk"),
        dict(tree="chain", depth=3, draft_sampling="without_replacement"),
        dict(tree="dynamic", top_k=2, depth=2, max_nodes=3),
        dict(tree="sequoia", depth=2, max_nodes=3, draft_sampling="iid", acceptance_rates=(0.4, 0.3, 0.2)),
    ],
    ids=lambda s: f"{s['tree']}-{s.get('draft_sampling', 'topk')}",
)
def test_engine_samples_the_target_distribution(tiny_vocab_pair, spec):
    llm = _llm(tiny_vocab_pair, **spec)
    counts = _sampled_joint(llm)
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert _pvalue(counts, _exact_joint(tiny_vocab_pair[0].hf_model)) > 0.01
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_engine_with_a_wrong_rule_fails(tiny_vocab_pair, monkeypatch):
    """Verifying random draws as if q were uniform over the vocabulary is wrong."""
    real = verify_module.verify_stochastic

    def wrong(tree, probs, generator):
        for draw in tree.draws:
            if draw.probs is not None:
                draw.probs = torch.full_like(draw.probs, 1.0 / draw.probs.numel())
        return real(tree, probs, generator)

    monkeypatch.setattr("pagedtree.engine.speculator.verify_stochastic", wrong)
    llm = _llm(tiny_vocab_pair, tree="static", expansion=(2, 1), draft_sampling="iid")
    counts = _sampled_joint(llm)
    assert _pvalue(counts, _exact_joint(tiny_vocab_pair[0].hf_model)) < 1e-4
