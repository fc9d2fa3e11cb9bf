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
from pagedtree.speculative.drafting import builders
from pagedtree.speculative.drafting.builders import DynamicTreeBuilder, ShapeTreeBuilder
from pagedtree.draft_sampling import draw_by_rule, read_drawn
from pagedtree.speculative.drafting.merge import merge_trees
from pagedtree.speculative.budget.sequoia import optimal_shape
from pagedtree.speculative.tree import ROOT, ChildDraw, TreeShape
from pagedtree.speculative.verification.rules import verify_stochastic

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
    # Branches that end below a token drawn with less than 0.25 (``draft_min_prob``):
    # which nodes grow depends on what was drawn.
    if kind == "static-unsure":
        return ShapeTreeBuilder(TreeShape.from_expansion((3, 2), 16), 0, params, rule, generator, min_prob=0.25)
    if kind == "dynamic-unsure":
        return DynamicTreeBuilder(3, 2, 5, 0, params, min_prob=0.25)
    return DynamicTreeBuilder(3, 2, 5, 0, params)


def _first_two_tokens(kind: str, rule: str, seed: int, draws: int = DRAWS) -> np.ndarray:
    """Counts of (t1, t2) over ``draws`` verifications of fresh two-level trees."""
    p_root, q_root, p_next, q_next = _tables(seed)
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(draws):
        tree = _grow(_builder(kind, rule, gen), q_root, q_next)
        counts[_first_two_tokens_of(tree, p_root, p_next, gen)] += 1
    return counts


def _grow(builder, q_root: torch.Tensor, q_next: torch.Tensor):
    """A two-level tree from the draft tables."""
    feed = builder.expand_level([(-1, q_root.log())])
    builder.expand_level([(n, q_next[builder.tree.tokens[n]].log()) for n in feed])
    return builder.finish()


def _first_two_tokens_of(tree, p_root: torch.Tensor, p_next: torch.Tensor, gen) -> tuple[int, int]:
    """Verify ``tree`` against the target tables; the first two tokens it yields."""
    # Rows of depth-2 nodes are never reached by a two-token check except as the
    # bonus row, which is replaced below by the exact conditional.
    rows = torch.stack([p_root] + [p_next[t] if d == 1 else p_next[0] for t, d in zip(tree.tokens, tree.depths)])
    result = verify_stochastic(tree, rows, gen)
    tokens = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
    if len(tokens) == 1:
        tokens.append(int(torch.multinomial(p_next[tokens[0]], 1, generator=gen)))
    return tokens[0], tokens[1]


def _expected(seed: int) -> np.ndarray:
    p_root, _, p_next, _ = _tables(seed)
    return (p_root[:, None] * p_next).double().numpy() * DRAWS


def _pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    expected = expected.astype(np.float64)
    return float(chisquare(counts.flatten(), expected.flatten() * counts.sum() / expected.sum()).pvalue)


# The default suite tests the static and dynamic trees with fewer draws (the same
# p > P_MIN threshold, less power); -m slow every kind and rule at full power. The
# mutation checks below run in the default suite with as many draws as keep their
# power overwhelming (each says why), at full draws under -m slow.
# A single tree's verification: 1,000 draws, where the wrong rule below (0.84 of
# chi-square per draw) would reach a noncentrality of 840 against a critical value
# of 43 for p < P_MIN. Merged trees of two drafts: 2,000, where one shared random
# stream (0.046 per draw) reaches 92 against 43.
FAST_DRAWS = 2000
SINGLE_TREE_FAST_DRAWS = 1000
FAST_CASES = [("static", "iid"), ("static", "without_replacement"), ("static", "topk"), ("dynamic", "topk"),
              ("static-unsure", "without_replacement")]
SLOW_CASES = [
    (k, r) for k, r in itertools.product(["chain", "sequoia"], ["iid", "without_replacement", "topk"])
] + [("static-unsure", "iid"), ("static-unsure", "topk"), ("dynamic-unsure", "topk")]


@pytest.mark.parametrize(
    "kind,rule,draws", [(k, r, SINGLE_TREE_FAST_DRAWS) for k, r in FAST_CASES]
    + [pytest.param(k, r, DRAWS, marks=pytest.mark.slow) for k, r in FAST_CASES + SLOW_CASES]
)
def test_verification_preserves_the_target_distribution(kind, rule, draws):
    counts = _first_two_tokens(kind, rule, seed=3, draws=draws)
    assert _pvalue(counts, _expected(3)) > P_MIN


