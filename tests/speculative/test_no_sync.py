"""A CUDA step syncs host and device once: from the start of the target's forward to
its readback, no pagedtree code syncs; drafting syncs once per draft level.

The engine runs as it would on a GPU (the Triton attention backend, stochastic
verification deciding every row at once) under ``pagedtree.diagnostics.sync_guard``'s
CPU guard, which records every call that would sync on a GPU (``.item()``,
``.tolist()``, moves to the CPU, ``nonzero``, boolean-mask indexing,
``multinomial``, copies out of device memory, ...) when pagedtree code makes it.
The target's logits and KV caches are marked as device memory, so that a copy out
of them is seen. Planted syncs show that the guard sees what it must.

Draft forwards are timed without a sync of their own (``ForwardTimer``: CUDA events
read after the level's readback), and i.i.d. draws of one child give
``torch.multinomial``'s tokens without its host reads.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator

import pytest
import torch

import pagedtree.sampling
import pagedtree.worker.draft_levels as draft_levels_module
import pagedtree.draft_sampling as draft_sampling_module
import pagedtree.speculative.drafting.builders as builders_module
import pagedtree.speculative.drafting.proposer as proposer_module
import pagedtree.worker.model_runner as model_runner_module
from pagedtree import LLM, SamplingParams
from pagedtree.request import Request
from pagedtree.speculative import SpeculativeConfig
from pagedtree.speculative.drafting.builders import StagedChildren, read_children, stage_children
from pagedtree.worker.draft_levels import ForwardTimer
from pagedtree.engine.step_runner import StepRunner
from pagedtree.speculative.tree import ChildDraw
from pagedtree.step_data import Phase, ScheduledChunk, StepPlan
from pagedtree.worker.step_output import StepOutput
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.diagnostics.sync_guard import Sync, SyncError, SyncGuard

# The engine tests run the Triton backend on CPU tensors.
needs_interpreter = pytest.mark.triton_interpreter

# The draft-sampling rule of each unseeded request of the batch, by its temperature.
UNSEEDED_RULES = {0.9: "iid", 0.7: "without_replacement", 0.6: "topk"}


class GuardedEngine:
    """An engine as a GPU would run it, with a guard over two windows: the target's
    step (``ModelRunner.execute`` to ``StepOutput.read_back``) and each draft
    worker's ``propose``."""

    def __init__(self, llm: LLM, guard: SyncGuard):
        self.llm = llm
        self.guard = guard
        self.step_syncs: list[Sync] = []
        self.draft_levels: list[tuple[int, list[Sync], int]] = []  # (forwards, syncs, jobs) per propose

    def generate(self, prompts: list, params: list[SamplingParams]) -> list:
        return self.llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture
def guarded_engine(tiny_llama, tiny_llama_draft, monkeypatch) -> Iterator[GuardedEngine]:
    # enforce_eager: no numba element-wise kernels (CPU only; a GPU runs the eager ops).
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", attention_backend="triton", seed=3,
              enforce_eager=True, max_num_seqs=8, draft_model=[str(tiny_llama_draft.path)],
              speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 1),
                                            draft_sampling="without_replacement"))
    llm.engine.speculation.verifier.decide_all_rows = True  # as on a GPU
    guard = SyncGuard(torch.device("cpu"), active=False)
    engine = GuardedEngine(llm, guard)
    guard.mark_device(*(t for pair in llm.engine.runner.kv_caches for t in pair))
    execute, read_back, forward = ModelRunner.execute, StepOutput.read_back, ModelRunner.forward
    worker = llm.engine.speculation.proposer.drafts[0]
    propose = type(worker).propose

    def guarded_execute(runner, plan, *args):
        guard.clear()
        guard.active = True
        return execute(runner, plan, *args)

    def guarded_read_back(step, *args):
        if guard.active:
            guard.active = False
            engine.step_syncs += guard.syncs
        return read_back(step, *args)

    def marked_forward(runner, chunks, rows, *args, **kwargs):
        logits = forward(runner, chunks, rows, *args, **kwargs)
        guard.mark_device(logits)
        return logits

    def guarded_propose(self, jobs):
        before = self.num_forward_passes
        guard.clear()
        guard.active = True
        try:
            return propose(self, jobs)
        finally:
            guard.active = False
            engine.draft_levels.append((self.num_forward_passes - before, list(guard.syncs), len(jobs)))

    monkeypatch.setattr(ModelRunner, "execute", guarded_execute)
    monkeypatch.setattr(StepOutput, "read_back", guarded_read_back)
    monkeypatch.setattr(ModelRunner, "forward", marked_forward)
    monkeypatch.setattr(type(worker), "propose", guarded_propose)
    with guard:
        yield engine


