"""The fused, batch-invariant GPU forward (``worker/models/gpu_fused.py``), run with the
Triton kernels in the interpreter on CPU tensors: the tokens of the eager forward and
of transformers (tree speculation on it: tests/speculative/test_gpu_fused_speculation.py)."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.worker.models.gpu_fused import FusedGpuForward, supports
from tests.conftest import fused_gpu_llm, hf_greedy

pytestmark = pytest.mark.triton_interpreter


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2"])
def test_fused_forward_gives_transformers_greedy_tokens(fixture, request, monkeypatch):
    """fp32, a Llama and a Qwen2 (q/k/v biases, tied head): prefill, then decodes, then
    static padded steps (what CUDA graphs replay) give transformers' tokens."""
    model = request.getfixturevalue(fixture)
    prompts = [[3, 17, 5, 40, 2, 9], [7, 8]]
    want = [hf_greedy(model.hf_model, p, 6) for p in prompts]
    llm = fused_gpu_llm(model, "float32", monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == want
    engine = llm.engine
    engine.runner.enable_cuda_graphs(4, engine.max_model_len, 1, capture=False)
    static = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
    assert static == want and engine.runner.graphs.num_steps >= 5


@pytest.mark.parametrize("epilogue", [True, False], ids=["rotary-in-qkv-epilogue", "rotary-kernel"])
def test_fused_hidden_states_match_the_eager_forward(tiny_qwen2, monkeypatch, epilogue):
    """The fused forward's hidden states are the eager forward's within fp32 rounding
    (the products sum in another order; everything else rounds as eager does), with
    the rotation in the q/k/v product's epilogue and, as for head dims it cannot
    take, in a launch of its own."""
    from pagedtree.attention.torch_backend import TorchPagedAttention
    from pagedtree.kernels import dense_ops
    from pagedtree.loading.loader import load_model
    from pagedtree.step_data import AttentionMetadata

    if not epilogue:
        monkeypatch.setattr(dense_ops, "rotates_in_epilogue", lambda head_dim: False)
    model = load_model(tiny_qwen2.path, pack_weights=False).model
    n = 7
    caches = [(torch.zeros(4, 4, model.num_kv_heads, model.head_dim), torch.zeros(4, 4, model.num_kv_heads,
                                                                                  model.head_dim))
              for _ in range(model.num_layers)]
    meta = AttentionMetadata(block_size=4, slot_mapping=torch.arange(n), query_start_loc=[0, n], context_lens=[n],
                             block_tables=[[0, 1]], tree_parents=[None], slot_bounds=(0, n - 1))
    ids, positions = torch.tensor([5, 9, 33, 2, 71, 100, 4]), torch.arange(n)
    attention = TorchPagedAttention(caches, model.head_dim ** -0.5)
    attention.begin_step(meta)
    eager = model(ids, positions, attention)
    fused = FusedGpuForward(model)
    assert fused.layers[0].rotates == epilogue
    assert (fused.layers[0].qkv.config.block_n == model.head_dim) == epilogue
    attention.begin_step(meta)  # the torch backend stores keys and values itself
    torch.testing.assert_close(fused.forward(ids, positions, attention), eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused.logits(eager), model.lm_head(eager), rtol=1e-4, atol=1e-4)


def test_models_the_kernels_cannot_run_are_named(tiny_llama):
    from pagedtree.loading.loader import load_model

    model = load_model(tiny_llama.path, pack_weights=False).model
    assert supports(model) is None
    model.config.hidden_act = "gelu"
    assert "gelu" in supports(model)
    with pytest.raises(ValueError, match="gelu"):
        FusedGpuForward(model)

