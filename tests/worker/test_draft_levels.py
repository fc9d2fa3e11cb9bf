"""A whole draft's levels on the worker (``run_draft_levels``): each level takes its
input tokens from the children the level before drew, on the device; every level's
children come back in one readback; a node that asks for a child its parent did not
draw is refused before anything runs on it."""

from __future__ import annotations

import pytest
import torch

from pagedtree.draft_sampling import ChildRule, DraftLevel
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.step_data import Phase, ScheduledChunk
from pagedtree.worker.draft_levels import run_draft_levels
from pagedtree.worker.step_inputs import host_step

V = 16
GREEDY = SamplingParams(temperature=0.0)


class _EchoRunner:
    """A draft stand-in whose logits at a row prefer the token ``(input + 1) % V``,
    then ``(input + 2) % V``: the input each row received shows in its children."""

    device = torch.device("cpu")

    def __init__(self):
        self.inputs: list[list[int]] = []

    def copy_blocks(self, src, dst):
        pass

    def forward(self, chunks, rows, feed=None):
        step = host_step(chunks, rows)
        ids = torch.tensor(step.input_ids)
        if feed is not None:
            feed.apply(ids, step.query_starts)
        self.inputs.append(ids.tolist())
        picked = ids[torch.tensor(rows)]
        logits = torch.zeros(len(rows), V)
        logits[torch.arange(len(rows)), (picked + 1) % V] = 2.0
        logits[torch.arange(len(rows)), (picked + 2) % V] = 1.0
        return logits


def _chunk(request, token: int | None, position: int) -> ScheduledChunk:
    return ScheduledChunk(request=request, phase=Phase.DRAFT, token_ids=[0 if token is None else token],
                          positions=[position], slot_mapping=[position], block_table=[0, 1], context_len=position + 1,
                          logits_from=0, pending_tokens=1 if token is None else 0)


@pytest.fixture
def request_():
    return Request("r", None, [1, 2, 3], GREEDY, sampling_seed=0)


def test_each_level_takes_the_children_drawn_before_it(request_):
    root = _chunk(request_, 5, 3)
    levels = [
        DraftLevel([root], [ChildRule(2, "topk", GREEDY)], [None]),
        # the root's two children (6 then 7) fed, each drawing one child
        DraftLevel([_chunk(request_, None, 4), _chunk(request_, None, 4)],
                   [ChildRule(1, "topk", GREEDY), ChildRule(1, "topk", GREEDY)], [(0, 0), (0, 1)]),
        # the second child's child (7 + 1 = 8) fed, drawing none
        DraftLevel([_chunk(request_, None, 5)], [None], [(1, 0)]),
    ]
    runner = _EchoRunner()
    run = run_draft_levels(runner, levels)
    assert runner.inputs == [[5], [6, 7], [8]]
    assert [[c.tokens if c else None for c in level] for level in run.children] == [[[6, 7]], [[7], [8]], [None]]
    assert [tokens for tokens, _ in run.forwards] == [1, 2, 1]


def test_a_child_its_parent_did_not_draw_is_refused(request_):
    levels = [DraftLevel([_chunk(request_, 5, 3)], [ChildRule(1, "topk", GREEDY)], [None]),
              DraftLevel([_chunk(request_, None, 4)], [None], [(0, 1)])]
    runner = _EchoRunner()
    with pytest.raises(ValueError, match="takes child 1 of a node that drew 1"):
        run_draft_levels(runner, levels)
    assert runner.inputs == [[5]]  # refused before the level ran