@needs_interpreter
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "level_by_level"])
def test_a_speculative_step_syncs_once_and_a_draft_level_once(guarded_engine, monkeypatch, whole):
    """No sync between the target's forward and its readback; a draft reads its
    children back in one copy (``read_drawn``: once a draft when drafted whole, once
    a level otherwise) and syncs nowhere else.

    Every draw rule in one batch: a greedy request (top-k children, verified
    greedily), a seeded one (coupled children, coupled verification) and three
    unseeded ones, whose children are drawn i.i.d., without replacement and by
    top-k (stochastic verification tests each draw by its own rule; the engine
    takes one rule for all unseeded requests, here each gets its own), with
    penalties, top-p, min_tokens and logprobs. Decode and verify steps run padded
    from static buffers, as CUDA graphs replay them (run eagerly here)."""
    engine = guarded_engine
    target = engine.llm.engine
    target.runner.enable_cuda_graphs(8, target.max_model_len, 7, capture=False)
    target.speculation.drafts[0].runner.enable_cuda_graphs(16, target.max_model_len, 1, capture=False)
    real_rule = proposer_module.proposal_rule

    def rule_by_temperature(request, config):
        rule = real_rule(request, config)
        return UNSEEDED_RULES.get(request.params.temperature, rule) if rule == config.draft_sampling else rule

    monkeypatch.setattr(proposer_module, "proposal_rule", rule_by_temperature)
    drawn: list[tuple[str, int]] = []  # (rule, number of children) of every draw
    real_stage = proposer_module.ShapeTreeBuilder._stage_children

    def recorded_stage_children(builder, node, logits, k):
        drawn.append((builder.rule, k))
        return real_stage(builder, node, logits, k)

    monkeypatch.setattr(proposer_module.ShapeTreeBuilder, "_stage_children", recorded_stage_children)
    real_draw_level = draft_levels_module.draw_level

    def recorded_draw_level(logits, rules):
        drawn.extend((rule.rule, rule.k) for rule in rules if rule is not None)
        return real_draw_level(logits, rules)

    monkeypatch.setattr(draft_levels_module, "draw_level", recorded_draw_level)
    target.speculation.drafts[0].whole_drafts = whole
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 9 + i, 41]} for i in range(5)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=5, ignore_eos=True, logprobs=1,
                       repetition_penalty=1.2, min_tokens=3),
        SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.6, max_tokens=5, ignore_eos=True, logprobs=1),
    ]
    outputs = engine.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outputs)
    assert {rule for rule, _ in drawn} == {"topk", "coupled", "iid", "without_replacement"}
    assert ("iid", 1) in drawn and ("iid", 2) in drawn  # one draw and several (torch's two paths)
    assert target.runner.graphs.num_steps > 0 and target.speculation.drafts[0].runner.graphs.num_steps > 0
    stats = engine.llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert engine.step_syncs == [], sorted({str(s) for s in engine.step_syncs})
    assert engine.draft_levels and any(jobs > 1 for _, _, jobs in engine.draft_levels)
    for forwards, syncs, _ in engine.draft_levels:
        assert 1 <= len(syncs) <= forwards, [str(s) for s in syncs]
        assert all(s.function == "read_drawn" for s in syncs), [str(s) for s in syncs]


@needs_interpreter
def test_the_guard_sees_the_reads_of_the_cpu_walk(guarded_engine):
    """On a CPU, stochastic verification reads each row's outcome as the walk
    reaches it (free there); the guard must see those reads, or it proves nothing."""
    engine = guarded_engine
    engine.llm.engine.speculation.verifier.decide_all_rows = False
    params = SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True)
    engine.generate([{"prompt_token_ids": [5, 17, 33, 9, 41]}], [params])
    assert any(s.function == "along_walk" for s in engine.step_syncs), [str(s) for s in engine.step_syncs]


