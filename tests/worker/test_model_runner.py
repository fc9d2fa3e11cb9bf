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
    requests = [Request(str(i), None, p, SamplingParams(temperature=0, logprobs=0), sampling_seed=0)
                for i, p in enumerate(prompts)]
    for r in requests:
        bm.allocate(r.request_id, r.all_token_ids)
    out = runner.execute(StepPlan(chunks=[_chunk(bm, r, 0, r.num_tokens) for r in requests]))
    host = out.read_back()
    for r, prompt in zip(requests, prompts):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0, -1]
        assert host.samples[r.request_id].token_id == int(expected.argmax())
        assert host.samples[r.request_id].logprob == pytest.approx(float(torch.log_softmax(expected, -1).max()), abs=1e-4)


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


class _FakeDevice:
    """A CUDA device's memory as ``torch.cuda`` reports it (mocked): ``tensors`` bytes
    in live tensors, ``cached`` in the allocator's cache (an earlier engine's, freed
    but not handed back until ``empty_cache``) and ``rest`` outside torch."""

    def __init__(self, monkeypatch, total: int, tensors: int, cached: int, rest: int):
        self.total, self.tensors, self.cached, self.rest = total, tensors, cached, rest
        for name in ("empty_cache", "mem_get_info", "memory_allocated", "memory_reserved"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def empty_cache(self) -> None:
        self.cached = 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - (self.tensors + self.cached + self.rest), self.total

    def memory_allocated(self, device=None) -> int:
        return self.tensors

    def memory_reserved(self, device=None) -> int:
        return self.tensors + self.cached


def test_cuda_kv_sizing_hands_cached_memory_back_before_measuring(runner_and_model, monkeypatch):
    """An earlier engine's memory sits in torch's allocator cache until ``empty_cache``:
    measured before it, it made a second engine's cache negative (mocked device)."""
    model = runner_and_model[0].model
    gib = 1 << 30
    device = _FakeDevice(monkeypatch, total=80 * gib, tensors=4 * gib, cached=60 * gib, rest=gib)
    scheduler = SchedulerConfig(max_num_seqs=4)
    blocks = num_kv_blocks(model, CacheConfig(block_size=16, gpu_memory_utilization=0.3), scheduler,
                           torch.float32, torch.device("cuda", 0), max_model_len=256)
    assert device.cached == 0
    assert blocks == 4 * 256 // 16 + 1  # every sequence at full length: the budget holds far more


def test_a_cuda_kv_budget_too_small_says_who_holds_the_memory(runner_and_model, monkeypatch):
    model = runner_and_model[0].model
    gib = 1 << 30
    _FakeDevice(monkeypatch, total=80 * gib, tensors=20 * gib, cached=0, rest=5 * gib)
    with pytest.raises(ValueError, match=r"fewer than 2 blocks.*0\.3 of 80\.00 GiB is 24\.00 GiB, less 25\.00 GiB "
                                         r"in use \(20\.00 GiB by this process's tensors, 0\.00 GiB cached by its "
                                         r"allocator, 5\.00 GiB by the rest"):
        num_kv_blocks(model, CacheConfig(block_size=16, gpu_memory_utilization=0.3), SchedulerConfig(),
                      torch.float32, torch.device("cuda", 0), max_model_len=256)


def test_a_closed_runner_lets_go_of_its_model_and_cache(tiny_llama):
    import gc
    import weakref

    runner = ModelRunner(load_model(tiny_llama.path).model, 8, 4, torch.device("cpu"), torch.float32, "torch")
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0][0])
    runner.close()
    runner.close()  # idempotent
    gc.collect()
    assert model() is None and cache() is None
    assert runner.memory_bytes() == {"weights": 0, "kv_cache": 0}
