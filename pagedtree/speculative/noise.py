"""Seeded requests' Gumbel noise, shared by the draft and the verifier within a step."""

from __future__ import annotations

import torch

from pagedtree.sampling import gumbel_noise


class NoiseCache:
    """Gumbel noise by (seed, output position), for one step.

    The draft proposes a position's children and the target verifies them with the
    same noise (coupled verification); generating it (one uniform number per
    vocabulary entry) once per step serves both.
    """

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = device
        self._by_seed: dict[int, dict[int, torch.Tensor]] = {}

    def get(self, seed: int, position: int) -> torch.Tensor:
        """The noise of ``seed`` at output ``position`` (made on first use)."""
        per_position = self._by_seed.setdefault(seed, {})
        noise = per_position.get(position)
        if noise is None:
            noise = per_position[position] = gumbel_noise(seed, position, self.vocab_size, self.device)
        return noise

    def drop(self, seed: int) -> None:
        """Forget a seed's noise (its request has been verified)."""
        self._by_seed.pop(seed, None)

    def clear(self) -> None:
        """Forget everything (a new step)."""
        self._by_seed.clear()