# ---------------------------------------------------------------- planted syncs
def _pagedtree_function(fn: Callable) -> Callable:
    """``fn`` as a function of ``pagedtree.sampling``: the calls it makes are
    pagedtree code's."""
    return types.FunctionType(fn.__code__, vars(pagedtree.sampling), fn.__name__, fn.__defaults__, fn.__closure__)


def _plant_nonzero(logits):
    torch.nonzero(logits > 0)


def _plant_multinomial(logits):
    torch.multinomial(torch.softmax(logits[0], dim=-1), 1)


def _plant_boolean_mask(logits):
    logits[logits > 0]


def _plant_device_to_host_copy(logits):
    torch.empty(logits.shape, dtype=logits.dtype).copy_(logits)


PLANTS = {
    "nonzero": _plant_nonzero,
    "multinomial": _plant_multinomial,
    "boolean-mask index": _plant_boolean_mask,
    "copy_ device-to-host": _plant_device_to_host_copy,
}


@needs_interpreter
@pytest.mark.parametrize("kind", PLANTS)
def test_a_planted_sync_fails_the_guard(guarded_engine, monkeypatch, kind):
    """A sync planted in the sampler (inside the target's step) is recorded, at the
    planted line, and fails the check."""
    engine = guarded_engine
    plant = _pagedtree_function(PLANTS[kind])

    def sample_rows_with_a_sync(logits, rows):
        plant(logits)
        return sample_rows(logits, rows)  # noqa: F821 - pagedtree.sampling's, once moved there

    monkeypatch.setattr(model_runner_module, "sample_rows", _pagedtree_function(sample_rows_with_a_sync))
    engine.generate([{"prompt_token_ids": [5, 17, 33, 9, 41]}], [SamplingParams(temperature=0.0, max_tokens=2)])
    planted = [s for s in engine.step_syncs if s.function == plant.__name__]
    assert [s.kind for s in planted] and {s.kind for s in planted} == {kind}, [str(s) for s in engine.step_syncs]
    engine.guard.syncs = engine.step_syncs
    with pytest.raises(SyncError, match=kind):
        engine.guard.check()


# ---------------------------------------------------------------- i.i.d. draws
def test_iid_draws_are_torch_multinomials_without_its_host_reads():
    """One i.i.d. child is drawn by torch's own one-sample algorithm without its
    checks (host reads): the same tokens, and the generator left in the same state;
    several are ``torch.multinomial``'s draws themselves."""
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(300, generator=g) * (1 + seed % 4)
        logits[torch.randperm(300, generator=g)[: 20 * (seed % 3)]] = -float("inf")
        logprobs = torch.log_softmax(logits, dim=-1)
        for k in (1, 3):
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            tokens, increments, _ = stage_children(logprobs, k, "iid", ours)
            assert torch.equal(tokens, torch.multinomial(logprobs.exp(), k, replacement=True, generator=theirs))
            assert torch.equal(increments, logprobs[tokens])
            assert torch.equal(torch.rand(4, generator=ours), torch.rand(4, generator=theirs))


def test_a_nan_draft_distribution_is_refused_on_reading_back():
    nan = torch.full((8,), float("nan"))
    tokens, increments, draw = stage_children(nan, 1, "iid", torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="NaN"):
        read_children([StagedChildren(-1, tokens, increments, draw)])
    empty = torch.full((8,), -float("inf"))  # no mass: nothing to propose, no error
    tokens, increments, draw = stage_children(empty, 1, "iid", torch.Generator().manual_seed(0))
    staged = StagedChildren(-1, tokens, increments, ChildDraw("iid", -1))
    read_children([staged])
    assert staged.host_tokens == []


# ---------------------------------------------------------------- timing
class FakeEvent:
    """A ``torch.cuda.Event`` stand-in: done once the test says the stream got there."""

    made: list[FakeEvent] = []

    def __init__(self, enable_timing: bool = False):
        self.enable_timing, self.recorded, self.done = enable_timing, False, False
        FakeEvent.made.append(self)

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done and self.enable_timing and end.enable_timing
        return 250.0  # ms

    def synchronize(self) -> None:
        raise AssertionError("the timer must not sync")


@pytest.fixture
def fake_cuda_events(monkeypatch) -> list[FakeEvent]:
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return FakeEvent.made


