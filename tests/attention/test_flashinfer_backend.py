"""The FlashInfer backend hands FlashInfer the step it was given: page tables, last-page
lengths, query offsets and tree masks that, read as FlashInfer's documentation
reads them (``fake_flashinfer``), give the torch reference's attention."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from pagedtree.attention import make_backend
from pagedtree.attention.flashinfer_backend import TENSOR_CORE_GROUP, FlashInferPagedAttention
from pagedtree.kernels.flashinfer_layout import CAUSAL, DECODE, MASKED, paged_layout
from pagedtree.step_data import AttentionMetadata, StaticShape
from tests.attention import fake_flashinfer

BLOCK = 4
HEAD_DIM = 64
# The backend's stores and copies are Triton's kernels, here on CPU tensors.
INTERPRETER = pytest.mark.triton_interpreter


def _meta(q_lens, context_lens, parents, tables, slots=None):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    if slots is None:  # each new token at its position's slot
        slots = []
        for q, ctx, table in zip(q_lens, context_lens, tables):
            slots += [table[pos // BLOCK] * BLOCK + pos % BLOCK for pos in range(ctx - q, ctx)]
    return AttentionMetadata(BLOCK, torch.tensor(slots), qsl, list(context_lens), tables, parents)


def _tree(rng: random.Random, nodes: int) -> list[int]:
    """A root (the last committed token) and ``nodes`` nodes under it."""
    return [-1] + [rng.randrange(0, j) for j in range(1, nodes + 1)]


def test_a_decode_step_is_its_pages_and_the_fill_of_its_last():
    layout = paged_layout(_meta([1, 1], [5, 8], [None, None], [[3, 1, 7], [2, 0]]))
    assert layout.kind == DECODE and layout.custom_mask is None
    assert layout.qo_indptr == [0, 1, 2]
    assert layout.kv_indptr == [0, 2, 4] and layout.kv_indices == [3, 1, 2, 0]  # only the pages in use
    assert layout.kv_last_page_len == [1, 4]


def test_a_tree_sees_the_prefix_itself_and_its_ancestors_and_a_chunk_beside_it_is_causal():
    # Request 0: 2 prefix keys, then a root and two children of it. Request 1: a chunk of 2 after 1 key.
    layout = paged_layout(_meta([3, 2], [5, 3], [[-1, 0, 0], None], [[0, 1], [2]]))
    assert layout.kind == MASKED
    tree = np.array([[1, 1, 1, 0, 0],
                     [1, 1, 1, 1, 0],
                     [1, 1, 1, 0, 1]], dtype=bool)
    chunk = np.array([[1, 1, 0],
                      [1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(layout.custom_mask, np.concatenate([tree.ravel(), chunk.ravel()]))
    assert paged_layout(_meta([2], [3], [None], [[2]])).kind == CAUSAL


@pytest.mark.parametrize(("q_lens", "context_lens", "tables", "message"), [
    ([0], [3], [[0]], "at least one"),
    ([2], [1], [[0]], "shorter than its 2 queries"),
    ([1], [9], [[0, 1]], "9 keys need 3"),
])
def test_a_step_flashinfer_cannot_take_is_refused_by_name(q_lens, context_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        paged_layout(_meta(q_lens, context_lens, [None] * len(q_lens), tables, slots=[0] * sum(q_lens)))


def _backend(num_blocks=24, kv_heads=2, layers=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, kv_heads, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    backend = FlashInferPagedAttention(caches, HEAD_DIM ** -0.5, flashinfer_module=fake_flashinfer.module())
    return backend, make_backend("torch", reference_caches, HEAD_DIM ** -0.5)


def _steps(rng: random.Random):
    """The shapes the engine sends: decodes, prompt chunks over a cached prefix, a
    64-node tree (65 queries with its root), and trees beside decodes and a chunk."""
    tables = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [22, 23]]
    yield "decode", _meta([1, 1, 1], [17, 9, 4], [None] * 3, tables)
    yield "chunks", _meta([6, 3], [6, 11], [None, None], tables[:2])
    yield "tree-64", _meta([65], [67], [_tree(rng, 64)], tables[1:2])
    yield "mixed", _meta([5, 1, 3], [13, 30, 7], [_tree(rng, 4), None, None], tables)


@INTERPRETER
@pytest.mark.parametrize("group", [1, TENSOR_CORE_GROUP, 7])
def test_every_step_shape_attends_as_the_torch_reference(group):
    rng = random.Random(group)
    backend, reference = _backend()
    heads = 2 * group
    for name, meta in _steps(rng):
        q_len = meta.query_start_loc[-1]
        outputs = []
        gen = torch.Generator().manual_seed(len(name))
        inputs = [(torch.randn(q_len, heads, HEAD_DIM, generator=gen), torch.randn(q_len, 2, HEAD_DIM, generator=gen),
                   torch.randn(q_len, 2, HEAD_DIM, generator=gen)) for _ in range(2)]
        for b in (backend, reference):
            b.begin_step(meta)
            outputs.append([b(layer, q, k, v) for layer, (q, k, v) in enumerate(inputs)])
        for layer in range(2):
            torch.testing.assert_close(outputs[0][layer], outputs[1][layer], rtol=1e-4, atol=1e-4, msg=name)
    for (k, v), (rk, rv) in zip(backend.kv_caches, reference.kv_caches):
        assert torch.equal(k, rk) and torch.equal(v, rv)  # the same stores
    # One plan a step, shared by both layers; decode on tensor cores from the advised group size.
    assert backend.num_planned == 4
    assert set(backend._decode_wrappers) == {group >= TENSOR_CORE_GROUP}


@INTERPRETER
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_decode_takes_the_kernel_asked_for(tensor_cores):
    backend, _ = _backend()
    backend.decode_tensor_cores = tensor_cores
    backend.begin_step(_meta([1], [5], [None], [[0, 1]]))
    backend(0, torch.randn(1, 2, HEAD_DIM), torch.randn(1, 2, HEAD_DIM), torch.randn(1, 2, HEAD_DIM))
    assert set(backend._decode_wrappers) == {tensor_cores}
    assert backend._decode_wrappers[tensor_cores].kwargs["use_tensor_cores"] is tensor_cores


class _RecordingPrefill:
    """Keeps the arguments of each plan (FlashInfer's own plan would pack the mask)."""

    def __init__(self):
        self.plans = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


def test_a_tree_steps_mask_and_its_index_pointers_are_planned_on_the_cache_device():
    # FlashInfer packs a custom mask on the GPU from the index pointers, so pointers left
    # on the host fail there. The "meta" device stands in for the GPU: no data, a device.
    backend, _ = _backend()
    backend.begin_step(_meta([3, 2], [5, 3], [[-1, 0, 0], None], [[0, 1], [2]]))
    backend._prefill = recorder = _RecordingPrefill()
    backend.device = torch.device("meta")
    backend._planned(num_heads=4)
    (args, kwargs), = recorder.plans
    qo_indptr, kv_indptr, kv_indices, last = args[:4]
    assert kwargs["custom_mask"] is not None and not kwargs["causal"]
    assert {t.device.type for t in (kwargs["custom_mask"], qo_indptr, kv_indptr, kv_indices, last)} == {"meta"}


@INTERPRETER
def test_the_fused_rotary_path_stores_then_attends_over_the_same_plan():
    backend, reference = _backend()
    meta = _meta([1, 1], [17, 9], [None, None], [[0, 1, 2, 3, 4], [5, 6, 7]])
    q, k, v = torch.randn(2, 4, HEAD_DIM), torch.randn(2, 2, HEAD_DIM), torch.randn(2, 2, HEAD_DIM)
    backend.begin_step(meta)
    key_cache, value_cache, slots = backend.store_target(1)
    assert slots.tolist() == [16, 28]
    key_cache.view(-1, 2, HEAD_DIM)[slots] = k
    value_cache.view(-1, 2, HEAD_DIM)[slots] = v
    reference.begin_step(meta)
    torch.testing.assert_close(backend.attend(1, q), reference(1, q, k, v), rtol=1e-4, atol=1e-4)


@INTERPRETER
def test_steps_it_cannot_run_are_refused_before_any_launch():
    backend, _ = _backend(num_blocks=8)
    with pytest.raises(ValueError, match="eagerly"):
        backend.begin_step(_meta([1], [3], [None], [[0]]), StaticShape(bucket=1, max_blocks=1), num_heads=4)
    with pytest.raises(ValueError, match="outside"):
        backend.begin_step(_meta([1], [3], [None], [[8]], slots=[2]))
    with pytest.raises(ValueError, match="slots outside"):
        backend.begin_step(_meta([1], [3], [None], [[0]], slots=[40]))
    with pytest.raises(RuntimeError, match="begin_step"):
        FlashInferPagedAttention(backend.kv_caches, 1.0, flashinfer_module=fake_flashinfer.module()).attend(
            0, torch.randn(1, 4, HEAD_DIM))
    backend.begin_step(_meta([1], [3], [None], [[0]]))
    with pytest.raises(ValueError, match="do not group"):
        backend.attend(0, torch.randn(1, 3, HEAD_DIM))
    for static_call in (backend.build_plan, backend.use_plan, backend.plan_buffers):
        with pytest.raises(NotImplementedError, match="Triton backend"):
            static_call()
    small = [(torch.zeros(4, BLOCK, 2, 8), torch.zeros(4, BLOCK, 2, 8))]
    with pytest.raises(ValueError, match="head dims"):
        FlashInferPagedAttention(small, 1.0, flashinfer_module=fake_flashinfer.module())


def test_it_says_where_it_cannot_run():
    assert "CUDA" in FlashInferPagedAttention.unavailable(torch.device("cpu"), torch.bfloat16)
    assert "float32" in FlashInferPagedAttention.unavailable(torch.device("cuda"), torch.float32)


@INTERPRETER
def test_an_engine_on_flashinfer_speculates_with_trees_and_gives_the_torch_backends_tokens(
        tmp_path, monkeypatch):
    """Prompt chunks, tree verification with its masks, copy-on-write and
    accepted-path moves, end to end through the backend (FlashInfer's stand-in on a
    CPU): greedy tokens equal the torch backend's, and every KV block comes back."""
    from pagedtree import LLM, SamplingParams
    from pagedtree.speculative import SpeculativeConfig
    from tests.conftest import save_tiny_model

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr(FlashInferPagedAttention, "unavailable", classmethod(lambda cls, device, dtype: None))
    # Head dim 64 (FlashInfer's smallest), 4 query heads on one KV head (decode on tensor cores).
    model = save_tiny_model(tmp_path / "target", "llama", seed=5, with_tokenizer=False, hidden_size=256,
                            num_key_value_heads=1)
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 7, 7, 21, 30, 2 + i] * (1 + i)} for i in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("flashinfer", "torch"):
        llm = LLM(str(model.path), dtype="float32", device="cpu", attention_backend=backend, enforce_eager=True,
                  max_num_seqs=4, seed=0, draft_model=[str(model.path)],  # itself: trees accepted deep
                  speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 2)))
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_target_forward_passes"] < 3 * 12 / 2  # most of each tree's path accepted
        if backend == "flashinfer":
            attention = llm.engine.runner.attention
            assert isinstance(attention, FlashInferPagedAttention)
            assert {"causal", "masked"} <= attention.kinds_planned  # prompts, then trees
        llm.shutdown()
    assert tokens["flashinfer"] == tokens["torch"]
