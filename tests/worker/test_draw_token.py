"""draw_token: the inverse-transform draw every sampled token goes through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedtree.sampling import draw_token


# Each draw is a Python call (about 0.2 ms): the default suite draws 10,000 times,
# -m slow 20,000. At 10,000 draws the wrong distribution below (five points moved
# between two tokens: 0.0127 of chi-square per draw, df 2) reaches a noncentrality
# of 127 against a critical value of 27.6 for p < 1e-6: a miss probability below 1e-9.
DRAWS = [10000, pytest.param(20000, marks=pytest.mark.slow)]


@pytest.mark.parametrize("n", DRAWS)
def test_draws_follow_the_distribution_and_skip_zero_mass(n):
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([draw_token(probs, gen) for _ in range(n)], minlength=len(probs))
    assert counts[probs.numpy() == 0].sum() == 0
    support = probs.numpy() > 0
    assert chisquare(counts[support], probs.numpy()[support] * n).pvalue > 1e-3


@pytest.mark.parametrize("n", DRAWS)
def test_a_wrong_distribution_fails_the_same_test(n):
    # The test above can fail: draws from p checked against a slightly different q.
    p = torch.tensor([0.5, 0.3, 0.2])
    gen = torch.Generator().manual_seed(1)
    counts = np.bincount([draw_token(p, gen) for _ in range(n)], minlength=3)
    assert chisquare(counts, np.array([0.45, 0.35, 0.2]) * n).pvalue < 1e-6


def test_unnormalised_weights_last_token_and_seeds():
    weights = torch.tensor([0.0, 0.0, 3.0])  # all mass on the last token
    gen = torch.Generator().manual_seed(2)
    assert {draw_token(weights, gen) for _ in range(50)} == {2}
    a = [draw_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [draw_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("vocab", [32000, 151936])
def test_large_vocabularies_pick_a_token_with_mass(vocab):
    logits = torch.randn(vocab) * 4
    logits[::3] = -float("inf")
    probs = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        assert probs[draw_token(probs, gen)] > 0
