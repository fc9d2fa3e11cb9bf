"""``draft_min_prob``: a branch of a draft tree ends below a token the draft was unsure
of. The unsure token is still proposed; nothing is drafted below it. The builders'
rule, then the engine: the same tokens as plain decoding, fewer draft forwards,
whole drafts grow what level by level grows, and no KV block left behind."""

from __future__ import annotations

import math

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.builders import DynamicTreeBuilder, ShapeTreeBuilder
from pagedtree.speculative.tree import ROOT, TreeShape
from tests.conftest import random_prompts
from tests.speculative.drafting.test_whole_drafts import _run as run_drafts


def _logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


def test_a_chain_stops_below_an_unsure_token_and_keeps_it():
    greedy = SamplingParams(temperature=0)
    builder = ShapeTreeBuilder(TreeShape.chain(4), 0, greedy, "topk", None, min_prob=0.5)
    fed = builder.expand_level([(ROOT, _logits([0.1, 0.8, 0.1]))])  # sure of token 1
    assert builder.tree.tokens == [1] and fed == [0]
    fed = builder.expand_level([(0, _logits([0.4, 0.3, 0.3]))])  # unsure of token 0
    assert builder.tree.tokens == [1, 0] and fed == []  # proposed, not drafted below
    assert builder.finish().parents == [ROOT, 0]
    # Without the threshold the same draws go on to the chain's depth.
    builder = ShapeTreeBuilder(TreeShape.chain(4), 0, greedy, "topk", None)
    builder.expand_level([(ROOT, _logits([0.1, 0.8, 0.1]))])
    assert builder.expand_level([(0, _logits([0.4, 0.3, 0.3]))]) == [1]


def test_a_static_tree_grows_only_below_its_sure_children():
    builder = ShapeTreeBuilder(TreeShape.from_expansion((2, 1), 10), 0, SamplingParams(temperature=0), "topk",
                               None, min_prob=0.3)
    fed = builder.expand_level([(ROOT, _logits([0.6, 0.25, 0.15]))])
    assert builder.tree.tokens == [0, 1] and fed == [0]  # token 1 (0.25) is kept as a leaf


def test_a_dynamic_tree_expands_only_sure_frontier_nodes():
    builder = DynamicTreeBuilder(2, 3, 8, 0, SamplingParams(temperature=0), min_prob=0.3)
    fed = builder.expand_level([(ROOT, _logits([0.5, 0.2, 0.2, 0.1]))])
    assert builder.tree.tokens == [0, 1] and fed == [0]
    assert builder.expand_level([(0, _logits([0.1, 0.1, 0.1, 0.7]))]) == [2]


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "0.5", float("nan")])
def test_draft_min_prob_is_validated(value):
    with pytest.raises(ValueError, match="draft_min_prob"):
        SpeculativeConfig(draft_min_prob=value)


def test_the_engine_drafts_less_where_unsure_and_keeps_its_outputs(tiny_llama, tiny_llama_draft):
    """Greedy and seeded sampling: the tokens of plain decoding (greedy) and of the
    run without the threshold (seeded: the target's draws decide), fewer draft
    forwards and draft tokens, and whole drafts grow the same trees as level by
    level."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 256, 3, 8, seed=11)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    chain = SpeculativeConfig(tree="chain", depth=4, max_nodes=4, adaptive=False)
    # A threshold between the tiny draft's usual top probabilities, so that some
    # branches stop and others go on.
    unsure = SpeculativeConfig(tree="chain", depth=4, max_nodes=4, adaptive=False, draft_min_prob=0.02)
    plain_llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, max_num_seqs=4, seed=3)
    plain = [[c.token_ids for c in o.outputs] for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    full, full_stats, _, _ = run_drafts(tiny_llama, tiny_llama_draft, False, params, prompts, speculative=chain)
    cut, cut_stats, _, cut_trees = run_drafts(tiny_llama, tiny_llama_draft, False, params, prompts,
                                              speculative=unsure)
    assert cut[0] == full[0] == plain[0] and cut[2] == full[2] == plain[2]
    assert cut[1] == full[1]  # seeded: the coupled draws give the same tokens whatever is drafted
    assert 0 < cut_stats["num_draft_forward_passes"] < full_stats["num_draft_forward_passes"]
    assert 0 < cut_stats["num_draft_tokens"] < full_stats["num_draft_tokens"]
    depths = {len(tokens) for step in cut_trees for _, tokens, _ in step}
    assert 1 in depths and max(depths) > 1  # some chains stopped at once, some went on
    whole, whole_stats, whole_jobs, whole_trees = run_drafts(tiny_llama, tiny_llama_draft, True, params, prompts,
                                                             speculative=unsure)
    assert whole_jobs  # the whole path ran
    assert whole == cut and whole_trees == cut_trees
    assert whole_stats["num_accepted_tokens"] == cut_stats["num_accepted_tokens"]
