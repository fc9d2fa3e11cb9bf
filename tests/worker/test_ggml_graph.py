"""The decoder as one ggml graph a step: what it computes, and that a token's bits do
not depend on what shares its step (tree verification's exactness rests on it).

The model has the shapes of a GGUF's Q4_K layers (every product's input a multiple
of 256 wide), so its products run in the layout llama.cpp uses on the machine:
repacked where the CPU has a repacked kernel for Q4_K, the file's blocks otherwise.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("ggml")

from pagedtree import LLM, SamplingParams  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402
from pagedtree.worker.models import ggml_graph  # noqa: E402
from pagedtree.worker.models.ggml_graph import GgmlGraphForward  # noqa: E402
from tests.conftest import assert_speculation_exact, save_tiny_model  # noqa: E402

BLOCK = 4


@pytest.fixture(scope="module")
def q4k_model(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases, tied embedding) whose products all take Q4_K blocks."""
    return save_tiny_model(tmp_path_factory.mktemp("q4k_qwen2"), "qwen2", seed=5, with_tokenizer=False,
                           hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(q4k_model):
    # fp32 activations and cache: a bit that differs inside the graph shows in the
    # output (bf16 would round most such differences away, not all).
    llm = LLM(str(q4k_model.path), quantization="ggml", dtype="float32", device="cpu", block_size=BLOCK,
              max_model_len=1024)
    yield llm
    llm.shutdown()


def _forward(llm, requests: list[dict]) -> torch.Tensor:
    """One forward of ``requests`` (each: ``ids``, ``start`` position, ``blocks`` (its
    block table), optional ``parents`` of a tree whose nodes sit at ``start + depth``
    in the slots after the context); the hidden states of the step's tokens."""
    runner = llm.engine.runner
    ids, positions, slots, starts, contexts, tables, trees = [], [], [], [0], [], [], []
    for r in requests:
        n, start, parents = len(r["ids"]), r["start"], r.get("parents")
        if parents is None:
            pos = list(range(start, start + n))
        else:
            depth = []
            for p in parents:
                depth.append(0 if p < 0 else depth[p] + 1)
            pos = [start + d for d in depth]
        table = r["blocks"]
        slots += [table[(start + j) // BLOCK] * BLOCK + (start + j) % BLOCK for j in range(n)]
        ids += r["ids"]
        positions += pos
        starts.append(starts[-1] + n)
        contexts.append(start + n)
        tables.append(table)
        trees.append(parents)
    meta = AttentionMetadata(block_size=BLOCK, slot_mapping=torch.tensor(slots), query_start_loc=starts,
                             context_lens=contexts, block_tables=tables, tree_parents=trees)
    runner.attention.begin_step(meta)
    return runner.model(torch.tensor(ids), torch.tensor(positions), runner.attention)


def test_a_ggml_model_runs_as_one_graph_and_computes_what_its_layers_do(engine, q4k_model, monkeypatch):
    """The graph against the same weights' layer-by-layer forward (bf16 activations
    between ggml's products there, fp32 in the graph): close, and as far from the
    fp32 model as the 4-bit weights put both."""
    _check_against_layers(engine, q4k_model, monkeypatch)


def test_llama3_rotary_scaling_runs_in_the_graph(tmp_path, monkeypatch):
    """Llama 3's rotary scaling divides each frequency by its own factor, which
    ggml's rotary takes as ``freq_factors``: the graph follows the layers' forward as
    closely as with plain rotary (without the factors it would not)."""
    scaled = save_tiny_model(tmp_path / "llama3", "llama", seed=7, with_tokenizer=False, hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    llm = LLM(str(scaled.path), quantization="ggml", dtype="float32", device="cpu", block_size=BLOCK,
              max_model_len=256)
    forward = llm.engine.runner.model.fused_forward
    assert isinstance(forward, GgmlGraphForward) and forward.freq_factors is not None
    assert forward.freq_factors.max() > 2  # the low frequencies slowed by the factor
    _check_against_layers(llm, scaled, monkeypatch)
    llm.shutdown()


def _check_against_layers(engine, tiny, monkeypatch) -> None:
    model = engine.engine.runner.model
    assert isinstance(model.fused_forward, GgmlGraphForward)
    prompt = [(7 * i + 3) % 256 for i in range(40)]
    with torch.no_grad():
        graph = model.compute_logits(_forward(engine, [dict(ids=prompt, start=0, blocks=list(range(10)))])).float()
        monkeypatch.setattr(model, "fused_forward", None)
        layers = model.compute_logits(_forward(engine, [dict(ids=prompt, start=0, blocks=list(range(10)))])).float()
        dense = tiny.hf_model(torch.tensor([prompt])).logits[0]

    def error(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert error(graph, layers) < 0.1
    assert (graph.argmax(-1) == layers.argmax(-1)).float().mean() >= 0.75  # a random model: near ties
    assert error(graph, dense) < 1.2 * error(layers, dense)


def test_a_tokens_bits_do_not_depend_on_what_shares_its_step(engine):
    """A decoded token alone, beside a prompt chunk and a tree; a tree's chain of
    nodes against the same tokens decoded one by one; a context padded to another
    length: the same bits each time."""
    prompt_a = [(5 * i + 1) % 256 for i in range(13)]
    a_blocks = list(range(0, 8))
    first = _forward(engine, [dict(ids=prompt_a, start=0, blocks=a_blocks)])
    chain = [17, 99, 4]
    one_by_one = torch.cat([_forward(engine, [dict(ids=[t], start=13 + i, blocks=a_blocks)])
                            for i, t in enumerate(chain)])
    # The same three tokens as a tree's chain, with a sibling branch the chain must
    # not see, in a step with a prompt chunk of another request and its tree.
    prompt_b = [(3 * i + 2) % 256 for i in range(7)]
    b_blocks = list(range(8, 16))
    tree = dict(ids=chain + [55, 56], start=13, blocks=a_blocks, parents=[-1, 0, 1, 0, 3])
    together = _forward(engine, [dict(ids=prompt_b, start=0, blocks=b_blocks), tree])
    assert torch.equal(together[7:10], one_by_one)
    # A lone decode of the chain's first token, alone and beside others.
    alone = _forward(engine, [dict(ids=[17], start=13, blocks=a_blocks)])
    beside = _forward(engine, [dict(ids=[21, 22, 23], start=7, blocks=b_blocks),
                               dict(ids=[17], start=13, blocks=a_blocks),
                               dict(ids=[8, 9], start=10, blocks=b_blocks, parents=[-1, -1])])
    assert torch.equal(beside[3:4], alone)
    assert not torch.equal(together[10], together[8])  # the sibling saw another context
    # A shape seen before, after others: its graph's buffers are still its own.
    assert torch.equal(_forward(engine, [dict(ids=prompt_a, start=0, blocks=a_blocks)]), first)


def test_the_cached_graphs_stay_within_their_memory(engine, monkeypatch):
    forward = engine.engine.runner.model.fused_forward
    monkeypatch.setattr(ggml_graph, "GRAPH_CACHE_BYTES", 1)
    blocks = list(range(40, 50))
    prompt = [(3 * i) % 256 for i in range(21)]
    want = _forward(engine, [dict(ids=prompt, start=0, blocks=blocks)])
    for n in (1, 2, 3):
        _forward(engine, [dict(ids=list(range(n)), start=21, blocks=blocks)])
        assert len(forward._graphs) == 1  # only the graph in use
    assert torch.equal(_forward(engine, [dict(ids=prompt, start=0, blocks=blocks)]), want)


@pytest.fixture(scope="module")
def file_layout_engine(q4k_model):
    """The engine above with its weights in the file's layout (no repacked copies):
    prompt chunks of 8 rows or more take ggml's tiled K-quant GEMM."""
    from pagedtree.worker.models.ggml_matmul import shared_runtime

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shared_runtime(), "repack_buffer_type", None)
        llm = LLM(str(q4k_model.path), quantization="ggml", dtype="float32", device="cpu", block_size=BLOCK,
                  max_model_len=1024)
    assert len(llm.engine.runner.model.fused_forward.repacked) == 0
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("layout", ["repacked", "file"])
@pytest.mark.parametrize("length", [83, 81])
def test_a_prompt_gets_the_same_bits_however_it_is_cut_at_multiples_of_the_row_group(
        request, layout, length):
    """A prompt chunk's products take its first multiple of ``ROW_GROUP`` rows
    together (the repacked GEMM, or ggml's tiled GEMM for the file's layout, which
    needs 8 rows) and its attention runs in pieces below ggml's 64-query tiling. Cut
    where the scheduler cuts (at multiples of ``ROW_GROUP``), beside another request's
    chunk or alone, into a last chunk of fewer than 8 rows or of a single token (which
    runs as a decoded token), a prompt's rows keep their bits."""
    engine = request.getfixturevalue("engine" if layout == "repacked" else "file_layout_engine")
    group = ggml_graph.ROW_GROUP
    prompt = [(9 * i + 4) % 256 for i in range(length)]
    blocks = list(range(60, 60 + -(-length // BLOCK)))
    whole = _forward(engine, [dict(ids=prompt, start=0, blocks=blocks)])
    other = dict(ids=[(5 * i) % 256 for i in range(6)], start=0, blocks=list(range(100, 102)))
    for cut in (2 * group, length // group * group):
        first = _forward(engine, [other, dict(ids=prompt[:cut], start=0, blocks=blocks)])[6:]
        rest = _forward(engine, [dict(ids=prompt[cut:], start=cut, blocks=blocks), other])[:length - cut]
        assert torch.equal(torch.cat([first, rest]), whole), f"cut at {cut}"


def test_a_long_contexts_decode_equals_its_row_in_a_tree(engine):
    """Past 512 entries ggml's own attention splits a lone query's context across
    threads (another rounding than a query among others): the graph's does not."""
    prompt = [(3 * i + 1) % 256 for i in range(600)]
    blocks = list(range(100, 100 + 160))
    _forward(engine, [dict(ids=prompt, start=0, blocks=blocks)])
    alone = _forward(engine, [dict(ids=[77], start=600, blocks=blocks)])
    tree = _forward(engine, [dict(ids=[77, 78, 79], start=600, blocks=blocks, parents=[-1, 0, 0])])
    assert torch.equal(tree[:1], alone)


def test_padding_the_context_changes_no_bits(engine, monkeypatch):
    prompt = [(11 * i + 5) % 256 for i in range(30)]
    blocks = list(range(20, 30))
    _forward(engine, [dict(ids=prompt, start=0, blocks=blocks)])
    step = dict(ids=[42, 43], start=30, blocks=blocks, parents=[-1, 0])
    bucketed = _forward(engine, [step])
    monkeypatch.setattr(ggml_graph, "CONTEXT_BUCKET", 96)
    assert torch.equal(_forward(engine, [step]), bucketed)


def test_a_long_context_beside_short_ones_pads_only_itself(engine):
    """Each request attends over its own context, padded to its own bucket: one long
    context in a batch of decodes costs the graph its own gathered keys and values,
    not the batch's (a server's memory stays proportional to what it holds)."""
    forward = engine.engine.runner.model.fused_forward
    bucket = ggml_graph.CONTEXT_BUCKET
    short = ggml_graph._Graph(forward, ggml_graph.StepShape(((1, bucket, False),) * 8))
    mixed = ggml_graph._Graph(forward, ggml_graph.StepShape(((1, bucket, False),) * 7 + ((1, 8 * bucket, False),)))
    width = forward.num_kv_heads * forward.head_dim
    one_long = 2 * 8 * bucket * width * 4  # its keys and values, gathered in fp32
    assert mixed.buffer_bytes - short.buffer_bytes <= 1.5 * one_long


def test_a_step_that_would_index_outside_the_cache_is_refused(engine):
    """ggml checks no bounds: the graph's own check of the step (whatever attention
    backend checked it first), and token ids."""
    slots = engine.engine.runner.num_blocks * BLOCK

    def meta(slot: int, table: list[int], context: int = 1) -> AttentionMetadata:
        return AttentionMetadata(block_size=BLOCK, slot_mapping=torch.tensor([slot]), query_start_loc=[0, 1],
                                 context_lens=[context], block_tables=[table], tree_parents=[None])

    positions = torch.tensor([0])
    ggml_graph.step_inputs(meta(5, [1], 2), positions, slots)
    with pytest.raises(ValueError, match="block ids outside the cache"):
        ggml_graph.step_inputs(meta(5, [slots // BLOCK]), positions, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        ggml_graph.step_inputs(meta(slots, [0]), positions, slots)
    with pytest.raises(ValueError, match="block table too short"):
        ggml_graph.step_inputs(meta(5, [1], 9), positions, slots)
    with pytest.raises(IndexError, match="token ids"):
        _forward(engine, [dict(ids=[1, 256], start=0, blocks=[0])])


def test_speculation_through_the_graph_equals_plain_decoding(q4k_model, tmp_path):
    """The engine end to end: greedy trees verified through the graph give plain
    decoding's tokens, in batches with chunked prompts, and free every block."""
    draft = save_tiny_model(tmp_path / "draft", "qwen2", seed=6, with_tokenizer=False, hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 256 for i in range(5 + 9 * j)]} for j in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(q4k_model.path), quantization="ggml", device="cpu", block_size=BLOCK, max_model_len=256,
              draft_model=str(draft.path), max_num_batched_tokens=32,
              speculative={"tree": "static", "expansion": (2, 1, 1), "max_nodes": 6, "adaptive": False})
    assert isinstance(llm.engine.runner.model.fused_forward, GgmlGraphForward)
    assert_speculation_exact(llm, prompts, params, counter="num_drafts")
    llm.shutdown()


def test_a_65_query_tree_of_a_qwen_shaped_model_equals_its_tokens_decoded_one_by_one(tmp_path):
    """The shapes the engine sends a real model: a 64-node tree is 65 queries (where
    ggml's faster attention would tile 64 queries together), and Qwen2.5 has 6 query
    heads per KV head. The tree's chain of rows has the bits of the same tokens
    decoded one at a time."""
    qwen = save_tiny_model(tmp_path / "qwen", "qwen2", seed=8, with_tokenizer=False, hidden_size=768,
                           intermediate_size=1536, num_attention_heads=12, num_key_value_heads=2,
                           num_hidden_layers=1)
    llm = LLM(str(qwen.path), quantization="ggml", dtype="float32", device="cpu", block_size=BLOCK,
              max_model_len=256)
    assert isinstance(llm.engine.runner.model.fused_forward, GgmlGraphForward)
    blocks = list(range(40))
    prompt = [(11 * i + 2) % 256 for i in range(20)]
    _forward(llm, [dict(ids=prompt, start=0, blocks=blocks)])
    chain = [(7 * i + 5) % 256 for i in range(65)]
    one_by_one = torch.cat([_forward(llm, [dict(ids=[t], start=20 + i, blocks=blocks)]) for i, t in enumerate(chain)])
    tree = _forward(llm, [dict(ids=chain, start=20, blocks=blocks, parents=[-1] + list(range(64)))])
    assert torch.equal(tree, one_by_one)
    llm.shutdown()
