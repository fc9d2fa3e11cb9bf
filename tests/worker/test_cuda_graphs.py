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
from pagedtree.worker.cuda_graphs import MAX_GRAPH_TOKENS, StepGraphs, graph_buckets, graph_shapes, token_buckets
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
    assert token_buckets(65) == [1, 2, 4, 8, 16, 32, 65]  # 64 is within an eighth of 65


def test_verify_steps_of_64_node_trees_have_graphs_up_to_batch_32():
    """The shapes a default engine captures: 7 batch sizes (1 .. 64) x 1 token without
    speculation; with 64-node trees, every batch size up to 64 for trees of up to 32
    tokens and up to 32 for 64 nodes and their root."""
    buckets = graph_buckets(64)
    assert len(graph_shapes(buckets, token_buckets(1))) == 7
    assert len(graph_shapes(buckets, token_buckets(1 + 5))) == 28  # the default tree: 5 nodes
    shapes = graph_shapes(buckets, token_buckets(65))
    assert (32, 65) in shapes and (64, 65) not in shapes and (64, 32) in shapes
    assert len(shapes) == 6 * 7 + 6
    assert shapes[0] == (32, 65) and max(r * t for r, t in shapes) <= MAX_GRAPH_TOKENS  # largest first
    assert len(graph_shapes(graph_buckets(512), token_buckets(1))) == 10  # a draft's levels


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
    assert other["input_ids"] != first["input_ids"]
    # Every shape's block tables are the first rows of one device table.
    assert other["block_tables"] == first["block_tables"]


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
    runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=10, capture=False)
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
    # A causal run up to the largest token count (a draft's catch-up) takes a shape;
    # a longer one (a prefill chunk) runs eagerly.
    short = ScheduledChunk(chunks[0].request, Phase.PREFILL, [1, 2], [0, 1], [0, 1], chunks[0].block_table, 2, 1)
    assert graphs.shape_for([short, chunks[1]]) == (2, 2)
    prefill = ScheduledChunk(chunks[0].request, Phase.PREFILL, list(range(6)), list(range(6)), list(range(6)),
                             chunks[0].block_table, 6, 5)
    assert graphs.shape_for([prefill]) is None
    assert MAX_GRAPH_TOKENS == 32 * 65


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


def test_start_up_prepares_every_shape_without_capture(runner, caplog):
    """With capture off (a CPU), the start-up pass still prepares every shape's static
    buffers, largest first, and captures nothing."""
    with caplog.at_level("INFO", logger="pagedtree"):
        report = runner.enable_cuda_graphs(max_num_seqs=4, max_model_len=64, max_tree_tokens=5, capture=False)
    graphs = runner.graphs
    assert graphs.shapes[0] == (4, 5) and len(graphs.shapes) == 3 * 4
    assert (report.shapes, report.captured, report.memory_bytes, report.failed) == (12, 0, 0, [])
    assert set(graphs._uploads) == set(graphs.shapes)
    assert "CUDA graph" not in caplog.text


class _FakeGraph:
    """Stands in for a captured CUDA graph on a CPU: a replay runs the model on the
    static buffers the capture saw and writes the same output tensor."""

    def __init__(self, runner, input_ids, positions, fail: bool = False):
        self.runner, self.input_ids, self.positions, self.fail = runner, input_ids, positions, fail
        self.hidden = runner.model(input_ids, positions, runner.attention)
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.hidden.copy_(self.runner.model(self.input_ids, self.positions, self.runner.attention))


def _fake_capture(failing_shape, replay_fails: bool = False):
    """A ``StepGraphs._capture`` that fails for steps of ``failing_shape`` requests and
    captures a ``_FakeGraph`` otherwise."""

    def capture(self, input_ids, positions, with_head=False):
        plan = self.runner.attention._plan  # the shape being captured
        if (plan.num_requests, plan.num_tokens // plan.num_requests) == failing_shape:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph = _FakeGraph(self.runner, input_ids, positions, replay_fails)
        return graph, graph.hidden, None

    return capture


def test_a_shape_whose_capture_fails_runs_eagerly_and_the_others_replay(runner, monkeypatch, caplog):
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3], "a")
    eager3, eager2 = runner.forward(chunks, [0, 1, 2]), runner.forward(chunks[:2], [0, 1])
    monkeypatch.setattr(StepGraphs, "_capture", _fake_capture((4, 1)))
    with caplog.at_level("WARNING", logger="pagedtree"):
        report = runner.enable_cuda_graphs(max_num_seqs=4, max_model_len=64, max_tree_tokens=1, capture=True)
    assert report.captured == 2 and [shape for shape, _ in report.failed] == [(4, 1)]
    assert "capture failed for steps of 4 requests x 1 tokens (RuntimeError: operation not permitted" in caplog.text
    graphs = runner.graphs
    assert graphs.shape_for(chunks) is None  # 3 requests -> 4: eager
    torch.testing.assert_close(runner.forward(chunks, [0, 1, 2]), eager3)
    assert graphs.shape_for(chunks[:2]) == (2, 1)
    torch.testing.assert_close(runner.forward(chunks[:2], [0, 1]), eager2, rtol=1e-5, atol=1e-5)
    assert graphs.num_steps == 1 and graphs._graphs[(2, 1)][0].replays == 1


def test_a_replay_that_fails_raises_and_keeps_the_graphs(runner, monkeypatch):
    """A fault in a replay is the step's error: raised, never a silent switch to
    eager steps for good."""
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9], "a")
    monkeypatch.setattr(StepGraphs, "_capture", _fake_capture((1, 1), replay_fails=True))
    runner.enable_cuda_graphs(max_num_seqs=2, max_model_len=64, max_tree_tokens=1, capture=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="illegal memory access"):
            runner.forward(chunks, [0, 1])
    assert runner.graphs is not None and runner.graphs._graphs[(2, 1)][0].replays == 2


def test_a_capture_that_fails_everywhere_leaves_eager_decoding(runner, caplog):
    """Here every capture fails for want of a GPU: a warning per shape at start-up,
    then every step decodes eagerly."""
    bm = BlockManager(BLOCKS, BLOCK)
    chunks = _decode_chunks(runner, bm, [5, 9, 3], "a")
    eager = runner.forward(chunks, [0, 1, 2])
    with caplog.at_level("WARNING", logger="pagedtree"):
        report = runner.enable_cuda_graphs(max_num_seqs=8, max_model_len=64, max_tree_tokens=1, capture=True)
    assert report.captured == 0 and len(report.failed) == 4
    assert caplog.text.count("CUDA graph capture failed") == 4
    logits = runner.forward(chunks, [0, 1, 2])
    torch.testing.assert_close(logits, eager)
    assert runner.graphs.shape_for(chunks) is None and runner.graphs.num_steps == 0


def test_kv_sizing_holds_back_the_graphs_memory(tiny_llama, monkeypatch):
    """On CUDA the KV budget is the device's share minus what is in use, room for
    activations and the graphs' measured memory (mocked device here)."""
    from pagedtree.config import CacheConfig, SchedulerConfig
    from pagedtree.worker.model_runner import kv_bytes_per_block, num_kv_blocks

    model = load_model(tiny_llama.path).model
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))
    cache, scheduler = CacheConfig(block_size=16), SchedulerConfig(max_num_seqs=4)
    args = (model, cache, scheduler, torch.float32, torch.device("cuda"), 1 << 30)
    per_block = kv_bytes_per_block(model, 16, torch.float32)
    without, held = num_kv_blocks(*args), num_kv_blocks(*args, graph_memory=1000 * per_block)
    assert without - held == 1000
