"""A level's children drawn together (``draw_level``) are each row's children drawn
alone (``draw_by_rule``): greedy rows of one and of several ``k``, coupled rows of one
and of several sampling parameters, each group in one batched op; random rows one by
one; rows that draw nothing left out."""

from __future__ import annotations

import torch

from pagedtree.draft_sampling import ChildRule, draw_by_rule, draw_level, read_drawn
from pagedtree.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3)


def test_a_level_drawn_together_is_each_row_drawn_alone():
    vocab = 1000
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(0)) * 4
    noise = -torch.log(-torch.log(torch.rand(vocab, generator=torch.Generator().manual_seed(1))))
    other_noise = -torch.log(-torch.log(torch.rand(vocab, generator=torch.Generator().manual_seed(2))))
    rules = [ChildRule(2, "topk", GREEDY), ChildRule(1, "topk", GREEDY), None, ChildRule(2, "topk", GREEDY),
             ChildRule(3, "coupled", SEEDED, noise=noise), ChildRule(1, "topk", GREEDY),
             ChildRule(vocab + 5, "topk", GREEDY), ChildRule(3, "coupled", SEEDED, noise=other_noise),
             ChildRule(3, "coupled", SamplingParams(temperature=0.5, seed=3), noise=noise)]
    together = draw_level(logits, rules)
    for row, rule, got in zip(logits, rules, together):
        if rule is None:
            assert got is None
            continue
        alone = draw_by_rule(row, rule)
        assert torch.equal(got.tokens, alone.tokens)
        assert torch.equal(got.increments, alone.increments)
    assert together[6].tokens.numel() == vocab  # k past the vocabulary: all of it


def test_random_rows_draw_from_their_own_generator_in_row_order():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0)

    def rules():
        return [ChildRule(2, "iid", params, torch.Generator().manual_seed(5 + i)) for i in range(3)]

    together = read_drawn(draw_level(logits, rules()))
    alone = read_drawn([draw_by_rule(row, rule) for row, rule in zip(logits, rules())])
    assert together == alone
