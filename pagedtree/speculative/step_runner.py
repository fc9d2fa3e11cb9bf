"""One scheduled step to its result: drafting, one forward, one readback, verification.

``StepRunner.execute(plan)`` is the middle call of an engine step. It wraps the
target's ``ModelRunner`` and, with speculation, the ``Speculator``:

1. the drafts grow a token tree for every DRAFT chunk (``Speculator.propose``), and
   each DRAFT chunk becomes the VERIFY chunk of its tree (or a plain decode);
2. the target runs every chunk in one forward (a failing batch is retried request
   by request, so one bad request fails alone);
3. every tree's row outcomes are staged on the device, and the step's draws and
   outcomes come to the host in one copy (a GPU step's one sync);
4. each tree's accepted path is walked, its KV moved into sequence order.

It returns a ``StepResult``: plain data the engine and the scheduler update from.
Plain decoding is the same path without a speculator.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagedtree.distributed.group import TensorParallelError
from pagedtree.sampling import NonFiniteDistributionError
from pagedtree.speculative.speculator import Speculator
from pagedtree.speculative.tree import TokenTree
from pagedtree.step_data import Phase, ScheduledChunk, StepOutput, StepPlan, StepResult
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import TokenSources

logger = logging.getLogger("pagedtree")


@dataclass(slots=True)
class LaunchedStep:
    """A plain step whose forward and draws are queued on the device and whose one
    readback copy is queued, not yet waited for (``StepRunner.launch``)."""

    plan: StepPlan
    output: StepOutput
    result: StepResult  # requests that failed while launching
    started: float  # when it was launched (the engine's step clock)


class StepRunner:
    """Runs a ``StepPlan`` on the target (and its drafts) and returns a ``StepResult``."""

    def __init__(self, runner: ModelRunner, speculator: Speculator | None = None):
        self.runner = runner
        self.speculator = speculator

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` (see module docstring); nothing in ``plan`` is changed."""
        spec = self.speculator
        trees = spec.propose(plan) if spec is not None else {}
        result = StepResult(draft_seconds=spec.last_draft_seconds if spec is not None else 0.0)
        if plan.is_empty():
            return result
        chunks = [_with_tree(chunk, trees.get(chunk.request.request_id)) for chunk in plan.chunks]
        result.num_tree_nodes = sum(c.tree_budget for c in chunks if c.phase == Phase.VERIFY)
        started = time.perf_counter()
        step = self._forward(StepPlan(chunks, plan.block_copies), result)
        verify = [c for c in chunks if c.phase == Phase.VERIFY and not _failed(result, c)]
        if spec is not None and verify:
            result.failed += spec.stage(verify, trees, step)  # every tree's row outcomes, on the device
        synced = bool(step.sample_groups or step.verify_rows)
        step.read_back()  # the step's one device-to-host copy
        # The clock is read after the readback, the step's one sync: on CUDA the
        # forward has only been queued before it, and an explicit synchronize would
        # be a second sync. A CUDA step with nothing to read back (prefill chunks
        # that need no logits yet) has no sync: its forward is left unmeasured (0,
        # which the cost model skips) rather than synced for.
        if synced or self.runner.device.type != "cuda":
            result.forward_seconds = time.perf_counter() - started
        _commit_samples(chunks, step, result)
        if spec is not None and verify:
            verified = spec.accept([c for c in verify if not _failed(result, c)], trees, step)
            result.committed.update(verified.committed)
            result.accepted.update(verified.accepted)
            result.slot_moves += verified.slot_moves
            result.failed += verified.failed
            self.runner.apply_slot_moves(result.slot_moves)
        return result

    def launch(self, plan: StepPlan, token_sources: TokenSources | None = None) -> LaunchedStep:
        """Queue a plain step (no tree in it) on the device: the forward, the draws and
        the copy of its readback; nothing waits (``complete`` does). ``token_sources``
        feed the input tokens of chunks scheduled ahead (``Scheduler.schedule_ahead``)
        from the draws of a launched step not read back yet."""
        if any(chunk.phase in (Phase.DRAFT, Phase.VERIFY) for chunk in plan.chunks):
            raise ValueError("only plain steps are launched ahead of their readback")
        started = time.perf_counter()
        result = StepResult()
        step = self._forward(plan, result, token_sources) if not plan.is_empty() else StepOutput()
        step.start_read_back()
        return LaunchedStep(plan, step, result, started)

    def complete(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's readback (its one sync) and return its result."""
        step, result = launched.output, launched.result
        step.finish_read_back()
        result.forward_seconds = time.perf_counter() - launched.started
        _commit_samples(launched.plan.chunks, step, result)
        return result

    def _forward(self, plan: StepPlan, result: StepResult, token_sources: TokenSources | None = None) -> StepOutput:
        """The target's forward over ``plan``; if it raises, each request again alone,
        recording in ``result`` the ones that still fail."""
        try:
            return self.runner.execute(plan, token_sources)
        except TensorParallelError:
            raise  # a rank died or the ranks fell out of step: no request can run any more
        except Exception as exc:  # noqa: BLE001 - one bad request must not sink the batch
            if len(plan.chunks) == 1:
                result.fail(plan.chunks[0].request, exc)
                return StepOutput()
            logger.warning("step failed (%s); retrying its %d requests one by one", exc, len(plan.chunks))
        merged = StepOutput()
        copies_done = False
        for chunk in plan.chunks:
            single = StepPlan(chunks=[chunk], block_copies=[] if copies_done else plan.block_copies)
            copies_done = True
            try:
                merged.merge(self.runner.execute(single, token_sources))
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001
                result.fail(chunk.request, exc)
        return merged


def _commit_samples(chunks: list[ScheduledChunk], step: StepOutput, result: StepResult) -> None:
    """Each plain chunk's draw, read back, as its committed token (a draw from a
    distribution that was not finite fails its request)."""
    for chunk in chunks:
        sample = step.samples.get(chunk.request.request_id)
        if chunk.phase == Phase.VERIFY or sample is None or _failed(result, chunk):
            continue
        if sample.valid:
            result.committed[chunk.request.request_id] = [(sample.token_id, sample.logprob, sample.top_logprobs)]
        else:
            result.fail(chunk.request, NonFiniteDistributionError())


def _with_tree(chunk: ScheduledChunk, tree: TokenTree | None) -> ScheduledChunk:
    """A DRAFT chunk becomes the VERIFY chunk of its tree (a plain decode without one)."""
    if chunk.phase != Phase.DRAFT:
        return chunk
    if tree is None:
        return chunk.with_tree([], [], [])
    if tree.root_token != chunk.token_ids[0]:
        raise ValueError("the tree's root is not the request's newest token")
    return chunk.with_tree(tree.tokens, tree.parents, tree.depths)


def _failed(result: StepResult, chunk: ScheduledChunk) -> bool:
    return any(request is chunk.request for request, _ in result.failed)
