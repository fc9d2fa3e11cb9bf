"""Padded decode and verify steps from static buffers (what a CUDA graph replays),
run on a CPU.

The capture itself needs a GPU; everything it relies on is checked here with the
Triton kernels in the interpreter: padding tokens and requests change no real row's
logits and touch no real KV block, and every buffer the launches read keeps its
address from one step of a shape to the next, whatever the batch, the trees and the
context lengths.
"""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import Phase, ScheduledChunk
from pagedtree.worker.cuda_graphs import MAX_GRAPH_TOKENS, graph_buckets, token_buckets
from pagedtree.worker.model_runner import ModelRunner

BLOCK = 4
BLOCKS = 64


def test_buckets_are_powers_of_two_up_to_the_batch_limit():
    assert graph_buckets(1) == [1]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(4096)[-1] == 512
    assert token_buckets(1) == [1]
    assert token_buckets(11) == [1, 2, 4, 8, 11]


@pytest.fixture
def runner(tiny_llama):
    loaded = load_model(tiny_llama.path)
    return ModelRunner(loaded.model, BLOCKS, BLOCK, torch.device("cpu"), torch.float32, "triton")


def _decode_chunks(runner: ModelRunner, bm: BlockManager, lengths: list[int], tag: str) -> list[ScheduledChunk]:
    """One decode chunk per request, its context prefilled with random keys/values."""
    gen = torch.Generator().manual_seed(sum(lengths))
    chunks = []
    for i, n in enumerate(lengths):
        rid = f"{tag}{i}"
        tokens = torch.randint(0, 200, (n,), generator=gen).tolist()
        request = Request(rid, None, tokens, SamplingParams(temperature=0), sampling_seed=0)
        bm.allocate(rid, tokens)
        chunks.append(ScheduledChunk(request, Phase.DECODE, tokens[-1:], [n - 1], bm.slots(rid, n - 1, n),
                                     bm.block_table(rid), n, 0))
    for key_cache, value_cache in runner.kv_caches:
        key_cache[:BLOCKS].normal_(generator=gen)
        value_cache[:BLOCKS].normal_(generator=gen)
    return chunks


def _tree_chunk(runner: ModelRunner, bm: BlockManager, context: int, parents: list[int], rid: str) -> ScheduledChunk:
    """A VERIFY chunk: a root and a tree of ``len(parents) - 1`` nodes after ``context - 1``
    tokens, its prefix's keys and values already in the cache."""
    gen = torch.Generator().manual_seed(context + len(parents))
    tokens = torch.randint(0, 200, (context,), generator=gen).tolist()
    request = Request(rid, None, tokens, SamplingParams(temperature=0), sampling_seed=0)
    bm.allocate(rid, tokens)
    bm.append_slots(rid, len(parents) - 1)
    depth = [0] * len(parents)
    for j, p in enumerate(parents):
        depth[j] = 0 if p < 0 else depth[p] + 1
    prefix = context - 1
    ids = [tokens[-1]] + torch.randint(0, 200, (len(parents) - 1,), generator=gen).tolist()
    return ScheduledChunk(request, Phase.VERIFY, ids, [prefix + d for d in depth],
                          bm.slots(rid, prefix, prefix + len(parents)), bm.block_table(rid), prefix + len(parents), 0,
                          tree_parents=parents)


def _addresses(runner: ModelRunner, chunks, rows) -> dict[str, int]:
    graphs = runner.graphs
    ids, positions, _ = graphs.prepare(chunks, list(rows), graphs.shape_for(chunks))
    plan = runner.attention._plan
    tiles = next(iter(plan.tile_cache.values()))
    return {"input_ids": ids.data_ptr(), "positions": positions.data_ptr(), "slots": plan.slot_mapping.data_ptr(),
            "query_start": plan.query_start.data_ptr(), "context_lens": plan.context_lens.data_ptr(),
            "block_tables": plan.block_tables.data_ptr(), "tables_width": plan.block_tables.shape[1],
            "tree_mask": plan.tree_mask.data_ptr(), "tree_mask_shape": tuple(plan.tree_mask.shape),
            "tile_req": tiles[0].data_ptr(), "tile_q": tiles[1].data_ptr(), "num_tiles": tiles[2],
            "max_context": plan.max_context_len}


def test_a_padded_static_step_gives_the_eager_logits_and_spares_real_blocks(runner):
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3], "a")
    eager = runner.forward(chunks, [0, 1, 2])
    snapshot = [(k[:BLOCKS].clone(), v[:BLOCKS].clone()) for k, v in runner.kv_caches]
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=1, capture=False)
    assert runner.graphs.shape_for(chunks) == (4, 1)
    static = runner.forward(chunks, [0, 1, 2])
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    # The padding row wrote only into the scratch block (the real rows rewrote their own slots).
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        assert torch.equal(k[:BLOCKS], k0) and torch.equal(v[:BLOCKS], v0)


