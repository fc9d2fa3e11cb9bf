"""The step runner: a plan to its result, through whatever ``Speculation`` it holds.

Plain decoding (``NoSpeculation``) commits each plain chunk's draw and verifies
nothing; a request whose forward raises fails alone while the others commit; a
speculation is asked to stage and accept only when a chunk carries a tree; and a
paused runner decodes plainly until the pause ends, however it ends.
"""

from __future__ import annotations

import pytest
import torch

from pagedtree.engine.step_runner import StepRunner
from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.speculative.speculation import NoSpeculation
from pagedtree.speculative.tree import TokenTree
from pagedtree.step_data import Phase, ScheduledChunk, StepPlan, Verified
from pagedtree.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_runner(tiny_llama):
    return ModelRunner(load_model(tiny_llama.path).model, 32, 4, torch.device("cpu"), torch.float32, "torch"), \
        tiny_llama.hf_model


def _prefill(bm: BlockManager, request: Request) -> ScheduledChunk:
    """The whole prompt as one chunk that draws the next token."""
    rid, n = request.request_id, request.num_tokens
    bm.allocate(rid, request.all_token_ids)
    return ScheduledChunk(request, Phase.PREFILL, request.all_token_ids, list(range(n)), bm.slots(rid, 0, n),
                          bm.block_table(rid), n, n - 1)


def _draft(bm: BlockManager, request: Request, budget: int) -> ScheduledChunk:
    """The request's newest token as a DRAFT chunk with ``budget`` tree slots after it
    (what the scheduler sends a decoding request that may speculate)."""
    rid, n = request.request_id, request.num_tokens
    bm.allocate(rid, request.all_token_ids)
    bm.append_slots(rid, budget)
    return ScheduledChunk(request, Phase.DRAFT, request.all_token_ids[-1:], [n - 1], bm.slots(rid, n - 1, n),
                          bm.block_table(rid), n, 0, tree_budget=budget, tree_slots=bm.slots(rid, n, n + budget))


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, None, prompt, SamplingParams(temperature=0.0), sampling_seed=0)


def _argmax_next(hf, prompt: list[int]) -> int:
    with torch.no_grad():
        return int(hf(torch.tensor([prompt])).logits[0, -1].argmax())


def test_plain_steps_commit_each_draw_and_verify_nothing(model_runner):
    runner, hf = model_runner
    step_runner = StepRunner(runner)
    assert isinstance(step_runner.speculation, NoSpeculation)
    bm = BlockManager(32, 4)
    prompts = {"a": [5, 9, 13, 2, 7], "b": [40, 41]}
    plan = StepPlan([_prefill(bm, _request(rid, p)) for rid, p in prompts.items()])
    result = step_runner.execute(plan)
    assert {rid: [t for t, _, _ in c] for rid, c in result.committed.items()} == \
        {rid: [_argmax_next(hf, p)] for rid, p in prompts.items()}
    assert not result.accepted and not result.failed and not result.slot_moves and result.num_tree_nodes == 0
    assert result.forward_seconds > 0 and result.draft_seconds == 0.0


def test_a_request_whose_forward_raises_fails_alone(model_runner):
    runner, hf = model_runner
    bm = BlockManager(32, 4)
    good, bad = _request("good", [5, 9, 13]), _request("bad", [7, 8])
    chunks = [_prefill(bm, good), _prefill(bm, bad)]
    chunks[1].block_table = [10_000]  # a block the cache does not have
    result = StepRunner(runner).execute(StepPlan(chunks))
    assert [r.request_id for r, _ in result.failed] == ["bad"]
    assert [t for t, _, _ in result.committed["good"]] == [_argmax_next(hf, [5, 9, 13])]
    assert "bad" not in result.committed


class _RecordingSpeculation(NoSpeculation):
    """Proposes a one-node tree for every DRAFT chunk and records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def propose(self, plan: StepPlan) -> dict[str, TokenTree]:
        self.calls.append("propose")
        return {c.request.request_id: TokenTree(c.token_ids[0], [3], [-1], [1])
                for c in plan.chunks if c.phase == Phase.DRAFT}

    def stage(self, chunks, trees, verify_logits):
        self.calls.append("stage")
        assert all(c.phase == Phase.VERIFY and c.num_tokens == 2 for c in chunks)
        assert all(verify_logits[c.request.request_id].shape[0] == 2 for c in chunks)  # root + one node
        return {}, []

    def accept(self, chunks, trees, verified_rows):
        self.calls.append("accept")
        return Verified(committed={c.request.request_id: [(11, 0.0, None)] for c in chunks},
                        accepted={c.request.request_id: 0 for c in chunks})


def test_a_speculation_stages_and_accepts_only_steps_with_trees(model_runner):
    runner, _ = model_runner
    speculation = _RecordingSpeculation()
    step_runner = StepRunner(runner, speculation)
    bm = BlockManager(32, 4)
    step_runner.execute(StepPlan([_prefill(bm, _request("p", [5, 9]))]))
    assert speculation.calls == ["propose"]
    speculation.calls.clear()
    result = step_runner.execute(StepPlan([_draft(bm, _request("d", [5, 9, 4]), budget=2)]))
    assert speculation.calls == ["propose", "stage", "accept"]
    assert result.committed["d"] == [(11, 0.0, None)] and result.accepted == {"d": 0}
    assert result.num_tree_nodes == 1


def test_a_paused_runner_decodes_plainly_until_the_pause_ends(model_runner):
    runner, _ = model_runner
    speculation = _RecordingSpeculation()
    step_runner = StepRunner(runner, speculation)
    with step_runner.speculation_paused():
        assert isinstance(step_runner.speculation, NoSpeculation)
        step_runner.execute(StepPlan([_prefill(BlockManager(32, 4), _request("x", [5, 9]))]))
    assert step_runner.speculation is speculation and speculation.calls == []
    with pytest.raises(RuntimeError), step_runner.speculation_paused():
        raise RuntimeError("a failing warm-up")
    assert step_runner.speculation is speculation
