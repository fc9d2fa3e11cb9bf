"""Stochastic verification decided row by row: all rows at once (the GPU way, no host
sync) and only the rows the walk reaches (the CPU way) give the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedtree.speculative.drafting.merge import merge_trees
from pagedtree.speculative.verification.rules import RowTests, walk_stochastic

from tests.speculative.verification.test_distribution import V, _builder, _expected, _grow, _pvalue, _tables


def _trees(seed: int):
    """Every tree kind and rule of the distribution tests, plus merged trees of two drafts."""
    p_root, q_root, p_next, q_next = _tables(seed)
    gen = torch.Generator().manual_seed(seed)
    for kind in ("static", "chain", "sequoia"):
        for rule in ("iid", "without_replacement", "topk"):
            yield _grow(_builder(kind, rule, gen), q_root, q_next)
    yield _grow(_builder("dynamic", "topk", gen), q_root, q_next)
    for rule in ("iid", "without_replacement"):
        a = _grow(_builder("static", rule, gen), q_root, q_next)
        b = _grow(_builder("static", "topk", gen), q_next[1], q_next)
        yield merge_trees([a, b], max_nodes=a.num_nodes + b.num_nodes)


def _rows(tree, seed: int) -> torch.Tensor:
    p_root, _, p_next, _ = _tables(seed)
    # Peaked rows, so that walks go deep as well as stop early.
    return torch.softmax(torch.stack([p_root] + [p_next[t] for t in tree.tokens]).log() * 2, -1)


def test_all_rows_and_along_the_walk_decide_the_same_path():
    walks = 0
    for seed in range(12):
        for tree in _trees(seed):
            rows = _rows(tree, seed)
            for coin_seed in range(4):
                eager = RowTests(tree, rows, torch.Generator().manual_seed(coin_seed)).all_rows()
                lazy = RowTests(tree, rows, torch.Generator().manual_seed(coin_seed)).along_walk()
                a = walk_stochastic(tree, eager[0].tolist(), eager[1].tolist())
                b = walk_stochastic(tree, lazy[0].tolist(), lazy[1].tolist())
                assert (a.accepted_nodes, a.bonus_token, a.trials) == (b.accepted_nodes, b.bonus_token, b.trials)
                reached = [0] + [1 + n for n in a.accepted_nodes]
                assert eager[0][reached].tolist() == lazy[0][reached].tolist()
                walks += len(a.accepted_nodes) > 0
    assert walks > 50  # paths that accepted something, not only bonus draws at the root


# 1,000 draws as for a single tree in ``test_distribution`` (where a wrong rule
# would be far past the threshold); 4,000 under -m slow.
@pytest.mark.parametrize("draws", [1000, pytest.param(4000, marks=pytest.mark.slow)])
def test_rows_decided_at_once_keep_the_target_distribution(draws):
    """The chi-square test of ``test_distribution`` with every row decided up front."""
    seed = 3
    p_root, q_root, p_next, q_next = _tables(seed)
    counts = np.zeros((V, V))
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(draws):
        tree = _grow(_builder("static", "iid", gen), q_root, q_next)
        rows = torch.stack([p_root] + [p_next[t] if d == 1 else p_next[0] for t, d in zip(tree.tokens, tree.depths)])
        tokens, accepted = RowTests(tree, rows, gen).all_rows()
        result = walk_stochastic(tree, tokens.tolist(), accepted.tolist())
        out = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
        if len(out) == 1:
            out.append(int(torch.multinomial(p_next[out[0]], 1, generator=gen)))
        counts[out[0], out[1]] += 1
    assert _pvalue(counts, _expected(seed)) > 0.01


def test_a_row_count_that_does_not_match_the_tree_is_refused():
    tree = next(_trees(0))
    with pytest.raises(ValueError, match="rows of target probabilities"):
        RowTests(tree, torch.full((2, V), 1.0 / V), None)
