"""Tree speculation through padded static steps (what CUDA graphs replay), on a CPU:
every decode and verify step of the target and every draft level padded to a shape
of ``worker/cuda_graphs.py``, run eagerly from the shape's static buffers."""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.executor.shards import DRAFT_GRAPH_TOKENS
from pagedtree.speculative import SpeculativeConfig


# Every step runs the Triton kernels in the interpreter, so the default suite runs the
# smallest case that still takes three padded target steps and three padded draft
# levels (two prompts, 8 tokens); -m slow runs three prompts of 10 tokens.
@pytest.mark.parametrize("num_prompts,max_tokens", [
    pytest.param(2, 8, id="2-prompts-8-tokens"),
    pytest.param(3, 10, id="3-prompts-10-tokens", marks=pytest.mark.slow),
])
def test_speculative_greedy_through_padded_static_steps_is_unchanged(tiny_llama, tiny_llama_draft, num_prompts,
                                                                     max_tokens):
    """Tree speculation with every decode and verify step of the target (and every
    draft level) padded to a static shape: the same tokens as eager steps."""
    prompts = [{"prompt_token_ids": [3 + i, 17, 5 * i + 1, 40, 2][: 2 + i]} for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(static: bool):
        llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", attention_backend="triton",
                  enforce_eager=True, max_num_seqs=4, block_size=4, draft_model=[str(tiny_llama_draft.path)],
                  speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 2)))
        engine = llm.engine
        if static:
            engine.runner.enable_cuda_graphs(4, engine.max_model_len, 7, capture=False)
            for draft in engine.speculation.drafts:
                draft.runner.enable_cuda_graphs(16, engine.max_model_len, DRAFT_GRAPH_TOKENS, capture=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_draft_tokens"] > 0
        return [o.outputs[0].token_ids for o in outs], engine

    eager, _ = run(False)
    static, engine = run(True)
    assert static == eager
    draft = engine.speculation.drafts[0]
    assert engine.runner.graphs.num_steps >= 3 and draft.runner.graphs.num_steps >= 3
    # Every draft forward but the prompts' runs padded: the catch-ups of one or two
    # tokens take the graphs' shapes too.
    assert draft.runner.graphs.num_steps >= draft.runner.num_forward_passes - num_prompts