def _grow_whole(builder, q_root: torch.Tensor, q_next: torch.Tensor):
    """A two-level tree grown as a whole draft grows it (``DraftWorker._propose_whole``):
    the root's children drawn, then every shape node with children fed the token
    drawn for it whatever it is (a repeated i.i.d. draw, a token of probability 0)
    and its children drawn, in the worker's order, all read back at once and grown
    (``grow_drawn``), which drops what level by level would not have grown."""
    root = draw_by_rule(q_root.log(), builder.child_rule(ROOT, 0))
    drawn = {ROOT: root}
    for rank, kid in enumerate(builder.shape_children(ROOT)):
        if builder.shape_children(kid):
            token = int(root.tokens[rank])
            drawn[kid] = draw_by_rule(q_next[token].log(), builder.child_rule(kid, 1))
    staged = {node: builders.StagedChildren(ROOT, d.tokens, d.increments, ChildDraw(builder.rule, ROOT, probs=d.probs),
                                            host_tokens=tokens, host_increments=increments)
              for (node, d), (tokens, increments) in zip(drawn.items(), read_drawn(list(drawn.values())))}
    builder.grow_drawn(staged)
    return builder.finish()


@pytest.mark.parametrize("rule", ["iid", "without_replacement"])
@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
@pytest.mark.parametrize("draws", [SINGLE_TREE_FAST_DRAWS, pytest.param(DRAWS, marks=pytest.mark.slow)])
def test_trees_drafted_whole_keep_the_distribution(rule, sparse, draws):
    """Random draws in a tree drafted whole: repeated i.i.d. draws (5 tokens, 3 draws)
    and, with a sparse draft (2 tokens of 5 possible at the root), children the rule
    could not draw are fed and drawn below all the same, then dropped; the draws
    after them come further along the stream. The target's distribution holds."""
    seed = 3
    p_root, q_root, p_next, q_next = _tables(seed)
    if sparse:
        q_root = q_root.clone()
        q_root[q_root.argsort()[:3]] = 0.0
        q_root /= q_root.sum()
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(draws):
        tree = _grow_whole(_builder("static", rule, gen), q_root, q_next)
        counts[_first_two_tokens_of(tree, p_root, p_next, gen)] += 1
    assert _pvalue(counts, _expected(seed)) > P_MIN


# The mislabelled top-k moves the chi-square statistic by about 0.84 per draw (4,200
# at 5,000 draws, df 24): at 1,000 draws its noncentrality is about 840 against a
# critical value of 72 for p < 1e-6, a miss probability far below 1e-100.
WRONG_RULE_DRAWS = 1000


@pytest.mark.parametrize("draws", [WRONG_RULE_DRAWS, pytest.param(DRAWS, marks=pytest.mark.slow)])
def test_a_wrong_rule_fails_the_same_test(monkeypatch, draws):
    """The draft's deterministic top-k children verified as if they were random draws
    from q (the min(1, p/q) test): over-accepts the draft's favourites.

    (The converse mistake is harmless: the top-k rule is exact for any set of tried
    tokens chosen independently of the target's randomness, just less efficient.)
    """
    real = builders.stage_children

    def mislabelled(logprobs, k, rule, generator, noise=None):
        tokens, increments, _ = real(logprobs, k, "topk", generator)
        return tokens, increments, ChildDraw("without_replacement", ROOT, probs=logprobs.exp())

    monkeypatch.setattr(builders, "stage_children", mislabelled)
    counts = _first_two_tokens("static", "without_replacement", seed=3, draws=draws)
    assert _pvalue(counts, _expected(3)) < 1e-6


