"""Load the target or a draft and give it a KV cache: the same code on every rank.

Unsharded (one process, or a draft kept whole on rank 0) this is the engine's
plain set-up. In a tensor-parallel group every rank runs the same function: it
loads its own shard (``load_model(group=...)``), sizes its cache from its own
memory, and the ranks agree on the smallest block count, so block ids mean the
same slots on every rank. Rank 0 gets a ``TensorParallelRunner`` (which sends
each step to the others), the other ranks a plain ``ModelRunner``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedtree.attention import resolve_backend_name
from pagedtree.config import EngineConfig
from pagedtree.distributed.group import START_TIMEOUT, TensorParallelGroup
from pagedtree.executor.commands import CommandChannel
from pagedtree.executor.tp_runner import TensorParallelRunner
from pagedtree.loading.loader import LoadedModel, load_model
from pagedtree.worker.cuda_graphs import MAX_GRAPH_BATCH
from pagedtree.worker.model_runner import ModelRunner, num_draft_kv_blocks, num_kv_blocks

logger = logging.getLogger("pagedtree")

# The model index commands carry: 0 the target, 1 + i draft model i.
TARGET = 0


@dataclass(slots=True)
class LoadedShard:
    """A model (or this rank's shard of it) with its runner and cache."""

    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    backend: str


def _runner(loaded: LoadedModel, blocks: int, config: EngineConfig, device: torch.device, dtype: torch.dtype,
            backend: str, channel: CommandChannel | None, model_index: int) -> ModelRunner:
    """Rank 0 of a sharded model sends its steps to the others; every other runner is plain."""
    args = (loaded.model, blocks, config.block_size, device, dtype, backend)
    fused = not config.enforce_eager
    if channel is not None and channel.group.rank == 0:
        return TensorParallelRunner(*args, fused_cpu_ops=fused, channel=channel, model_index=model_index)
    return ModelRunner(*args, fused_cpu_ops=fused)


def _agree(blocks: int, group: TensorParallelGroup | None) -> int:
    """The smallest block count of the ranks (each sized its cache from its own memory).
    Ranks get here when their shard is loaded, some later than others: the wait is
    the start-up one, not a step's."""
    return blocks if group is None else group.all_reduce_ints([blocks], timeout=START_TIMEOUT)[0]


def _graphs_wanted(config: EngineConfig, device: torch.device, backend: str,
                   group: TensorParallelGroup | None) -> bool:
    """CUDA graphs for decode and verify steps: Triton on CUDA, unless eager. (Sharded
    steps run eagerly: their collectives are not captured.)"""
    return device.type == "cuda" and backend == "triton" and not config.enforce_eager and group is None


def load_target(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                channel: CommandChannel | None = None) -> LoadedShard:
    """The target (this rank's shard with a ``channel``), its cache and runner.

    ``max_model_len`` is the config's (else the model's positions), capped by what
    the cache holds.
    """
    group = channel.group if channel is not None else None
    loaded = load_model(config.model, dtype=dtype, device=device, quantization=config.target_quantization(), group=group)
    model_limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
    requested_len = config.max_model_len or model_limit
    if requested_len > model_limit:
        raise ValueError(f"max_model_len {requested_len} exceeds the model's {model_limit} positions")
    blocks = _agree(num_kv_blocks(loaded.model, config, dtype, device, requested_len), group)
    backend = resolve_backend_name(config.attention_backend, device, dtype)
    runner = _runner(loaded, blocks, config, device, dtype, backend, channel, TARGET)
    max_model_len = min(requested_len, blocks * config.block_size)
    if _graphs_wanted(config, device, backend, group):
        # Verify steps hold a tree and its root.
        tree_tokens = 1 + config.speculative.max_nodes if config.speculation_enabled else 1
        runner.enable_cuda_graphs(config.max_num_seqs, max_model_len, tree_tokens, capture=True)
    if config.speculation_enabled:
        # A token's logits must not depend on whether a tree pass or a one-token
        # decode computed them (greedy with speculation == without, in any dtype).
        loaded.model.make_rows_consistent()
    return LoadedShard(loaded, runner, blocks, max_model_len, backend)


def load_draft(config: EngineConfig, index: int, device: torch.device, target_blocks: int, max_model_len: int,
               channel: CommandChannel | None = None) -> LoadedShard:
    """Draft model ``index`` (this rank's shard of it with a ``channel``), its cache and runner.

    Its attention backend is ``config.attention_backend`` resolved for the draft's own
    dtype (a draft may run in another precision than the target). It must cover
    ``max_model_len`` positions (tree nodes never go past it: the scheduler caps
    the budget).
    """
    name = config.draft_model[index]
    dtype = config.resolve_draft_dtype()
    group = channel.group if channel is not None else None
    head_vocab = config.speculative.draft_vocab_size if config.speculative is not None else None
    loaded = load_model(name, dtype=dtype, device=device, quantization=config.resolve_draft_quantization(),
                        group=group, head_vocab=head_vocab)
    limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
    if limit < max_model_len:
        raise ValueError(
            f"draft model {name!r} has {limit} positions, fewer than max_model_len {max_model_len}; "
            "lower max_model_len"
        )
    blocks = num_draft_kv_blocks(config, target_blocks)
    backend = resolve_backend_name(config.attention_backend, device, dtype)
    runner = _runner(loaded, blocks, config, device, dtype, backend, channel, TARGET + 1 + index)
    if _graphs_wanted(config, device, backend, group):
        # A draft level is a step of one-token chunks, one per node fed: as many as the
        # graphs' batch limit allows.
        runner.enable_cuda_graphs(MAX_GRAPH_BATCH, max_model_len, 1, capture=True)
    logger.info("draft %d: %s with %d KV blocks%s", index, loaded.path, blocks,
                f" (rank {group.rank} of {group.size})" if group is not None else "")
    return LoadedShard(loaded, runner, blocks, max_model_len, backend)
