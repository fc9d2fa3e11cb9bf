"""Greedy tree speculation equals plain decoding in bf16 when both engines run the
fused, batch-invariant GPU forward (what every CUDA engine does), with the Triton
kernels in the interpreter on CPU tensors."""

from __future__ import annotations

import pytest

from pagedtree import SamplingParams
from pagedtree.speculative import SpeculativeConfig
from tests.conftest import fused_gpu_llm

pytestmark = pytest.mark.triton_interpreter


def test_bf16_tree_speculation_equals_plain_decoding(tiny_llama, tiny_llama_draft, monkeypatch):
    """bf16, both engines on the fused forward (as on a GPU): greedy tree speculation
    gives plain decoding's tokens, tree rows and one-token rows rounding alike."""
    prompts = [{"prompt_token_ids": [3, 17, 5, 40]}, {"prompt_token_ids": [9, 2, 11]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = fused_gpu_llm(tiny_llama, "bfloat16", monkeypatch)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = fused_gpu_llm(tiny_llama, "bfloat16", monkeypatch, draft_model=[str(tiny_llama_draft.path)],
                speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 2)))
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
