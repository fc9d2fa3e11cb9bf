"""Seeded sampling requests give the same tokens whatever happens around them.

A seeded request draws every token by Gumbel-max with noise keyed by its seed and
the output position, and speculation verifies with the same noise (coupled
verification). So its tokens are those of plain decoding with that seed: alone, in
a batch with other requests, as child 0 of ``n=2``, under preemption, and with any
tree (static, chain, dynamic, Sequoia with measured rates, the adaptive budget, two
drafts), sizes shrinking under cache pressure included.
"""

from __future__ import annotations

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.step_data import Phase
from tests.conftest import assert_no_leaks, random_prompts

MAX_TOKENS = 24
SEEDS = [11, 12, 13, 14, 15, 16]
TREES = {
    "static": SpeculativeConfig(tree="static", expansion=(2, 2, 1, 1), max_nodes=8, adaptive=False),
    "chain": SpeculativeConfig(tree="chain", depth=4, adaptive=False),
    "dynamic": SpeculativeConfig(tree="dynamic", top_k=3, depth=4, max_nodes=8, adaptive=False),
    "sequoia-measured": SpeculativeConfig(tree="sequoia", depth=4, max_nodes=8, adaptive=False),
    "adaptive": SpeculativeConfig(tree="static", expansion=(2, 2, 1, 1), max_nodes=8, adaptive=True),
}


def _params(seed: int | None, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, seed=seed, n=n, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(SEEDS), 256, 3, 30, seed=21)


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama, prompts):
    """What plain decoding draws for each (prompt, seed), one request at a time."""
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu")
    return [
        llm.generate([{"prompt_token_ids": p}], _params(s), use_tqdm=False)[0].outputs[0].token_ids
        for p, s in zip(prompts, SEEDS)
    ]


def _batch(llm: LLM, prompts, with_neighbours: bool) -> list[list[int]]:
    """The seeded requests' tokens, optionally between unseeded and greedy neighbours."""
    items = [({"prompt_token_ids": p}, _params(s)) for p, s in zip(prompts, SEEDS)]
    if with_neighbours:
        extra = [({"prompt_token_ids": p[::-1]}, _params(None)) for p in prompts]
        extra += [({"prompt_token_ids": p[:5]}, SamplingParams(temperature=0, max_tokens=9)) for p in prompts]
        items = [x for pair in zip(items, extra[: len(items)], extra[len(items):]) for x in pair]
    outs = llm.generate([i[0] for i in items], [i[1] for i in items], use_tqdm=False)
    seeded = [o for o, (_, sp) in zip(outs, items) if sp.seed is not None]
    return [o.outputs[0].token_ids for o in seeded]


def test_plain_seeded_sampling_is_batch_independent(tiny_llama, prompts, plain_tokens):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", max_num_seqs=4)
    assert _batch(llm, prompts, with_neighbours=True) == plain_tokens
    # Different seeds draw different continuations (the noise really is per seed).
    assert len({tuple(t) for t in plain_tokens}) == len(plain_tokens)


@pytest.mark.parametrize("tree", sorted(TREES))
def test_seeded_requests_repeat_with_speculation(tiny_llama, tiny_llama_draft, prompts, plain_tokens, tree):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=str(tiny_llama_draft.path), speculative=TREES[tree])
    alone = [
        llm.generate([{"prompt_token_ids": p}], _params(s), use_tqdm=False)[0].outputs[0].token_ids
        for p, s in zip(prompts, SEEDS)
    ]
    assert alone == plain_tokens
    assert _batch(llm, prompts, with_neighbours=True) == plain_tokens
    # n=2: child i uses seed + i, so child 0 is the request alone with that seed.
    out = llm.generate([{"prompt_token_ids": prompts[0]}], _params(SEEDS[0], n=2), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain_tokens[0]
    stats = llm.stats()
    if tree != "adaptive":  # (adaptive rightly turns speculation off on models this small)
        assert stats["num_accepted_tokens"] > 0, "nothing accepted: the test would not see coupling bugs"
    assert_no_leaks(llm)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_seeded_requests_repeat_under_preemption_and_shrinking_trees(
    tiny_llama, tiny_llama_draft, prompts, plain_tokens, tree
):
    """A cache this small preempts requests and shrinks their trees: same tokens."""
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=22, max_num_seqs=6,
        draft_model=str(tiny_llama_draft.path), num_draft_kv_blocks=40, speculative=TREES[tree],
    )
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    shrunk = []

    def spy(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        for chunk in plan.chunks:
            if chunk.phase == Phase.DRAFT:
                room = min(8, MAX_TOKENS - len(chunk.request.output_token_ids) - 1)
                shrunk.append(chunk.tree_budget < room)  # fewer slots than asked: blocks were short
        return plan

    scheduler.schedule = spy
    assert _batch(llm, prompts, with_neighbours=False) == plain_tokens
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert any(shrunk)
    assert stats["num_accepted_tokens"] > 0
    assert_no_leaks(llm)


def test_seeded_requests_repeat_with_two_drafts(tiny_llama, tiny_llama_draft, tiny_llama_draft2, prompts, plain_tokens):
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", draft_model=[str(tiny_llama_draft.path), str(tiny_llama_draft2.path)],
        speculative=TREES["static"],
    )
    assert _batch(llm, prompts, with_neighbours=True) == plain_tokens
    assert llm.stats()["num_accepted_tokens"] > 0
    assert_no_leaks(llm)
