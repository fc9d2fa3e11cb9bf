"""Fixtures for tree speculation: draft models that are perturbed copies of a target."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyModel


def save_perturbed_copy(target: TinyModel, folder: Path, noise: float, seed: int) -> TinyModel:
    """The target's weights plus relative Gaussian noise: a draft that agrees often but
    not always (partial acceptance)."""
    model = copy.deepcopy(target.hf_model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * noise)
    model.save_pretrained(str(folder))
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(folder))
    return TinyModel(folder, model, target.tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_draft(tiny_llama, tmp_path_factory) -> TinyModel:
    """A perturbed copy of ``tiny_llama``."""
    return save_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("tiny_llama_draft"), noise=0.1, seed=11)


@pytest.fixture(scope="session")
def tiny_llama_draft2(tiny_llama, tmp_path_factory) -> TinyModel:
    """A second, differently perturbed copy of ``tiny_llama`` (multi-draft merge)."""
    return save_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("tiny_llama_draft2"), noise=0.15, seed=12)
