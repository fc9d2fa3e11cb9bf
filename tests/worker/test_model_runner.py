"""The model runner on its own: a plan in, transformers' logits and samples out;
KV slot moves; KV cache sizing."""

from __future__ import annotations

import pytest
import torch

from pagedtree.config import CacheConfig, SchedulerConfig
from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import Phase, ScheduledChunk, SlotMove, StepPlan
from pagedtree.worker.model_runner import ModelRunner, kv_bytes_per_block, num_draft_kv_blocks, num_kv_blocks


@pytest.fixture(scope="module")
def runner_and_model(tiny_llama):
    loaded = load_model(tiny_llama.path)
    return ModelRunner(loaded.model, 16, 4, torch.device("cpu"), torch.float32, "torch"), tiny_llama.hf_model


def _chunk(bm: BlockManager, request: Request, start: int, end: int, phase=Phase.PREFILL) -> ScheduledChunk:
    rid = request.request_id
    return ScheduledChunk(request, phase, request.all_token_ids[start:end], list(range(start, end)),
                          bm.slots(rid, start, end), bm.block_table(rid), end, end - start - 1)


def test_a_plan_gives_transformers_next_token_and_logits(runner_and_model):
    runner, hf = runner_and_model
    bm = BlockManager(16, 4)
    prompts = [[5, 9, 13, 2, 7], [40, 41]]
    requests = [Request(str(i), None, p, SamplingParams(temperature=0), sampling_seed=0) for i, p in enumerate(prompts)]
    for r in requests:
        bm.allocate(r.request_id, r.all_token_ids)
    out = runner.execute(StepPlan(chunks=[_chunk(bm, r, 0, r.num_tokens) for r in requests]))
    out.read_back()
    for r, prompt in zip(requests, prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        assert out.samples[r.request_id].token_id == int(expected.argmax())
        assert out.samples[r.request_id].logprob == pytest.approx(float(torch.log_softmax(expected, -1).max()), abs=1e-4)


def test_slot_moves_copy_every_layers_kv(runner_and_model):
    runner, _ = runner_and_model
    for k, v in runner.kv_caches:
        k.view(-1, *k.shape[2:])[3] = 1.5
        v.view(-1, *v.shape[2:])[3] = -2.5
    runner.apply_slot_moves([SlotMove(3, 10)])
    for k, v in runner.kv_caches:
        assert torch.all(k.view(-1, *k.shape[2:])[10] == 1.5) and torch.all(v.view(-1, *v.shape[2:])[10] == -2.5)


def test_kv_cache_sizing(runner_and_model, tiny_llama):
    runner, _ = runner_and_model
    model = runner.model
    per_block = kv_bytes_per_block(model, 4, torch.float32)
    cpu = torch.device("cpu")
    cache = CacheConfig(block_size=4, kv_cache_memory=per_block * 10)
    assert num_kv_blocks(model, cache, SchedulerConfig(max_num_seqs=64), torch.float32, cpu, max_model_len=512) == 10
    # Never more than every sequence at full length could use.
    small = SchedulerConfig(max_num_seqs=2)
    assert num_kv_blocks(model, CacheConfig(block_size=4), small, torch.float32, cpu, max_model_len=8) == 2 * 2 + 1
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        num_kv_blocks(model, CacheConfig(block_size=4, kv_cache_memory=per_block), SchedulerConfig(), torch.float32,
                      cpu, max_model_len=512)
    assert num_draft_kv_blocks(CacheConfig(), max_num_seqs=3, max_tree_nodes=4, target_blocks=100) == 100 + 3 * (4 + 2)
    assert num_draft_kv_blocks(CacheConfig(num_draft_kv_blocks=7), 3, 4, 100) == 7