def test_every_buffer_keeps_its_address_within_a_bucket(runner):
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=1, capture=False)
    chunks = _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [5, 9, 3, 17, 2], "a")
    first = _addresses(runner, chunks, range(5))
    chunks = _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [30, 7, 11, 2, 6, 9, 40], "b")
    second = _addresses(runner, chunks, [0, 3, 6])
    assert first == second
    assert first["tables_width"] == 17 and first["max_context"] == 68  # 64 tokens and a padding token
    other = _addresses(runner, _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [5, 9, 3], "c"), range(3))
    assert other["input_ids"] != first["input_ids"] and other["block_tables"] != first["block_tables"]


def _verify_step(runner: ModelRunner, bm: BlockManager, tag: str) -> list[ScheduledChunk]:
    """Two trees of different sizes and a plain decode in one step."""
    decode = _decode_chunks(runner, bm, [7], tag)[0]
    return [_tree_chunk(runner, bm, 9, [-1, 0, 0, 1, 2, 1], f"{tag}t0"), decode,
            _tree_chunk(runner, bm, 13, [-1, 0, 1], f"{tag}t1")]


def test_a_padded_verify_step_gives_the_eager_logits_and_spares_real_blocks(runner):
    """Trees padded with extra roots to the shape's token count, requests padded to
    its batch size: every real row's logits as eager, no real block written but the
    real tokens' own slots."""
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _verify_step(runner, bm, "v")
    rows = [6, 0, 1, 2, 3, 4, 5, 7, 8, 9]  # the decode's row first, as execute orders them
    eager = runner.forward(chunks, rows)
    written = {s for c in chunks for s in c.slot_mapping}
    snapshot = [(k[:BLOCKS].clone(), v[:BLOCKS].clone()) for k, v in runner.kv_caches]
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=7, capture=False)
    assert runner.graphs.shape_for(chunks) == (4, 7)  # 3 requests -> 4, 6 tokens -> 7 (the largest)
    static = runner.forward(chunks, rows)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    assert runner.graphs.num_steps == 1
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        changed = (k[:BLOCKS] != k0).any(-1).any(-1) | (v[:BLOCKS] != v0).any(-1).any(-1)  # [block, slot]
        slots = {int(b) * BLOCK + int(o) for b, o in changed.nonzero().tolist()}
        assert slots <= written


def test_verify_steps_of_a_shape_keep_every_address(runner):
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=9, capture=False)
    first = _addresses(runner, _verify_step(runner, BlockManager(BLOCKS, BLOCK), "a"), range(10))
    bm = BlockManager(BLOCKS, BLOCK)
    other = [_tree_chunk(runner, bm, 20, [-1, 0, 1, 2, 3, 4, 5, 6], "x"), _decode_chunks(runner, bm, [3], "y")[0]]
    second = _addresses(runner, other + [_tree_chunk(runner, bm, 4, [-1, 0], "z")], [0, 8])
    assert runner.graphs.shape_for(other) == (2, 8) and first["tree_mask_shape"] == (4 * 8, 1)
    assert first == second


def test_steps_that_do_not_fit_a_shape_run_eagerly(runner):
    runner.enable_cuda_graphs(max_num_seqs=4, max_model_len=64, max_tree_tokens=5, capture=False)
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3, 4, 6], "a")
    graphs = runner.graphs
    assert graphs.shape_for(chunks) is None  # more than the largest batch size
    assert graphs.shape_for(chunks[:2]) == (2, 1)
    big = _tree_chunk(runner, bm, 8, [-1] + list(range(5)), "t")  # 6 tokens: more than a shape holds
    assert graphs.shape_for([big]) is None
    assert graphs.shape_for([big, chunks[0]][1:]) == (1, 1)
    prefill = ScheduledChunk(chunks[0].request, Phase.PREFILL, [1, 2], [0, 1], [0, 1], chunks[0].block_table, 2, 1)
    assert graphs.shape_for([prefill]) is None
    assert MAX_GRAPH_TOKENS == 512


def test_greedy_decoding_through_padded_static_steps_is_unchanged(tiny_llama):
    prompts = [{"prompt_token_ids": [3 + i, 17, 5 * i + 1, 40, 2][: 2 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(static: bool):
        llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", attention_backend="triton",
                  enforce_eager=True, max_num_seqs=4, block_size=4)
        if static:
            llm.engine.runner.enable_cuda_graphs(4, llm.engine.max_model_len, 1, capture=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner

    eager, _ = run(False)
    static, runner = run(True)
    assert static == eager
    assert runner.graphs is not None and runner.graphs.num_steps >= 7  # every decode step after the prefill


def test_a_capture_that_fails_falls_back_to_eager_decoding(runner, caplog):
    """Here the capture fails for want of a GPU: the step still decodes, eagerly, and
    later steps do not try again."""
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3], "a")
    eager = runner.forward(chunks, [0, 1, 2])
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=1, capture=True)
    with caplog.at_level("WARNING", logger="pagedtree"):
        logits = runner.forward(chunks, [0, 1, 2])
    torch.testing.assert_close(logits, eager)
    assert runner.graphs is None and "CUDA graph capture failed" in caplog.text

