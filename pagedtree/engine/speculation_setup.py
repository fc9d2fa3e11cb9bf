"""Speculation set-up at engine start: draft workers and the cost calibration.

Draft models are loaded with their own KV caches and block managers (sharded over
the tensor-parallel group when asked). The adaptive budget's cost curves (the
target's and the first draft's forward cost by token count) are measured once per
(model, device, dtype, quantization, head vocabulary) and cached under
``$PAGEDTREE_CALIBRATION_DIR`` (by default ``calibration/`` in the pagedtree cache
folder), so a second engine on the same machine starts from the stored curves at once.
"""

from __future__ import annotations

import os

from pagedtree.config import ResolvedConfig
from pagedtree.executor.commands import CommandChannel
from pagedtree.executor.shards import DraftWeights, load_draft
from pagedtree.loading import packaged_models as pm
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.speculative.drafting.draft_worker import DraftWorker
from pagedtree.speculative.budget.priors import acceptance_prior
from pagedtree.speculative.speculator import Speculator
from pagedtree.speculative.budget.calibration import CalibrationCache, calibrate, calibration_key
from pagedtree.worker.model_runner import ModelRunner


def load_speculator(config: ResolvedConfig, vocab_size: int, max_model_len: int, target_blocks: int,
                    weights: list[DraftWeights], channel: CommandChannel | None = None) -> Speculator:
    """The speculator of ``config``: its draft workers (their ``weights`` loaded
    already, one per ``config.drafts``), its acceptance prior the measured one of a
    packaged pair or the drafter's default."""
    drafts = [
        load_draft_worker(config, index, weights[index], vocab_size, max_model_len, target_blocks, channel)
        for index in range(len(config.drafts))
    ]
    names = [draft.model for draft in config.drafts] or None
    prior = acceptance_prior(config.target.model or pm.DEFAULT_MODEL, names, config.speculative.drafter)
    return Speculator(config.speculative, drafts, vocab_size, config.target.device, prior)


def load_draft_worker(
    config: ResolvedConfig, index: int, weights: DraftWeights, vocab_size: int, max_model_len: int,
    target_blocks: int, channel: CommandChannel | None = None,
) -> DraftWorker:
    """Give draft model ``index`` (its ``weights``) its own KV cache and block manager
    (``executor.shards.load_draft``; sharded over the tensor-parallel group when a
    ``channel`` is given, else whole on this process).

    The draft must share the target's vocabulary.
    """
    draft = config.drafts[index]
    shard = load_draft(weights, index, config.cache, config.scheduler, config.max_tree_nodes, target_blocks,
                       max_model_len, channel)
    vocab = int(shard.loaded.config.vocab_size)
    if vocab != vocab_size:
        raise ValueError(
            f"draft model {draft.model!r} has a vocabulary of {vocab} tokens, the target {vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    block_manager = BlockManager(shard.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    return DraftWorker(shard.runner, block_manager, name=f"draft{index}", index=index,
                       model_path=str(shard.loaded.path))


# Largest forward calibrated: beyond it the curve is extrapolated as compute bound.
_MAX_CALIBRATED_TOKENS = 256


def calibrate_speculation(speculator: Speculator, config: ResolvedConfig, target_runner: ModelRunner,
                          target_path: str | os.PathLike) -> None:
    """Seed ``speculator``'s cost curves from the cache, or measure and cache them."""
    limits = config.scheduler
    largest = min(limits.max_num_batched_tokens, limits.max_num_seqs * (1 + config.max_tree_nodes),
                  _MAX_CALIBRATED_TOKENS)
    cache = CalibrationCache(pm.calibration_dir())
    target = config.target
    streamer = getattr(target_runner.model, "layer_streamer", None)
    target_key = calibration_key(target_path, target.device, target.dtype, target.quantization, largest,
                                 config.parallel.tensor_parallel_size,
                                 streamed_layers=tuple(streamer.order) if streamer is not None else (),
                                 padded_layers=sum(bool(getattr(m, "pad_single_rows", False))
                                                   for m in target_runner.model.modules()),
                                 chunked_layers=sum(getattr(m, "row_chunk", None) is not None
                                                    for m in target_runner.model.modules()))
    target_costs = calibrate(target_runner, cache, target_key, largest, label="target")
    draft_costs = None
    if speculator.drafts:
        first, draft = speculator.drafts[0], config.drafts[0]
        draft_key = calibration_key(first.model_path, draft.device, draft.dtype, draft.quantization, largest,
                                    config.parallel.draft_tensor_parallel_size, head_vocab=draft.head_vocab)
        draft_costs = calibrate(first.runner, cache, draft_key, largest, label="draft")
    speculator.budget.seed_costs(target_costs, draft_costs)
