"""Seeding the adaptive budget's cost curves at load (see ``worker.calibration``).

The target's and the first draft's forward costs are measured once per (model,
device, dtype, quantization) and cached under ``$PAGEDTREE_CALIBRATION_DIR`` (by
default ``calibration/`` in the pagedtree cache folder), so a second engine on the
same machine starts from the stored curves at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pagedtree.config import EngineConfig
from pagedtree.loading import packaged_models as pm
from pagedtree.speculative.speculator import Speculator
from pagedtree.worker.calibration import CalibrationCache, calibrate, calibration_key
from pagedtree.worker.model_runner import ModelRunner

# Largest forward calibrated: beyond it the curve is extrapolated as compute bound.
_MAX_CALIBRATED_TOKENS = 256


def calibration_dir() -> Path:
    """Where cost curves are cached."""
    return Path(os.environ.get("PAGEDTREE_CALIBRATION_DIR", pm.cache_dir() / "calibration"))


def calibrate_speculation(speculator: Speculator, config: EngineConfig, target_runner: ModelRunner,
                          target_path: str | os.PathLike, dtype: torch.dtype) -> None:
    """Seed ``speculator``'s cost curves from the cache, or measure and cache them."""
    spec = config.speculative
    largest = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + spec.max_nodes), _MAX_CALIBRATED_TOKENS)
    cache = CalibrationCache(calibration_dir())
    device = target_runner.device
    target_key = calibration_key(target_path, device, dtype, config.target_quantization(), largest, config.tensor_parallel_size)
    target = calibrate(target_runner, cache, target_key, largest, label="target")
    draft = None
    if speculator.drafts:
        first = speculator.drafts[0]
        draft_key = calibration_key(first.model_path, device, config.resolve_draft_dtype(),
                                    config.resolve_draft_quantization(), largest, config.draft_tensor_parallel_size,
                                    head_vocab=spec.draft_vocab_size)
        draft = calibrate(first.runner, cache, draft_key, largest, label="draft")
    speculator.budget.seed_costs(target, draft)
