"""Which drafts run as one static program (``DraftGraphs.key_for``), and what a
program's shape depends on; the programs themselves against level-by-level drafts:
tests/speculative/drafting/test_whole_drafts.py."""

from __future__ import annotations

import pytest
import torch

from pagedtree.draft_sampling import ChildRule, DraftLevel
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.step_data import BlockCopy, Phase, ScheduledChunk
from pagedtree.worker import draft_graphs
from pagedtree.worker.draft_graphs import MAX_DRAFT_GRAPH_ROWS, MAX_NOISE_ROWS, DraftGraphs

V = 32
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=1)


class _Graphs:
    """Step graphs as the draft graphs see them: a padded shape for up to 128 chunks
    of up to 2 tokens."""

    runner = None
    capture = False

    def padded_shape(self, chunks):
        longest = max(c.num_tokens for c in chunks)
        if len(chunks) > 128 or longest > 2:
            return None
        return 1 << (len(chunks) - 1).bit_length(), longest


def _chunk(request, tokens: int, position: int, fed: bool = False) -> ScheduledChunk:
    return ScheduledChunk(request=request, phase=Phase.DRAFT, token_ids=[1] * tokens,
                          positions=list(range(position - tokens + 1, position + 1)),
                          slot_mapping=list(range(tokens)), block_table=[0, 1], context_len=position + 1,
                          logits_from=tokens - 1, pending_tokens=int(fed))


def _chain(rule: ChildRule, depth: int = 3, requests: int = 2, catch_up: int = 1) -> list[DraftLevel]:
    reqs = [Request(f"r{i}", None, [1, 2, 3], rule.params, sampling_seed=i) for i in range(requests)]
    levels = [DraftLevel([_chunk(r, catch_up, 3) for r in reqs], [rule] * requests, [None] * requests)]
    for d in range(1, depth):
        levels.append(DraftLevel([_chunk(r, 1, 3 + d, fed=True) for r in reqs], [rule] * requests,
                                 [(i, 0) for i in range(requests)]))
    return levels


def _coupled() -> ChildRule:
    return ChildRule(1, "coupled", SEEDED, noise=torch.zeros(V))


def test_greedy_and_coupled_chains_have_a_shape():
    graphs = DraftGraphs(_Graphs())
    key = graphs.key_for(_chain(ChildRule(1, "topk", GREEDY), depth=3, requests=3, catch_up=2))
    assert [k.shape for k in key] == [(4, 2), (4, 1), (4, 1)]
    assert key[0].groups == ((("topk", 1), (0, 1, 2)),) and key[0].feeds == ()
    assert key[1].feeds == ((0, 0, 0), (1, 1, 0), (2, 2, 0)) and key[1].offsets == (0, 0, 0)
    coupled = graphs.key_for(_chain(_coupled()))
    assert coupled[1].groups[0][0] == ("coupled", 1, 0.8, SEEDED.top_k, SEEDED.top_p, SEEDED.min_p)
    # The same draft shape again: the same key (one graph serves both).
    assert graphs.key_for(_chain(_coupled())) == coupled


def test_copies_after_the_first_level_are_part_of_the_shape():
    graphs = DraftGraphs(_Graphs())
    levels = _chain(ChildRule(1, "topk", GREEDY))
    levels[0].copies = [BlockCopy(3, 4)]  # run before the program
    levels[2].copies = [BlockCopy(5, 6), BlockCopy(7, 8)]
    assert [k.copies for k in graphs.key_for(levels)] == [0, 0, 2]


def test_drafts_the_program_cannot_hold_go_level_by_level():
    graphs = DraftGraphs(_Graphs())
    generator = torch.Generator().manual_seed(0)
    # a request's own random stream
    assert graphs.key_for(_chain(ChildRule(2, "without_replacement", SamplingParams(temperature=1.0),
                                           generator=generator))) is None
    # a catch-up longer than the padded shapes
    assert graphs.key_for(_chain(ChildRule(1, "topk", GREEDY), catch_up=3)) is None
    # a level wider than the graphs take
    assert graphs.key_for(_chain(ChildRule(1, "topk", GREEDY), requests=MAX_DRAFT_GRAPH_ROWS + 1)) is None
    # more coupled rows than the noise buffer holds
    assert graphs.key_for(_chain(_coupled(), depth=MAX_NOISE_ROWS // 2 + 1)) is None
    assert graphs.key_for(_chain(_coupled(), depth=MAX_NOISE_ROWS // 2)) is not None
    assert graphs.key_for([]) is None


def test_a_first_level_that_takes_fed_tokens_is_refused():
    levels = _chain(ChildRule(1, "topk", GREEDY))
    levels[0].feeds = [(0, 0), None]
    with pytest.raises(ValueError, match="first level"):
        DraftGraphs(_Graphs()).key_for(levels)


def test_past_the_graph_limit_new_shapes_go_level_by_level(monkeypatch):
    monkeypatch.setattr(draft_graphs, "MAX_DRAFT_GRAPHS", 0)
    graphs = DraftGraphs(_Graphs())
    assert graphs.queue(_chain(ChildRule(1, "topk", GREEDY))) is None
    assert graphs.num_drafts == 0


def test_after_failed_captures_no_new_shape_is_tried(monkeypatch):
    graphs = DraftGraphs(_Graphs())
    graphs.capture = True
    graphs._refused = {("shape", i) for i in range(draft_graphs.MAX_FAILED_CAPTURES)}
    assert graphs.queue(_chain(ChildRule(1, "topk", GREEDY))) is None
    assert graphs.num_drafts == 0
