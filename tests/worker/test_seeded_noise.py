"""Seeded sampling's noise: counter-based SplitMix64 streams and the Gumbel draws they give."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from pagedtree import sampling
from pagedtree.sampling import coupled_tokens, gumbel_noise, gumbel_noise_rows, uniform_streams


def test_first_outputs_are_splitmix64():
    """Row ``k`` is the SplitMix64 sequence seeded with ``k`` (reference values computed
    here with Python integers)."""
    def splitmix(state: int, count: int) -> list[int]:
        out = []
        for _ in range(count):
            state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
            out.append(z ^ (z >> 31))
        return out

    keys = [0, 1234567, 2**63 + 5]
    u = uniform_streams(keys, 6)
    for row, key in enumerate(keys):
        expected = [((z >> 41) + 0.5) * 2.0**-23 for z in splitmix(key, 6)]
        assert u[row].tolist() == pytest.approx(expected, abs=0, rel=0)


@pytest.mark.parametrize("keys", [[2**64 - 1], [3, 99, 2**62 + 17, 2**64 - 1]])
def test_numba_and_numpy_paths_agree_bit_for_bit(keys):
    """A single row (drawn on the calling thread) and several (the parallel kernel)."""
    fast = uniform_streams(keys, 4097)
    reference = torch.from_numpy(sampling._splitmix_uniform_numpy(np.asarray(keys, dtype=np.uint64), 4097))
    assert torch.equal(fast, reference)


def test_uniforms_are_uniform_and_strictly_inside_the_unit_interval():
    u = uniform_streams(list(range(40)), 5000).reshape(-1).double()
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    # Neighbouring streams (keys 0, 1, ...) are unrelated: no correlation between rows.
    rows = uniform_streams([0, 1], 20000).double()
    assert abs(np.corrcoef(rows[0].numpy(), rows[1].numpy())[0, 1]) < 0.03


def test_noise_is_a_function_of_seed_and_position_alone():
    a = gumbel_noise_rows([(7, 3), (8, 3), (7, 4)], 300)
    assert torch.equal(a[0], gumbel_noise(7, 3, 300))
    assert torch.equal(a[2], gumbel_noise(7, 4, 300))
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert torch.isfinite(a).all()


def test_gumbel_max_draws_follow_the_distribution():
    """argmax(log p + noise) over many (seed, position) streams draws from p."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    noise = gumbel_noise_rows([(seed, 0) for seed in range(6000)], probs.numel())
    tokens = coupled_tokens(probs.expand(6000, -1), noise)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[5] == 0  # probability zero is never drawn
    expected = probs[:5].double() * 6000
    assert stats.chisquare(counts[:5].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("filters", [{}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.05}])
def test_coupled_draws_are_gumbel_max_of_the_target_distribution(filters):
    """The softmax-free shortcut (no filters) and the general path pick the same tokens
    as argmax(log target_probs + noise), row by row and batched alike."""
    from pagedtree.sampling import coupled_draws, target_probs
    from pagedtree.sampling_params import SamplingParams

    torch.manual_seed(0)
    params = SamplingParams(temperature=0.7, **filters)
    logits = torch.randn(64, 500) * 4
    noise = gumbel_noise_rows([(seed, 1) for seed in range(64)], 500)
    expected = coupled_tokens(target_probs(logits, params), noise)
    batched = coupled_draws(logits, params, noise)
    alone = torch.stack([coupled_draws(logits[i : i + 1], params, noise[i : i + 1])[0] for i in range(64)])
    assert torch.equal(batched, expected)
    assert torch.equal(alone, expected)
