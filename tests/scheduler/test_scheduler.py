"""The scheduler on its own: FCFS admission, token budget, chunked prefill,
preemption by recompute, tree slots reserved by a budget policy, a drafted tree's
VERIFY chunk in them, and the rejected nodes' slots truncated in ``update``."""

from __future__ import annotations

from pagedtree.request import Request, RequestStatus
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import Phase, SlotMove, StepResult
from pagedtree.config import SchedulerConfig
from pagedtree.scheduler.scheduler import Scheduler


def _request(rid: str, prompt_len: int, max_tokens: int = 16) -> Request:
    return Request(rid, None, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens), sampling_seed=0)


def _scheduler(num_blocks=32, block_size=4, **cfg) -> Scheduler:
    config = SchedulerConfig(**({"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128} | cfg))
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def _finish_step(scheduler: Scheduler, plan, new_token: int = 7) -> None:
    """What the engine does after a forward: append the sampled token where one was drawn."""
    for chunk in plan.chunks:
        if chunk.logits_from is not None:
            chunk.request.output_token_ids.append(new_token)
    scheduler.update(plan)


def test_fcfs_admission_within_the_token_budget_with_chunked_prefill():
    s = _scheduler(max_num_batched_tokens=10)
    a, b = _request("a", 7), _request("b", 6)
    s.add_request(a)
    s.add_request(b)
    plan = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 7), ("b", 3)]
    assert plan.chunks[1].logits_from is None  # b's prompt is not finished: no sample
    _finish_step(s, plan)
    plan = s.schedule()
    # a decodes one token, b finishes its prompt in the same step.
    assert [(c.request.request_id, c.phase, c.num_tokens) for c in plan.chunks] == [
        ("a", Phase.DECODE, 1), ("b", Phase.PREFILL, 3)]
    # Before that step runs: a may speculate (one token to compute), b has 3 prompt tokens left.
    decoding, other = s.pending_load()
    assert [r.request_id for r in decoding] == ["a"] and other == 3


def test_a_prompt_chunk_that_stops_mid_prompt_ends_at_the_multiple_asked_for():
    """``prompt_chunk_multiple`` (4 for ggml's repacked products): a prompt is cut at
    multiples of 4 positions whatever budget other requests leave, so it is cut the
    same way with speculation and without; a budget that does not reach the next
    multiple waits for a step whose budget does."""
    s = _scheduler(max_num_batched_tokens=10, prompt_chunk_multiple=4)
    a, b, c = _request("a", 7), _request("b", 13), _request("c", 3)
    for r in (a, b, c):
        s.add_request(r)
    plan = s.schedule()  # a takes 7, b's prompt would be cut at 3: it waits
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 7)]
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 0
    _finish_step(s, plan)
    plan = s.schedule()  # a decodes 1; b gets 9 of the budget: cut at 8
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 8)]
    _finish_step(s, plan)
    plan = s.schedule()  # b's last 5 fit: a prompt's end needs no multiple; c's 3 likewise
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 5), ("c", 3)]
    # A step budget below the multiple still moves prompts on, a token at a time.
    s = _scheduler(max_num_batched_tokens=3, prompt_chunk_multiple=4)
    s.add_request(_request("d", 7))
    assert [c.num_tokens for c in s.schedule().chunks] == [3]


def test_preemption_by_recompute_frees_the_newest_request():
    s = _scheduler(num_blocks=4, block_size=4)
    a, b = _request("a", 8), _request("b", 8)
    s.add_request(a)
    s.add_request(b)
    _finish_step(s, s.schedule())
    assert s.block_manager.num_free_blocks == 0
    plan = s.schedule()  # a needs a third block for its next token: b goes
    assert plan.preempted == [b] and b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [c.request for c in plan.chunks] == [a]
    assert s.num_preemptions == 1


def test_tree_slots_are_reserved_attached_committed_and_truncated():
    s = _scheduler()
    r = _request("r", 5, max_tokens=4)
    s.add_request(r)
    _finish_step(s, s.schedule())  # prefill; first output token appended
    decoding, other = s.pending_load()
    assert [x.request_id for x in decoding] == ["r"] and other == 0
    plan = s.schedule(node_budgets=8)
    chunk = plan.chunks[0]
    # The budget is capped by max_tokens: 4 - 1 generated - 1 bonus = 2 nodes.
    assert chunk.phase == Phase.DRAFT and chunk.tree_budget == 2
    assert s.block_manager.num_tokens("r") == r.num_tokens + 2
    assert chunk.tree_slots == s.block_manager.slots("r", r.num_tokens, r.num_tokens + 2)
    # A two-node star: both children of the root.
    verify = chunk.with_tree([11, 12], [-1, -1], [1, 1])
    assert verify.phase == Phase.VERIFY and verify.token_ids == [r.output_token_ids[-1], 11, 12]
    assert verify.positions == [5, 6, 6] and verify.tree_parents == [-1, 0, 0] and verify.context_len == 8
    assert verify.slot_mapping == chunk.slot_mapping + chunk.tree_slots
    assert chunk.phase == Phase.DRAFT  # the scheduler's plan is not changed
    # Node 1 (token 12) is accepted: its KV slides into the slot right after the root.
    assert verify.accepted_slot_moves([1]) == [SlotMove(verify.slot_mapping[2], verify.slot_mapping[1])]
    assert verify.accepted_slot_moves([0]) == []  # a chain's accepted prefix is already in place
    r.output_token_ids += [12, 9]
    s.update(plan, StepResult(accepted={"r": 1}))
    assert r.num_computed_tokens == 7 and s.block_manager.num_tokens("r") == 7
    s.block_manager.check_invariants()


def test_the_budget_policy_sizes_the_trees():
    class Policy:
        def choose(self, decoding, other_tokens):
            return {r.request_id: 3 for r in decoding if r.request_id == "a"}

    s = _scheduler()
    s.budget_policy = Policy()
    a, b = _request("a", 5), _request("b", 5)
    s.add_request(a)
    s.add_request(b)
    _finish_step(s, s.schedule())
    plan = s.schedule()
    assert [(c.request.request_id, c.phase, c.tree_budget) for c in plan.chunks] == [
        ("a", Phase.DRAFT, 3), ("b", Phase.DECODE, 0)]


def test_an_empty_tree_is_a_plain_decode_and_finish_frees_everything():
    s = _scheduler()
    r = _request("r", 5)
    s.add_request(r)
    _finish_step(s, s.schedule())
    plan = s.schedule(node_budgets=3)
    decode = plan.chunks[0].with_tree([], [], [])
    assert decode.phase == Phase.DECODE and decode.token_ids == plan.chunks[0].token_ids
    r.output_token_ids.append(8)
    s.update(plan, StepResult())  # no tree verified: the reserved slots go
    assert s.block_manager.num_tokens("r") == r.num_tokens - 1 == r.num_computed_tokens
    s.finish(r, RequestStatus.FINISHED_ABORTED)
    s.finish(r, RequestStatus.FINISHED_ABORTED)  # finishing twice is harmless (recovery paths)
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks and not s.has_unfinished()
