"""Where a draft goes: drafting a whole tree, the draft worker leaves the speculation
package twice, once for the block manager (every node's sequence and slot reserved)
and once for the worker (every level run and read back); drafting level by level it
goes back and forth between them on every level."""

from __future__ import annotations

import sys

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.proposer import TreeProposer

BELOW = ("scheduler", "worker")  # the rooms below speculation that hold state: blocks, the model


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pagedtree" else None


def _walks(llm: LLM, params: SamplingParams, prompts) -> list[list[str]]:
    """Per ``propose``, the rooms below speculation its code calls into, in order,
    consecutive calls into one room counted as one visit."""
    proposer = llm.engine.speculation.proposer
    walks: list[list[str]] = []

    def walked(requests_and_budgets):
        visits: list[str] = []

        def profile(frame, event, arg):
            if event != "call" or frame.f_back is None:
                return
            callee = _room(frame.f_globals.get("__name__", ""))
            caller = _room(frame.f_back.f_globals.get("__name__", ""))
            if caller == "speculative" and callee in BELOW and (not visits or visits[-1] != callee):
                visits.append(callee)

        sys.setprofile(profile)
        try:
            return TreeProposer.propose(proposer, requests_and_budgets)
        finally:
            sys.setprofile(None)
            walks.append(visits)

    proposer.propose = walked
    llm.generate(prompts, params, use_tqdm=False)
    return [w for w in walks if w]


@pytest.mark.parametrize("tree", [SpeculativeConfig(tree="chain", depth=3, max_nodes=3, adaptive=False),
                                  SpeculativeConfig(tree="static", expansion=(2, 2, 1), max_nodes=10,
                                                    adaptive=False)],
                         ids=["chain", "tree"])
def test_a_whole_draft_visits_the_block_manager_once_and_the_worker_once(tiny_llama, tiny_llama_draft, tree):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, seed=3,
              draft_model=[str(tiny_llama_draft.path)], speculative=tree)
    prompts = [{"prompt_token_ids": [5, 17, 33, 9, 41]}, {"prompt_token_ids": [7, 8, 9]}]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)]
    worker = llm.engine.speculation.drafts[0]
    assert worker.whole_drafts
    walks = _walks(llm, params, prompts)
    assert walks and all(w == ["scheduler", "worker"] for w in walks), walks

    worker.whole_drafts = False  # level by level: blocks, a forward, blocks, a forward, ...
    walks = _walks(llm, params, prompts)
    assert walks and max(len(w) for w in walks) >= 5, walks