# How far the wrong rule moves the first token depends on how far q is from p. The
# tables of seed 0 (p and q favour different tokens) move the chi-square statistic by
# about 1.5 per draw (df 4): at 1,000 draws, about 1,500 against a critical value of
# 33 for p < 1e-6. Those of seed 4 (q close to p) move it by only about 0.004 per
# draw: -m slow keeps that subtle case at twice the draws, 10,000.
@pytest.mark.parametrize("seed,draws", [
    pytest.param(0, 1000, id="q-far-from-p"),
    pytest.param(4, 2 * DRAWS, id="q-close-to-p", marks=pytest.mark.slow),
])
def test_draws_without_replacement_verified_as_iid_fail(seed, draws):
    p_root, q_root, *_ = _tables(seed)
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros(V)
    for _ in range(draws):
        b = ShapeTreeBuilder(TreeShape.from_expansion((4,), 8), 0, SamplingParams(temperature=1.0), "without_replacement", gen)
        b.expand_level([(-1, q_root.log())])
        tree = b.finish()
        tree.draws[0].rule = "iid"  # the wrong rule for these draws
        result = verify_stochastic(tree, torch.stack([p_root] + [p_root] * tree.num_nodes), gen)
        first = tree.tokens[result.accepted_nodes[0]] if result.accepted_nodes else result.bonus_token
        counts[first] += 1
    expected = p_root.double().numpy()  # renormalised: p_root sums to 1 only to float32 precision
    assert chisquare(counts, expected / expected.sum() * draws).pvalue < 1e-6


def _merged_two_draft_tokens(rule: str, seed: int, coupled_streams: bool = False, same_draft: bool = False,
                            draws: int = DRAWS) -> np.ndarray:
    """Counts of (t1, t2) when two drafts (q and a perturbed q, or q twice) each grow
    a tree of ``rule`` draws and the merged tree is verified."""
    p_root, q_root, p_next, q_next = _tables(seed)
    g = torch.Generator().manual_seed(seed + 7)
    q2_root = torch.softmax(q_root.log() + 0.3 * torch.randn(V, generator=g), -1)
    q2_next = torch.softmax(q_next.log() + 0.3 * torch.randn(V, V, generator=g), -1)
    shapes = [TreeShape.from_expansion((2, 1), 3), TreeShape.chain(2)]
    if same_draft:
        q2_root, q2_next, shapes = q_root, q_next, [shapes[0], shapes[0]]
    counts = np.zeros((V, V))
    verify_gen = torch.Generator().manual_seed(seed + 1)
    streams = [torch.Generator().manual_seed(seed + 2), torch.Generator().manual_seed(seed + 3)]
    params = SamplingParams(temperature=1.0)
    for i in range(draws):
        if coupled_streams:  # the bug: both drafts on one seed
            streams = [torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)]
        trees = []
        for (qr, qn), gen, shape in zip(
            [(q_root, q_next), (q2_root, q2_next)], streams, shapes
        ):
            trees.append(_grow(ShapeTreeBuilder(shape, 0, params, rule, gen), qr, qn))
        counts[_first_two_tokens_of(merge_trees(trees, max_nodes=6), p_root, p_next, verify_gen)] += 1
    return counts


_DEFAULT_MERGED = {("iid", False), ("without_replacement", True), ("topk", False)}


@pytest.mark.parametrize("rule,same_draft,draws", [
    pytest.param(rule, same, FAST_DRAWS if (rule, same) in _DEFAULT_MERGED else DRAWS,
                 id=f"{rule}-{'same-draft-twice' if same else 'two-drafts'}",
                 marks=() if (rule, same) in _DEFAULT_MERGED else pytest.mark.slow)
    for rule in ("iid", "without_replacement", "topk") for same in (False, True)
])
def test_merged_trees_of_two_drafts_keep_the_distribution(rule, same_draft, draws):
    """Merged nodes proposed by both drafts are tested once per proposal, each draft
    against its own q, in drawing order: the target's distribution is kept."""
    counts = _merged_two_draft_tokens(rule, seed=4, same_draft=same_draft, draws=draws)
    assert _pvalue(counts, _expected(4)) > P_MIN


# One shared stream moves the chi-square statistic by about 0.046 per draw (254 at
# 5,000 draws, df 24): at 3,000 draws the noncentrality is about 138 against a
# critical value of 72 for p < 1e-6, a miss probability of about 5e-6.
COUPLED_STREAM_DRAWS = 3000


@pytest.mark.parametrize("draws", [COUPLED_STREAM_DRAWS, pytest.param(DRAWS, marks=pytest.mark.slow)])
def test_two_drafts_on_one_random_stream_fail_the_same_test(draws):
    """The verifier assumes the drafts' draws are independent; the same draft twice
    on one random stream proposes the same tokens twice, which is not."""
    counts = _merged_two_draft_tokens("without_replacement", seed=4, coupled_streams=True, same_draft=True,
                                      draws=draws)
    assert _pvalue(counts, _expected(4)) < 1e-6
