"""Greedy outputs on real pretrained weights equal transformers, token for token."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.loading import packaged_models as pm
from tests.conftest import assert_no_leaks

PROMPTS = [
    "def fibonacci(n):",
    "Write a haiku about paged memory.",
    "The capital of France is",
]


def _check(model: pm.PackagedModel, new_tokens: int, prompts=PROMPTS) -> None:
    if not pm.is_installed(model):
        pytest.skip(f"{model.name} not installed: {pm.install_command(model)}")
    from transformers import AutoModelForCausalLM

    folder = pm.converted_folder(model)
    llm = LLM(model.name, dtype="float32", max_model_len=512, kv_cache_memory=256 * 2**20)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours = llm.generate(prompts, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, ours):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert_no_leaks(llm)


# The default suite compares 10 tokens a prompt (the load and the reference's
# uncached loop are the cost); -m slow compares 24.
@pytest.mark.parametrize("new_tokens", [10, pytest.param(24, marks=pytest.mark.slow)])
def test_smollm2_135m_matches_transformers(new_tokens):
    _check(pm.SMOLLM2_135M, new_tokens=new_tokens)


@pytest.mark.slow
def test_qwen_coder_0_5b_matches_transformers():
    _check(pm.QWEN_CODER_0_5B, new_tokens=16)


@pytest.mark.slow
def test_qwen_coder_1_5b_matches_transformers():
    _check(pm.QWEN_CODER_1_5B, new_tokens=16, prompts=PROMPTS[:2])


@pytest.mark.slow
def test_qwen_pair_tree_speculation_equals_plain_decoding():
    """The real 1.5B target with the 0.5B draft: every tree kind gives the plain tokens."""
    from pagedtree.speculative import SpeculativeConfig

    llm = LLM(pm.QWEN_CODER_1_5B.name, dtype="float32", draft_model=pm.QWEN_CODER_0_5B.name, max_model_len=512,
              speculative=SpeculativeConfig(tree="static", max_nodes=16, adaptive=False))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.engine.set_speculation(False)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.set_speculation(True)
    for spec in (
        SpeculativeConfig(tree="static", max_nodes=16, adaptive=False),
        SpeculativeConfig(tree="chain", depth=5, max_nodes=5, adaptive=False),
        SpeculativeConfig(tree="dynamic", top_k=4, depth=6, max_nodes=16, adaptive=False),
        SpeculativeConfig(tree="sequoia", depth=6, max_nodes=12, adaptive=False),
    ):
        llm.engine.speculation.reconfigure(spec)
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert outs == plain, spec.tree
    stats = llm.stats()
    assert stats["mean_acceptance_length"] > 2.0
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]
    assert_no_leaks(llm)
