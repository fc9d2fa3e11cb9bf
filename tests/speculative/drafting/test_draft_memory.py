"""A draft model's KV cache and graphs in the target's memory budget: a cache sized
from the device's memory leaves room for the drafts beside it, and what it counts for
a draft is what the draft's cache then takes."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM
from pagedtree.config import CacheConfig, SchedulerConfig
from pagedtree.executor.shards import DraftWeights, draft_memory
from pagedtree.loading.loader import LoadedModel, load_model
from pagedtree.loading.resolve import resolve_config
from pagedtree.worker.model_runner import DraftMemory, kv_bytes_per_block, num_kv_blocks


def test_kv_sizing_leaves_room_for_the_drafts_caches_and_graphs(tiny_llama, monkeypatch):
    """A draft on the target's device takes its share of a cache sized from the
    device's memory: its cache grows with the target's (bytes per target block), plus
    its trees' branches and its graphs (mocked device here)."""
    model = load_model(tiny_llama.path).model
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    cache, scheduler = CacheConfig(block_size=16), SchedulerConfig(max_num_seqs=4)
    args = (model, cache, scheduler, torch.float32, torch.device("cuda"), 1 << 30)
    per_block = kv_bytes_per_block(model, 16, torch.float32)
    alone = num_kv_blocks(*args)
    # A draft whose block is half the target's, with 100 branch blocks and graphs the
    # size of 50 of its blocks: (budget - 150 draft blocks) / 1.5 target blocks.
    draft = DraftMemory(bytes_per_block=per_block // 2, extra_blocks=100, graph_bytes=50 * (per_block // 2))
    beside = num_kv_blocks(*args, drafts=[draft])
    assert beside == (alone * per_block - 150 * (per_block // 2)) // (per_block + per_block // 2)
    # A set draft block count does not grow with the target's.
    fixed = DraftMemory(bytes_per_block=per_block, extra_blocks=100, fixed_blocks=10)
    assert num_kv_blocks(*args, drafts=[fixed]) == alone - 10
    with pytest.raises(ValueError, match="draft"):
        num_kv_blocks(*args, drafts=[DraftMemory(bytes_per_block=per_block, extra_blocks=0, graph_bytes=80 << 30)])


def test_the_drafts_counted_memory_is_the_cache_it_gets(tiny_llama, tiny_llama_draft):
    """What the target's sizing counts for a draft is what the draft's cache then
    takes, at the engine's real block counts."""
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", max_num_seqs=3, block_size=4,
              num_kv_blocks=40, draft_model=[str(tiny_llama_draft.path)])
    engine = llm.engine
    draft = engine.speculation.drafts[0]
    resolved = resolve_config(engine.config)
    weights = DraftWeights(resolved.drafts[0], LoadedModel(draft.runner.model, None, None, None), None)
    counted = draft_memory(weights, resolved.cache, resolved.scheduler, resolved.max_tree_nodes, engine.max_model_len)
    taken = draft.runner.memory_bytes()["kv_cache"]
    assert counted.fixed_bytes() + counted.bytes_per_target_block() * engine.block_manager.num_blocks == taken
