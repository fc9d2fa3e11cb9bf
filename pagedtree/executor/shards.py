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
from collections.abc import Sequence
from dataclasses import dataclass

from pagedtree.attention import resolve_backend_name
from pagedtree.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from pagedtree.devices import same_device
from pagedtree.distributed.group import START_TIMEOUT, TensorParallelGroup
from pagedtree.executor.commands import CommandChannel
from pagedtree.executor.offload import offload_target, refuse_unless_host_holds
from pagedtree.executor.tp_runner import TensorParallelRunner
from pagedtree.loading.loader import LoadedModel, load_model
from pagedtree.worker.cuda_graphs import MAX_GRAPH_BATCH
from pagedtree.worker.model_runner import (
    DraftMemory,
    ModelRunner,
    kv_bytes_per_block,
    measure_cuda_graph_memory,
    num_draft_kv_blocks,
    num_kv_blocks,
    tree_branch_blocks,
)
from pagedtree.worker.models.row_blocks import row_block_for

logger = logging.getLogger("pagedtree")

# The model index commands carry: 0 the target, 1 + i draft model i.
TARGET = 0
# New tokens per request a draft's graphs take: a level's one node, or a catch-up of
# two (a fully accepted path's last node, never fed, and the target's bonus token);
# longer catch-ups (after a preemption, the prompt) run eagerly.
DRAFT_GRAPH_TOKENS = 2


@dataclass(slots=True)
class LoadedShard:
    """A model (or this rank's shard of it) with its runner and cache."""

    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    max_model_len: int
    backend: str


@dataclass(slots=True)
class DraftWeights:
    """A draft model (or this rank's shard of it) loaded before the target's cache is
    sized, so that the cache leaves room for the draft's (``DraftMemory``)."""

    config: ModelConfig
    loaded: LoadedModel
    group: TensorParallelGroup | None  # the group it is sharded over; None: whole


def load_draft_weights(draft: ModelConfig, channel: CommandChannel | None = None) -> DraftWeights:
    """Draft ``draft``'s weights (this rank's shard of them with a ``channel``)."""
    group = channel.group if channel is not None else None
    loaded = load_model(draft.model, dtype=draft.dtype, device=draft.device, quantization=draft.quantization,
                        group=group, head_vocab=draft.head_vocab, load_format=draft.load_format,
                        with_tokenizer=False)  # a draft runs on the target's token ids
    if draft.device.type == "cuda":  # the fused kernels: fewer launches a level (speed only for a draft)
        loaded.model.enable_fused_gpu_ops()
    return DraftWeights(draft, loaded, group)


def draft_memory(draft: DraftWeights, cache: CacheConfig, scheduler: SchedulerConfig, max_tree_nodes: int,
                 max_model_len: int) -> DraftMemory:
    """What ``draft``'s cache and CUDA graphs will take (its graphs measured as the
    target's are; ``load_draft`` sizes the cache alike)."""
    config = draft.config
    backend = resolve_backend_name(config.attention_backend, config.device, config.dtype)
    graph_bytes = (measure_cuda_graph_memory(draft.loaded.model, cache.block_size, config.device, config.dtype,
                                             MAX_GRAPH_BATCH, max_model_len, DRAFT_GRAPH_TOKENS)
                   if _graphs_wanted(config, backend, draft.group) else 0)
    return DraftMemory(bytes_per_block=kv_bytes_per_block(draft.loaded.model, cache.block_size, config.dtype),
                       extra_blocks=tree_branch_blocks(scheduler.max_num_seqs, max_tree_nodes),
                       graph_bytes=graph_bytes, fixed_blocks=cache.num_draft_kv_blocks)


def _runner(loaded: LoadedModel, blocks: int, block_size: int, model: ModelConfig, backend: str,
            channel: CommandChannel | None, model_index: int) -> ModelRunner:
    """Rank 0 of a sharded model sends its steps to the others; every other runner is plain."""
    args = (loaded.model, blocks, block_size, model.device, model.dtype, backend)
    fused = not model.enforce_eager
    if channel is not None and channel.group.rank == 0:
        return TensorParallelRunner(*args, fused_cpu_ops=fused, channel=channel, model_index=model_index)
    return ModelRunner(*args, fused_cpu_ops=fused)


def _agree(blocks: int, group: TensorParallelGroup | None) -> int:
    """The smallest block count of the ranks (each sized its cache from its own memory).
    Ranks get here when their shard is loaded, some later than others: the wait is
    the start-up one, not a step's."""
    return blocks if group is None else group.all_reduce_ints([blocks], timeout=START_TIMEOUT)[0]


def _graphs_wanted(model: ModelConfig, backend: str, group: TensorParallelGroup | None) -> bool:
    """CUDA graphs for decode and verify steps: Triton on CUDA, unless eager. (Sharded
    steps run eagerly: their collectives are not captured.)"""
    return model.device.type == "cuda" and backend == "triton" and not model.enforce_eager and group is None


