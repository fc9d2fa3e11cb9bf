"""Suffix trees priced by the match they follow."""

from __future__ import annotations

import pytest

from pagedtree.speculative.budget.suffix_acceptance import (
    MATCH_BUCKETS,
    SuffixAcceptance,
    best_shape,
    match_bucket,
)
from pagedtree.speculative.tree import ROOT, TokenTree, TreeShape


def test_match_lengths_fall_in_their_buckets():
    assert [match_bucket(n) for n in (1, 2, 3, 4, 5, 7, 8, 16)] == [1, 2, 3, 3, 5, 5, 8, 8]
    with pytest.raises(ValueError, match="at least one token"):
        match_bucket(0)


def test_the_best_nodes_of_a_tree_keep_parents_and_rank_siblings_by_score():
    tree = TokenTree(7)
    a = tree.add(ROOT, 10, -0.1)
    b = tree.add(ROOT, 11, -1.0)   # the root's second choice
    c = tree.add(a, 12, -0.3)
    tree.add(a, 13, -0.2)          # a's first choice by score, created after c
    tree.add(c, 14, -2.0)
    assert best_shape(tree, 4) == TreeShape(parents=[ROOT, 0, 0, ROOT], ranks=[0, 0, 1, 1])
    assert best_shape(tree).num_nodes == 5
    assert best_shape(tree, 1) == TreeShape.chain(1)
    del b


def test_a_longer_match_is_expected_to_get_more_accepted_in_both_classes():
    acceptance = SuffixAcceptance()
    chain = TreeShape.chain(8)
    for cls in ("greedy", "sampling"):
        expected = [acceptance.expected(chain, cls, bucket) for bucket in MATCH_BUCKETS]
        assert expected == sorted(expected) and expected[0] < 0.5 < 5.0 < expected[-1]
    # A request whose evidence says it accepts half as much is expected to get less.
    assert acceptance.expected(chain, "greedy", 8, scale=0.5) < acceptance.expected(chain, "greedy", 8) / 2


def test_observed_trials_move_only_their_class_and_bucket():
    acceptance = SuffixAcceptance()
    before = {key: table.rows() for key, table in acceptance.tables.items()}
    for _ in range(40):
        acceptance.table("sampling", 4).observe([(1, 0, False)])
    assert acceptance.table("sampling", 3).rate(1, 0) < 0.2
    assert all(table.rows() == before[key] for key, table in acceptance.tables.items() if key != ("sampling", 3))
