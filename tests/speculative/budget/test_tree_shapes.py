"""Tree shapes, Sequoia's optimum, merging, and the adaptive budget rule."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedtree.sampling_params import SamplingParams
from pagedtree.speculative.budget.acceptance import RankAcceptance
from pagedtree.speculative.budget.planner import CostModel
from pagedtree.speculative.drafting.builders import ShapeTreeBuilder
from pagedtree.speculative.drafting.merge import merge_trees
from pagedtree.speculative.budget.sequoia import expected_under_rates, marginal_rank_rates, optimal_shape
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree, TreeShape
from pagedtree.speculative.verification.rules import verify_greedy


def test_expansion_shape_is_breadth_first_and_capped():
    shape = TreeShape.from_expansion((2, 2, 1), 100)
    assert shape.num_nodes == 2 + 4 + 4
    assert shape.parents[:6] == [ROOT, ROOT, 0, 0, 1, 1]
    assert shape.ranks[:6] == [0, 1, 0, 1, 0, 1]
    capped = TreeShape.from_expansion((2, 2, 1), 5)
    assert capped.parents == [ROOT, ROOT, 0, 0, 1]
    assert TreeShape.chain(3).parents == [ROOT, 0, 1] and TreeShape.chain(3).depth == 3


def _all_shapes(n: int, max_depth: int):
    """Every shape of exactly n nodes whose siblings take consecutive ranks."""

    def grow(parents, ranks, depth):
        if len(parents) == n:
            yield TreeShape(list(parents), list(ranks))
            return
        for p in [ROOT] + list(range(len(parents))):
            d = 1 if p == ROOT else depth[p] + 1
            if d > max_depth:
                continue
            rank = sum(1 for q in parents if q == p)
            # Canonical order: only add below a node at or after the last parent used.
            if parents and p < parents[-1]:
                continue
            yield from grow(parents + [p], ranks + [rank], depth + [d])

    yield from grow([], [], [])


@pytest.mark.parametrize("rates", [(0.7, 0.3, 0.2), (0.4, 0.5, 0.3), (0.9, 0.1, 0.05)])
@pytest.mark.parametrize("n,max_depth", [(3, 2), (5, 3), (6, 6)])
def test_sequoia_shape_is_optimal(rates, n, max_depth):
    best = max(expected_under_rates(s, rates) for s in _all_shapes(n, max_depth))
    shape = optimal_shape(rates, n, max_depth)
    assert shape.num_nodes <= n and shape.depth <= max_depth
    assert expected_under_rates(shape, rates) == pytest.approx(best, rel=1e-9)
    # A valid shape: parents precede children and siblings take ranks 0, 1, 2, ...
    for i, p in enumerate(shape.parents):
        assert p < i
        assert shape.ranks[i] == sum(1 for q in shape.parents[:i] if q == p)


def test_expected_accepted_matches_a_hand_computation():
    rates = (0.5, 0.4)
    assert marginal_rank_rates(rates) == pytest.approx([0.5, 0.2])
    shape = TreeShape([ROOT, ROOT, 0], [0, 1, 0])
    assert expected_under_rates(shape, rates) == pytest.approx(0.5 + 0.2 + 0.25)


def _tree(root, paths, rule="topk"):
    """A tree holding ``paths``; each new node proposed by a draw of its own."""
    tree = TokenTree(root)
    probs = torch.full((16,), 1 / 16) if rule != "topk" else None
    for path in paths:
        node = ROOT
        for token in path:
            child = tree.child(node, token)
            if child is None:
                child = tree.add(node, token, -0.1 * (tree.num_nodes + 1))
                tree.draws.append(ChildDraw(rule, node, [token], probs))
            node = child
    return tree


def _paths(tree):
    return {tuple(tree.tokens[i] for i in tree.path_to(n)) for n in range(tree.num_nodes)}


def _draws_point_at_children(tree):
    for draw in tree.draws:
        for token in draw.tokens:
            child = tree.child(draw.parent, token)
            assert child is not None and tree.parents[child] == draw.parent


def test_merge_deduplicates_equal_paths_and_keeps_the_union():
    a = _tree(9, [[1, 2, 3], [4]])
    b = _tree(9, [[1, 2, 5], [6]])
    merged = merge_trees([a, b], max_nodes=100)
    assert _paths(merged) == {(1,), (1, 2), (1, 2, 3), (4,), (1, 2, 5), (6,)}
    # Every proposal survives, after the proposals of the trees before it.
    assert len(merged.draws) == len(a.draws) + len(b.draws)
    assert [d.tokens for d in merged.draws_at(ROOT)] == [[1], [4], [1], [6]]
    _draws_point_at_children(merged)
    pruned = merge_trees([a, b], max_nodes=3)
    assert pruned.num_nodes == 3
    for i, p in enumerate(pruned.parents):
        assert p < i
    _draws_point_at_children(pruned)
    assert all(tok for d in pruned.draws for tok in d.tokens)


def test_a_preferred_tree_is_kept_whole_and_the_others_fill_what_is_left():
    # A draft model's chain (a confident one, scores near 0 but below the suffix's)
    # and a suffix tree whose counts score every node above the chain's deep ones.
    chain = _tree(9, [[1, 2, 3, 4]])
    chain.scores = [-0.05, -0.2, -0.4, -0.7]
    suffix = _tree(9, [[1, 5, 6], [7]])
    suffix.scores = [-0.01, -0.02, -0.03, -0.04]
    by_scores = merge_trees([chain, suffix], max_nodes=5)
    assert (1, 2, 3, 4) not in _paths(by_scores)  # the chain cut short
    for max_nodes in range(1, 8):
        merged = merge_trees([chain, suffix], max_nodes=max_nodes, preferred=1)
        paths = _paths(merged)
        assert merged.num_nodes == min(max_nodes, 7)
        # The chain's first nodes first, then the suffix's by score.
        want = [(1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 5), (1, 5, 6), (7,)][:max_nodes]
        assert paths == set(want)
        for i, p in enumerate(merged.parents):
            assert p < i
        _draws_point_at_children(merged)
    # Without a preference, the scores alone decide (the earlier behaviour).
    assert _paths(merge_trees([chain, suffix], max_nodes=5, preferred=0)) == _paths(by_scores)


def test_random_draws_merge_within_the_budget_and_are_never_pruned():
    a = _tree(9, [[1, 2], [4]], rule="iid")
    b = _tree(9, [[1, 5]], rule="without_replacement")
    merged = merge_trees([a, b], max_nodes=4)
    assert _paths(merged) == {(1,), (1, 2), (4,), (1, 5)}
    # Token 1 was proposed twice below the root: once per draw, each with its own rule.
    assert [(d.rule, d.tokens) for d in merged.draws_at(ROOT)] == [("iid", [1]), ("iid", [4]), ("without_replacement", [1])]
    with pytest.raises(ValueError, match="cannot be pruned"):
        merge_trees([a, b], max_nodes=3)


def test_repeated_iid_draws_share_a_node_and_keep_every_proposal():
    shape = TreeShape.from_expansion((3, 1), 10)
    gen = torch.Generator().manual_seed(0)
    builder = ShapeTreeBuilder(shape, 0, SamplingParams(temperature=1.0), "iid", gen)
    fed = builder.expand_level([(ROOT, torch.tensor([0.0, 30.0, -30.0, -30.0]))])  # token 1 almost surely
    tree = builder.tree
    assert tree.tokens == [1] and tree.draws[0].tokens == [1, 1, 1]
    assert fed == [0]  # the repeats grow no subtree of their own


def test_greedy_verification_walks_the_longest_matching_path():
    tree = _tree(0, [[1, 2, 3], [1, 4], [5]])
    # Rows: root, then nodes in order 1, 2, 3, 4, 5.
    argmax = {0: 1, 1: 4, 2: 3, 3: 7, 4: 8, 5: 9}
    rows = [argmax[0]] + [argmax[t] for t in tree.tokens]
    result = verify_greedy(tree, rows)
    assert [tree.tokens[n] for n in result.accepted_nodes] == [1, 4]
    assert result.bonus_token == 8
    # Nothing matches: the target's own token only.
    result = verify_greedy(tree, [42] + rows[1:])
    assert result.accepted_nodes == [] and result.bonus_token == 42


def test_shape_builder_follows_the_shape_with_top_children():
    shape = TreeShape.from_expansion((2, 1), 10)
    builder = ShapeTreeBuilder(shape, 0, SamplingParams(temperature=0), "topk", None)
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    fed = builder.expand_level([(ROOT, logits)])
    assert builder.tree.tokens == [1, 2] and fed == [0, 1]
    assert builder.expand_level([(n, torch.tensor([0.0, 0.0, 0.0, 3.0])) for n in fed]) == []
    assert builder.finish().tokens == [1, 2, 3, 3] and builder.finish().parents == [ROOT, ROOT, 0, 1]


def test_cost_model_interpolates_and_extrapolates():
    cost = CostModel()
    assert not cost.has_data and cost.estimate(10) > 0
    cost.observe(1, 0.1)
    cost.observe(64, 0.2)
    assert cost.estimate(1) == pytest.approx(0.1)
    assert 0.1 < cost.estimate(20) < 0.2
    assert cost.estimate(128) == pytest.approx(0.4)  # proportional beyond what was seen


def test_rank_acceptance_counts():
    acc = RankAcceptance(tried=[0.0, 0.0, 0.0], accepted=[0.0, 0.0, 0.0])
    acc.observe([(0, False), (1, True)] + [(0, True)] * 3)
    assert acc.rates() == pytest.approx((3 / 4, 1.0, 0.0))
    acc.observe([(4, True)])  # an unseen rank gets a weak prior of one miss
    assert acc.rates()[4] == pytest.approx(0.5)


def test_all_shapes_enumeration_is_complete():
    # 1, 2, 5 trees of 1, 2, 3 nodes (plane trees counted by Catalan numbers).
    assert [sum(1 for _ in _all_shapes(n, n)) for n in (1, 2, 3)] == [1, 2, 5]
    assert list(itertools.islice(_all_shapes(2, 1), 5))[0].parents == [ROOT, ROOT]