def load_target(model: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig, max_model_len: int | None,
                speculative: SpeculativeConfig | None, channel: CommandChannel | None = None,
                drafts: Sequence[DraftWeights] = ()) -> LoadedShard:
    """The target (this rank's shard with a ``channel``), its cache and runner.

    ``max_model_len`` is the one asked for (None: the model's positions), capped by
    what the cache holds. ``speculative`` is None without speculation. ``drafts``
    (loaded already) on the target's device take their share of a cache sized from
    the device's memory: their caches grow with the target's.
    """
    group = channel.group if channel is not None else None
    offloaded = model.offload_weights_gb is not None
    if offloaded:
        refuse_unless_host_holds(model, cache, scheduler, max_model_len)
    # An offloaded target loads on the host (unpacked: its streamed layers' tensors are
    # copied to the device as they are), then streams some layers and moves the rest.
    loaded = load_model(model.model, dtype=model.dtype, device="cpu" if offloaded else model.device,
                        quantization=model.quantization, group=group, load_format=model.load_format,
                        pack_weights=not offloaded)
    model_limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
    requested_len = max_model_len or model_limit
    if requested_len > model_limit:
        raise ValueError(f"max_model_len {requested_len} exceeds the model's {model_limit} positions")
    if offloaded:
        offload_target(loaded.model, model, cache, scheduler, requested_len)
    # A token's logits must not depend on whether a tree pass or a one-token decode
    # computed them (greedy with speculation == without, in any dtype). Before any
    # graph is captured: the graphs freeze the forward as it is then. On CUDA every
    # engine, plain or speculating, runs the batch-invariant fused kernels, so that a
    # plain engine's tokens are a speculating one's and do not depend on the batch;
    # a model they cannot run computes in fixed, padded row blocks instead. On CPU
    # only a speculating engine pads its one-row products.
    if model.device.type == "cuda":
        if not loaded.model.enable_fused_gpu_ops():
            logger.info("the fused GPU kernels cannot run %s: dense products and norms run in padded "
                        "row blocks for batch invariance", model.model)
            loaded.model.make_rows_consistent(row_block_for(model.device))
    elif speculative is not None:
        loaded.model.make_rows_consistent()
    backend = resolve_backend_name(model.attention_backend, model.device, model.dtype)
    # A streamed layer's copies and events are not captured: an offloaded target runs eagerly.
    graphs = _graphs_wanted(model, backend, group) and loaded.model.layer_streamer is None
    max_tree_nodes = speculative.max_nodes if speculative is not None else 0
    max_tree_tokens = 1 + max_tree_nodes  # a tree and its root
    # The graphs' memory is measured first, so that a cache sized from the memory
    # budget leaves room for it.
    sized = graphs and cache.num_kv_blocks is None
    graph_memory = (measure_cuda_graph_memory(loaded.model, cache.block_size, model.device, model.dtype,
                                              scheduler.max_num_seqs, requested_len, max_tree_tokens)
                    if sized else 0)
    beside = [draft_memory(draft, cache, scheduler, max_tree_nodes, requested_len)
              for draft in drafts
              if model.device.type == "cuda" and same_device(draft.config.device, model.device)
              and cache.num_kv_blocks is None]
    blocks = _agree(num_kv_blocks(loaded.model, cache, scheduler, model.dtype, model.device, requested_len,
                                  graph_memory, beside), group)
    runner = _runner(loaded, blocks, cache.block_size, model, backend, channel, TARGET)
    max_model_len = min(requested_len, blocks * cache.block_size)
    if graphs:  # every shape captured now, before serving
        report = runner.enable_cuda_graphs(scheduler.max_num_seqs, max_model_len, max_tree_tokens, capture=True)
        if sized and report.memory_bytes > graph_memory + (64 << 20):
            logger.warning("the CUDA graphs took %.0f MiB, %.0f MiB more than was held back from the KV cache",
                           report.memory_bytes / 2**20, (report.memory_bytes - graph_memory) / 2**20)
    return LoadedShard(loaded, runner, blocks, max_model_len, backend)


def load_draft(weights: DraftWeights, index: int, cache: CacheConfig, scheduler: SchedulerConfig,
               max_tree_nodes: int, target_blocks: int, max_model_len: int,
               channel: CommandChannel | None = None) -> LoadedShard:
    """Draft model ``index`` (its ``weights``, this rank's shard of it with a
    ``channel``) given its cache and runner.

    Its attention backend is resolved for the draft's own dtype (a draft may run in
    another precision than the target). It must cover ``max_model_len`` positions
    (tree nodes never go past it: the scheduler caps the budget).
    """
    draft, loaded, group = weights.config, weights.loaded, weights.group
    limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
    if limit < max_model_len:
        raise ValueError(
            f"draft model {draft.model!r} has {limit} positions, fewer than max_model_len {max_model_len}; "
            "lower max_model_len"
        )
    blocks = num_draft_kv_blocks(cache, scheduler.max_num_seqs, max_tree_nodes, target_blocks)
    backend = resolve_backend_name(draft.attention_backend, draft.device, draft.dtype)
    runner = _runner(loaded, blocks, cache.block_size, draft, backend, channel, TARGET + 1 + index)
    if _graphs_wanted(draft, backend, group):
        # A draft level is a step of one-token chunks, one per node fed, as many as the
        # graphs' batch limit allows; a step's first level catches up on one or two
        # tokens per request. Captured now, before serving.
        runner.enable_cuda_graphs(MAX_GRAPH_BATCH, max_model_len, DRAFT_GRAPH_TOKENS, capture=True)
    logger.info("draft %d: %s with %d KV blocks%s", index, loaded.path, blocks,
                f" (rank {group.rank} of {group.size})" if group is not None else "")
    return LoadedShard(loaded, runner, blocks, max_model_len, backend)
