"""Stochastic verification keeps the target's distribution (chi-square tests).

Two levels: the verifier alone on exactly known distributions (fast, every rule and
tree kind, and a deliberately wrong rule that must fail), and the whole engine on a
tiny-vocabulary model whose exact next-token distributions transformers computes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedtree.sampling_params import SamplingParams
from pagedtree.spec import builders
from pagedtree.spec.builders import DynamicTreeBuilder, ShapeTreeBuilder
from pagedtree.spec.sequoia import optimal_shape
from pagedtree.spec.tree import ChildDraw, TreeShape
from pagedtree.spec.verify import verify_stochastic

V = 5
DRAWS = 5000
P_MIN = 0.01


def _tables(seed: int):
    """Target p and draft q, at the root and after each first token."""
    g = torch.Generator().manual_seed(seed)
    p_root = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q_root = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    q_next = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return p_root, q_root, p_next, q_next


def _builder(kind: str, rule: str, generator):
    params = SamplingParams(temperature=1.0)
    if kind == "static":
        return ShapeTreeBuilder(TreeShape.from_expansion((3, 2), 16), 0, params, rule, generator)
    if kind == "chain":
        return ShapeTreeBuilder(TreeShape.chain(2), 0, params, rule, generator)
    if kind == "sequoia":
        return ShapeTreeBuilder(optimal_shape((0.5, 0.3, 0.2), 6, 2), 0, params, rule, generator)
    return DynamicTreeBuilder(3, 2, 5, 0, params, generator)


def _first_two_tokens(kind: str, rule: str, seed: int) -> np.ndarray:
    """Counts of (t1, t2) over DRAWS verifications of fresh two-level trees."""
    p_root, q_root, p_next, q_next = _tables(seed)
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(DRAWS):
        b = _builder(kind, rule, gen)
        feed = b.expand_level([(-1, q_root.log())])
        b.expand_level([(n, q_next[b.tree.tokens[n]].log()) for n in feed])
        tree = b.finish()
        rows = torch.stack([p_root] + [p_next[t] if d == 1 else p_next[0] for t, d in zip(tree.tokens, tree.depths)])
        # Rows of depth-2 nodes are never reached by a two-token check except as the
        # bonus row, which the loop below replaces by the exact conditional.
        result = verify_stochastic(tree, rows, gen)
        tokens = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
        if len(tokens) == 1:
            tokens.append(int(torch.multinomial(p_next[tokens[0]], 1, generator=gen)))
        counts[tokens[0], tokens[1]] += 1
    return counts


def _expected(seed: int) -> np.ndarray:
    p_root, _, p_next, _ = _tables(seed)
    return (p_root[:, None] * p_next).double().numpy() * DRAWS


def _pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    expected = expected.astype(np.float64)
    return float(chisquare(counts.flatten(), expected.flatten() * counts.sum() / expected.sum()).pvalue)


FAST_CASES = [("static", "iid"), ("static", "without_replacement"), ("static", "topk"), ("dynamic", "topk")]
SLOW_CASES = [
    (k, r) for k, r in itertools.product(["chain", "sequoia"], ["iid", "without_replacement", "topk"])
]


@pytest.mark.parametrize(
    "kind,rule", FAST_CASES + [pytest.param(k, r, marks=pytest.mark.slow) for k, r in SLOW_CASES]
)
def test_verification_preserves_the_target_distribution(kind, rule):
    counts = _first_two_tokens(kind, rule, seed=3)
    assert _pvalue(counts, _expected(3)) > P_MIN


def test_a_wrong_rule_fails_the_same_test(monkeypatch):
    """The draft's deterministic top-k children verified as if they were random draws
    from q (the min(1, p/q) test): over-accepts the draft's favourites.

    (The converse mistake is harmless: the top-k rule is exact for any set of tried
    tokens chosen independently of the target's randomness, just less efficient.)
    """
    real = builders.pick_children

    def mislabelled(logprobs, k, rule, generator):
        tokens, _ = real(logprobs, k, "topk", generator)
        return tokens, ChildDraw("without_replacement", logprobs.exp())

    monkeypatch.setattr(builders, "pick_children", mislabelled)
    counts = _first_two_tokens("static", "without_replacement", seed=3)
    assert _pvalue(counts, _expected(3)) < 1e-6


def test_draws_without_replacement_verified_as_iid_fail():
    p_root, q_root, *_ = _tables(4)
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros(V)
    for _ in range(DRAWS):
        b = ShapeTreeBuilder(TreeShape.from_expansion((4,), 8), 0, SamplingParams(temperature=1.0), "without_replacement", gen)
        b.expand_level([(-1, q_root.log())])
        tree = b.finish()
        tree.draws[0].rule = "iid"  # the wrong rule for these draws
        result = verify_stochastic(tree, torch.stack([p_root] + [p_root] * tree.num_nodes), gen)
        first = tree.tokens[result.accepted_nodes[0]] if result.accepted_nodes else result.bonus_token
        counts[first] += 1
    assert chisquare(counts, p_root.double().numpy() * DRAWS).pvalue < 1e-6
