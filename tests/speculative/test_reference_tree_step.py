"""Every greedy tree step the engine takes commits what the oracle commits.

``reference_tree_step`` verifies a tree with the model alone (one request, no
paging, no batching); here every tree the engine verifies, of every kind, in a
batch, over small paged blocks, is checked against it, step by step.
"""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.speculator import Speculator
from tests.conftest import random_prompts
from tests.speculative.reference import reference_tree_step

TREES = {
    "static": SpeculativeConfig(tree="static", expansion=(2, 2, 1), max_nodes=8, adaptive=False),
    "chain": SpeculativeConfig(tree="chain", depth=3, adaptive=False),
    "dynamic": SpeculativeConfig(tree="dynamic", top_k=3, depth=3, max_nodes=8, adaptive=False),
}


@pytest.mark.parametrize("tree", sorted(TREES))
def test_each_greedy_tree_step_commits_the_oracles_tokens(tiny_llama, tiny_llama_draft, monkeypatch, tree):
    steps = []
    accept = Speculator.accept

    def recording_accept(self, chunks, trees, verified_rows):
        verified = accept(self, chunks, trees, verified_rows)
        for chunk in chunks:
            rid = chunk.request.request_id
            if rid in verified.committed:
                t = trees[rid]
                steps.append((chunk.request.all_token_ids, list(t.tokens), list(t.parents),
                              [token for token, _, _ in verified.committed[rid]]))
        return verified

    monkeypatch.setattr(Speculator, "accept", recording_accept)
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=4,
              draft_model=str(tiny_llama_draft.path), speculative=TREES[tree])
    prompts = random_prompts(4, 256, 3, 20, seed=11)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(steps) >= 8 and any(len(committed) > 1 for *_, committed in steps)
    for prefix, tokens, parents, committed in steps:
        assert committed == reference_tree_step(tiny_llama.hf_model, prefix, tokens, parents)
