"""Padded decode steps from static buffers (what a CUDA graph replays), run on a CPU.

The capture itself needs a GPU; everything it relies on is checked here with the
Triton kernels in the interpreter: padding rows change no real row's logits and
touch no real KV block, and every buffer the launches read keeps its address from
one step of a bucket to the next, whatever the batch size and context lengths.
"""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.scheduler.plan import Phase, ScheduledChunk
from pagedtree.worker.cuda_graphs import graph_buckets
from pagedtree.worker.model_runner import ModelRunner

BLOCK = 4
BLOCKS = 64


def test_buckets_are_powers_of_two_up_to_the_batch_limit():
    assert graph_buckets(1) == [1]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(4096)[-1] == 512


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


def _addresses(runner: ModelRunner, bucket: int, chunks) -> dict[str, int]:
    graphs = runner.graphs
    ids, positions, meta, _ = runner.step_inputs(chunks, range(bucket), graphs._uploads[bucket], pad_to=bucket)
    from pagedtree.kernels.attention_plan import StaticShape

    runner.attention.begin_step(meta, StaticShape(bucket, graphs.max_blocks), runner.model.config.num_attention_heads)
    plan = runner.attention._plan
    tiles = next(iter(plan.tile_cache.values()))
    return {"input_ids": ids.data_ptr(), "positions": positions.data_ptr(), "slots": meta.slot_mapping.data_ptr(),
            "query_start": plan.query_start.data_ptr(), "context_lens": plan.context_lens.data_ptr(),
            "block_tables": plan.block_tables.data_ptr(), "tables_width": plan.block_tables.shape[1],
            "tile_req": tiles[0].data_ptr(), "tile_q": tiles[1].data_ptr(), "max_context": plan.max_context_len}


def test_a_padded_static_step_gives_the_eager_logits_and_spares_real_blocks(runner):
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3], "a")
    eager = runner.forward(chunks, [0, 1, 2])
    snapshot = [(k[:BLOCKS].clone(), v[:BLOCKS].clone()) for k, v in runner.kv_caches]
    runner.enable_decode_graphs(max_num_seqs=8, max_model_len=64, capture=False)
    assert runner.graphs.bucket_for(chunks, [0, 1, 2]) == 4
    static = runner.forward(chunks, [0, 1, 2])
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    # The padding row wrote only into the scratch block (the real rows rewrote their own slots).
    for (k, v), (k0, v0) in zip(runner.kv_caches, snapshot):
        assert torch.equal(k[:BLOCKS], k0) and torch.equal(v[:BLOCKS], v0)


def test_every_buffer_keeps_its_address_within_a_bucket(runner):
    runner.enable_decode_graphs(max_num_seqs=8, max_model_len=64, capture=False)
    first = _addresses(runner, 8, _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [5, 9, 3, 17, 2], "a"))
    second = _addresses(runner, 8, _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [30, 7, 11, 2, 6, 9, 40], "b"))
    assert first == second
    assert first["tables_width"] == 16 and first["max_context"] == 64
    other = _addresses(runner, 4, _decode_chunks(runner, BlockManager(BLOCKS, BLOCK), [5, 9, 3], "c"))
    assert other["input_ids"] != first["input_ids"] and other["block_tables"] != first["block_tables"]


def test_steps_that_are_not_plain_decodes_run_eagerly(runner):
    runner.enable_decode_graphs(max_num_seqs=4, max_model_len=64, capture=False)
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3, 4, 6], "a")
    graphs = runner.graphs
    assert graphs.bucket_for(chunks, list(range(5))) is None  # more than the largest bucket
    assert graphs.bucket_for(chunks[:2], [1]) is None  # not every row's logits
    tree = ScheduledChunk(chunks[0].request, Phase.VERIFY, [1, 2], [4, 5], [0, 1], chunks[0].block_table, 6, 0,
                          tree_parents=[-1, 0])
    assert graphs.bucket_for([tree], [0, 1]) is None


def test_greedy_decoding_through_padded_static_steps_is_unchanged(tiny_llama):
    prompts = [{"prompt_token_ids": [3 + i, 17, 5 * i + 1, 40, 2][: 2 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(static: bool):
        llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", attention_backend="triton",
                  enforce_eager=True, max_num_seqs=4, block_size=4)
        if static:
            llm.engine.runner.enable_decode_graphs(4, llm.engine.max_model_len, capture=False)
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
    runner.enable_decode_graphs(max_num_seqs=8, max_model_len=64, capture=True)
    with caplog.at_level("WARNING", logger="pagedtree"):
        logits = runner.forward(chunks, [0, 1, 2])
    torch.testing.assert_close(logits, eager)
    assert runner.graphs is None and "CUDA graph capture failed" in caplog.text