def test_the_forward_timer_reads_cuda_events_only_after_a_sync(fake_cuda_events, monkeypatch):
    def no_clock():
        raise AssertionError("on CUDA the host clock times the queueing")

    monkeypatch.setattr(draft_levels_module, "time", types.SimpleNamespace(perf_counter=no_clock))
    timer = ForwardTimer(torch.device("cuda"))
    timer.start()
    timer.stop()
    assert [(e.recorded, e.enable_timing) for e in fake_cuda_events] == [(True, True), (True, True)]
    assert timer.seconds() is None  # not reached yet: no sync since
    for event in fake_cuda_events:
        event.done = True
    assert timer.seconds() == 0.25


def test_the_forward_timer_on_a_cpu_is_the_clock_around_the_call(fake_cuda_events, monkeypatch):
    clock = iter([10.0, 10.5])
    monkeypatch.setattr(draft_levels_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    timer = ForwardTimer(torch.device("cpu"))
    timer.start()
    timer.stop()
    assert timer.seconds() == 0.5 and fake_cuda_events == []


@pytest.mark.parametrize("whole", [False, True], ids=["level_by_level", "whole"])
def test_draft_forwards_are_timed_after_their_level_is_read_back(tiny_llama, tiny_llama_draft, fake_cuda_events,
                                                                   monkeypatch, whole):
    """The draft worker's CUDA timing, on a CPU engine with stand-in events that the
    readback completes: every forward's timer is read, with the events' time, after
    the readback of its level (level by level) or of the whole draft."""
    real_init = ForwardTimer.__init__
    monkeypatch.setattr(ForwardTimer, "__init__", lambda timer, device: real_init(timer, torch.device("cuda")))
    events: list[str] = []
    real_read_drawn = draft_sampling_module.read_drawn

    def synced_read_drawn(drawn):
        events.append("readback")
        for event in fake_cuda_events:  # the readback waits for everything queued before it
            event.done = True
        return real_read_drawn(drawn)

    # The one readback of a level (builders.read_children) or of a whole draft (draft_levels).
    monkeypatch.setattr(builders_module, "read_drawn", synced_read_drawn)
    monkeypatch.setattr(draft_levels_module, "read_drawn", synced_read_drawn)
    real_seconds = ForwardTimer.seconds
    seconds: list[float] = []

    def timed(timer):
        events.append("timed")
        took = real_seconds(timer)
        seconds.append(took)
        return took

    monkeypatch.setattr(ForwardTimer, "seconds", timed)
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", seed=3, draft_model=[str(tiny_llama_draft.path)],
              speculative=SpeculativeConfig(adaptive=False, tree="static", expansion=(2, 1)))
    worker = llm.engine.speculation.proposer.drafts[0]
    worker.whole_drafts = whole
    llm.generate([{"prompt_token_ids": [5, 17, 33, 9, 41]}], [SamplingParams(temperature=0.0, max_tokens=5)],
                 use_tqdm=False)
    assert worker.num_forward_passes > 1
    if whole:  # the root's forward and its two children's (leaves are not fed): two forwards a readback
        assert events == ["readback", "timed", "timed"] * (worker.num_forward_passes // 2)
    else:
        assert events == ["readback", "timed"] * worker.num_forward_passes
    assert seconds == [0.25] * worker.num_forward_passes
    assert llm.engine.speculation.budget.draft_cost.has_data  # the times reach the cost model


class _QueuedRunner:
    """A runner whose forward has nothing to read back (a prefill chunk that needs
    no logits yet)."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def execute(self, plan: StepPlan, token_sources=None) -> StepOutput:
        time.sleep(0.002)
        return StepOutput()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_step_without_a_readback_is_timed_only_where_its_forward_has_run(device):
    request = Request("r", None, [5, 9, 13], SamplingParams(max_tokens=4), sampling_seed=0)
    chunk = ScheduledChunk(request=request, phase=Phase.PREFILL, token_ids=[5, 9], positions=[0, 1],
                           slot_mapping=[0, 1], block_table=[0], context_len=2, logits_from=None)
    result = StepRunner(_QueuedRunner(device)).execute(StepPlan(chunks=[chunk]))
    assert not result.failed
    if device == "cpu":
        assert result.forward_seconds >= 0.002
    else:  # queued on CUDA, never synced: not measured (the cost model skips 0)
        assert result.forward_seconds == 0.0
