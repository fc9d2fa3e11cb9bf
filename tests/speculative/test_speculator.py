"""The speculator on its own: propose -> (target logits) -> stage -> accept -> observe,
with a real draft worker and scheduler and hand-made target logits."""

from __future__ import annotations

import torch

from pagedtree.loading.loader import load_model
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import Phase, SlotMove, StepResult
from pagedtree.worker.step_output import StepOutput
from pagedtree.config import SchedulerConfig
from pagedtree.scheduler.scheduler import Scheduler
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.draft_worker import DraftWorker
from pagedtree.speculative.speculator import Speculator
from pagedtree.worker.model_runner import ModelRunner

VOCAB = 256


def _setup(draft_path, **spec):
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                          BlockManager(32, 4))
    loaded = load_model(draft_path)
    bm = BlockManager(64, 4)
    draft = DraftWorker(ModelRunner(loaded.model, 64, 4, torch.device("cpu"), torch.float32, "torch"), bm)
    config = SpeculativeConfig(adaptive=False, **spec)
    speculator = Speculator(config, [draft], VOCAB)
    scheduler.budget_policy = speculator.budget
    return scheduler, speculator


def _decoding_request(scheduler: Scheduler) -> Request:
    r = Request("r", None, [5, 9, 13, 2, 7], SamplingParams(temperature=0, max_tokens=20), sampling_seed=0)
    scheduler.add_request(r)
    plan = scheduler.schedule()
    r.output_token_ids.append(17)  # as if the prefill sampled it
    scheduler.update(plan)
    return r



def _propose(spec, plan):
    """The step runner's first part: the trees, and the VERIFY chunks made of them."""
    trees = spec.propose(plan)
    chunks = [c.with_tree(trees[c.request.request_id].tokens, trees[c.request.request_id].parents,
                          trees[c.request.request_id].depths) for c in plan.chunks]
    return trees, chunks


def _verify(spec, chunks, trees, logits):
    """The step runner's order: stage on the device, one readback, then the walk."""
    step = StepOutput(verify_logits=logits)
    rows, failed = spec.stage(chunks, trees, step.verify_logits)
    host = step.read_back(rows)
    verified = spec.accept(chunks, trees, host.verified_rows)
    return StepResult(committed=verified.committed, accepted=verified.accepted, slot_moves=verified.slot_moves,
                      failed=failed + verified.failed)

def _logits_choosing(tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


def test_a_chain_is_drafted_verified_and_committed(tiny_llama_draft):
    scheduler, spec = _setup(tiny_llama_draft.path, tree="chain", depth=3, max_nodes=3)
    r = _decoding_request(scheduler)
    plan = scheduler.schedule()
    assert plan.chunks[0].phase == Phase.DRAFT
    trees, [chunk] = _propose(spec, plan)
    assert chunk.phase == Phase.VERIFY and chunk.num_tokens == 4 and chunk.tree_parents == [-1, 0, 1, 2]
    nodes = chunk.token_ids[1:]
    # The target agrees on the first two nodes, then wants token 99 (not the third node).
    other = 99 if nodes[2] != 99 else 98
    out = _verify(spec, [chunk], trees, {"r": _logits_choosing([nodes[0], nodes[1], other, 0])})
    assert [t for t, _, _ in out.committed["r"]] == [nodes[0], nodes[1], other]
    assert out.accepted == {"r": 2} and out.slot_moves == []  # a chain's accepted prefix is in place
    r.output_token_ids += [t for t, _, _ in out.committed["r"]]
    scheduler.update(plan, out)
    out.forward_seconds = 0.01
    spec.observe(plan, out, step_seconds=0.02, queue_empty=True)
    stats = spec.stats()
    assert stats["num_drafts"] == 1 and stats["num_accepted_tokens"] == 2 and stats["accepted_tokens_per_position"] == [1, 1]
    assert r.num_computed_tokens == r.num_tokens - 1  # root + 2 accepted; the bonus is next step's root
    spec.release("r")
    assert spec.drafts[0].num_requests == 0


def test_an_accepted_side_branch_is_moved_into_place(tiny_llama_draft):
    scheduler, spec = _setup(tiny_llama_draft.path, tree="static", expansion=(2,), max_nodes=2)
    _decoding_request(scheduler)
    plan = scheduler.schedule()
    trees, [chunk] = _propose(spec, plan)
    assert chunk.tree_parents == [-1, 0, 0]
    second = chunk.token_ids[2]
    out = _verify(spec, [chunk], trees, {"r": _logits_choosing([second, 0, 0])})
    assert out.committed["r"][0][0] == second and out.accepted == {"r": 1}
    assert out.slot_moves == [SlotMove(chunk.slot_mapping[2], chunk.slot_mapping[1])]


def test_a_verification_that_raises_fails_only_its_request(tiny_llama_draft):
    scheduler, spec = _setup(tiny_llama_draft.path, tree="chain", depth=2, max_nodes=2)
    _decoding_request(scheduler)
    plan = scheduler.schedule(2)
    trees, chunks = _propose(spec, plan)
    out = _verify(spec, chunks, trees, {"r": torch.zeros(1, VOCAB)})  # wrong number of rows
    assert not out.committed and [r.request_id for r, _ in out.failed] == ["r"]
