"""TritonPagedAttention behaves as TorchPagedAttention, step by step and in the engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedtree import LLM, SamplingParams  # noqa: E402
from pagedtree.attention.triton_backend import TritonPagedAttention  # noqa: E402
from pagedtree.attention import TorchPagedAttention  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _slots(table, block_size, positions):
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def test_prefill_decode_tree_and_compaction_match_torch_backend():
    """Two layers through a prefill, a mixed decode + tree-verify step, a compaction, a decode."""
    block_size, heads, kv_heads, dim, layers = 4, 4, 2, 16, 2
    gen = torch.Generator().manual_seed(0)
    shape = (12, block_size, kv_heads, dim)
    caches = [(torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)) for _ in range(layers)]
    twin = [(k.clone(), v.clone()) for k, v in caches]
    triton_backend = TritonPagedAttention(caches, dim**-0.5)
    torch_backend = TorchPagedAttention(twin, dim**-0.5)
    tables = [[7, 2, 9], [4, 0, 11]]

    def step(qsl, ctx, parents, slots):
        n = qsl[-1]
        meta = AttentionMetadata(
            block_size=block_size,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
            query_start_loc=qsl, context_lens=ctx, block_tables=tables, tree_parents=parents,
        )
        triton_backend.begin_step(meta)
        torch_backend.begin_step(meta)
        for layer in range(layers):
            q, k, v = (torch.randn(n, h, dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
            got, want = triton_backend(layer, q, k, v), torch_backend(layer, q, k, v)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # Request 0 prefills 5 tokens (crossing a block); request 1 prefills 4 (exactly one block).
    step([0, 5, 9], [5, 4], [None, None], _slots(tables[0], 4, range(5)) + _slots(tables[1], 4, range(4)))
    # Request 0 decodes; request 1 verifies a 5-node tree after its 4-token prefix.
    parents = [-1, 0, 0, 1, 2]
    step([0, 1, 6], [6, 9], [None, parents], _slots(tables[0], 4, [5]) + _slots(tables[1], 4, range(4, 9)))
    # Accept the path 0 -> 2 -> 4: slide nodes 2 and 4 (positions 6, 8) onto positions 5, 6.
    src, dst = _slots(tables[1], 4, [6, 8]), _slots(tables[1], 4, [5, 6])
    triton_backend.copy_slots(src, dst)
    torch_backend.copy_slots(src, dst)
    # Copy-on-write of request 0's last block into a free block.
    triton_backend.copy_blocks([2], [5])
    torch_backend.copy_blocks([2], [5])
    for (k, v), (tk, tv) in zip(caches, twin):
        assert torch.equal(k, tk) and torch.equal(v, tv)
    step([0, 1, 2], [7, 8], [None, None], _slots(tables[0], 4, [6]) + _slots(tables[1], 4, [7]))


def test_attention_before_begin_step_is_an_error():
    backend = TritonPagedAttention([(torch.zeros(2, 4, 1, 16, device=DEVICE),) * 2], 1.0)
    x = torch.zeros(1, 1, 16, device=DEVICE)
    with pytest.raises(RuntimeError, match="begin_step"):
        backend(0, x, x, x)


def _greedy(model_path, prompts, backend, **kwargs):
    llm = LLM(str(model_path), dtype="float32", device=DEVICE.type, attention_backend=backend, **kwargs)
    assert llm.engine.runner.attention.name == backend
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [1, pytest.param(16, marks=pytest.mark.slow)])
def test_engine_greedy_triton_equals_torch(tiny_llama, block_size):
    # Chunked prefill with a small token budget puts prefill chunks and decodes in
    # the same steps, so one launch serves both kinds.
    prompts = random_prompts(3, vocab=256, min_len=3, max_len=40, seed=11)
    kwargs = dict(block_size=block_size, max_num_batched_tokens=24, max_model_len=128)
    expected = _greedy(tiny_llama.path, prompts, "torch", **kwargs)
    assert _greedy(tiny_llama.path, prompts, "triton", **kwargs) == expected


@pytest.mark.slow
def test_tree_speculation_triton_equals_torch(tiny_llama, tmp_path):
    """Tree verification (tree masks, compaction of accepted paths) through the kernels."""
    from pagedtree.speculative import SpeculativeConfig
    from tests.speculative.conftest import save_perturbed_copy

    draft = save_perturbed_copy(tiny_llama, tmp_path / "draft", noise=0.1, seed=11)
    prompts = random_prompts(3, vocab=256, min_len=2, max_len=30, seed=5)
    spec = SpeculativeConfig(tree="static", expansion=(2, 2, 1), max_nodes=8, adaptive=False)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, attention_backend=backend,
                  draft_model=str(draft.path), speculative=spec)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[backend] = ([o.outputs[0].token_ids for o in outs], llm.stats())
    assert runs["triton"][0] == runs["torch"][0]
    stats = runs["triton"][1]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
