"""A tiny random target and its draft, built in-process from a transformers config.

The engine checks need a model on any machine without a download: a small random
Llama saved as a Hugging Face folder, and a draft that is a perturbed copy of it
(it agrees with the target often but not always, so trees are partly accepted).
Weights are scaled up so that logits spread and greedy argmax ties are rare: token
for token comparisons then test the engine, not rounding noise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, slots=True)
class TinyShape:
    """The sizes of a tiny Llama."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 512
    max_positions: int = 1024

    @property
    def head_dim(self) -> int:
        """Dimensions per attention head."""
        return self.hidden_size // self.num_heads


# Head dim 64 on a GPU (a real one), 16 in the interpreter (fast); two query heads per
# KV head in both.
CUDA_SHAPE = TinyShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
CPU_SHAPE = TinyShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      vocab_size=256, max_positions=512)

WEIGHT_SCALE = 4.0
DRAFT_NOISE = 0.03


@dataclass(frozen=True, slots=True)
class ModelPair:
    """Folders of a target and of its draft."""

    target: Path
    draft: Path


def llama_config(shape: TinyShape):
    """The transformers ``LlamaConfig`` of ``shape``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )


def random_model(shape: TinyShape, seed: int) -> torch.nn.Module:
    """A random fp32 Llama of ``shape`` with its matrices scaled by ``WEIGHT_SCALE``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(shape), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(WEIGHT_SCALE)
    return model


def perturbed_copy(model: torch.nn.Module, noise: float, seed: int) -> torch.nn.Module:
    """``model`` with relative Gaussian noise added to every matrix."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * noise)
    return draft


def save_model_pair(folder: str | Path, shape: TinyShape, seed: int = 0) -> ModelPair:
    """Build and save a tiny target and its draft under ``folder``."""
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    target = random_model(shape, seed)
    draft = perturbed_copy(target, DRAFT_NOISE, seed + 1)
    pair = ModelPair(folder / "target", folder / "draft")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside the check's table
    try:
        target.save_pretrained(str(pair.target))
        draft.save_pretrained(str(pair.draft))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return pair
