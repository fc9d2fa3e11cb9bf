"""One scheduled step to its result: drafting, one forward, one readback, verification.

``StepRunner.execute(plan)`` is the middle call of an engine step. It wraps the
target's ``ModelRunner`` and, with speculation, the ``Speculator``:

1. ``propose``: the drafts grow a token tree for every DRAFT chunk, and each DRAFT
   chunk becomes the VERIFY chunk of its tree (or a plain decode);
2. ``forward``: the target runs every chunk in one forward (a failing batch is
   retried request by request, so one bad request fails alone) -> ``StepOutput``;
3. ``stage``: every tree's row outcomes, decided on the device -> their rows;
4. ``read_back``: the step's draws and tree rows come to the host in one copy (a
   GPU step's one sync) -> ``HostStep``;
5. ``accept``: each tree's accepted path is walked -> ``Verified``, and its KV moved
   into sequence order.

Each call returns a value that the next one takes; the ``StepResult`` is built once
from them: plain data the engine and the scheduler update from.
Plain decoding is the same path with ``NoSpeculation``: no trees, so nothing to
stage or accept.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pagedtree.distributed.group import TensorParallelError
from pagedtree.sampling import NonFiniteDistributionError
from pagedtree.speculative.speculation import NoSpeculation, Speculation
from pagedtree.speculative.tree import TokenTree
from pagedtree.request import Request
from pagedtree.step_data import Committed, Phase, ScheduledChunk, StepPlan, StepResult, Verified
from pagedtree.worker.step_output import HostStep, QueuedStep, StepOutput
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import TokenSources

logger = logging.getLogger("pagedtree")


@dataclass(slots=True)
class LaunchedStep:
    """A plain step whose forward and draws are queued on the device and whose one
    readback copy is queued, not yet waited for (``StepRunner.launch``)."""

    plan: StepPlan
    output: StepOutput
    queued: QueuedStep | None  # None: nothing to read back
    failed: list[tuple[Request, Exception]]  # requests that failed while launching
    started: float  # when it was launched (the engine's step clock)


class StepRunner:
    """Runs a ``StepPlan`` on the target (and its drafts) and returns a ``StepResult``."""

    def __init__(self, runner: ModelRunner, speculation: Speculation | None = None):
        self.runner = runner
        self.speculation: Speculation = speculation if speculation is not None else NoSpeculation()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan`` (see module docstring); nothing in ``plan`` is changed."""
        spec = self.speculation
        trees = spec.propose(plan)
        draft_seconds = spec.last_draft_seconds
        if plan.is_empty():
            return StepResult(draft_seconds=draft_seconds)
        chunks = [_with_tree(chunk, trees.get(chunk.request.request_id)) for chunk in plan.chunks]
        started = time.perf_counter()
        output, failed = self._forward(StepPlan(chunks, plan.block_copies))
        verify = [c for c in chunks if c.phase == Phase.VERIFY and not _failed(failed, c)]
        rows, stage_failed = spec.stage(verify, trees, output.verify_logits) if verify else ({}, [])
        failed += stage_failed
        host = output.read_back(rows)  # the step's one device-to-host copy
        # The clock is read after the readback, the step's one sync: on CUDA the
        # forward has only been queued before it, and an explicit synchronize would
        # be a second sync. A CUDA step with nothing to read back (prefill chunks
        # that need no logits yet) has no sync: its forward is left unmeasured (0,
        # which the cost model skips) rather than synced for.
        synced = bool(output.sample_groups or rows) or self.runner.device.type != "cuda"
        forward_seconds = time.perf_counter() - started if synced else 0.0
        committed = _committed_samples(chunks, host, failed)
        verified = spec.accept([c for c in verify if not _failed(failed, c)], trees, host.verified_rows) \
            if verify else Verified()
        if verified.slot_moves:
            self.runner.apply_slot_moves(verified.slot_moves)
        return StepResult(
            committed=committed | verified.committed, accepted=verified.accepted, failed=failed + verified.failed,
            slot_moves=verified.slot_moves,
            num_tree_nodes=sum(c.tree_budget for c in chunks if c.phase == Phase.VERIFY),
            forward_seconds=forward_seconds, draft_seconds=draft_seconds,
        )

    @contextlib.contextmanager
    def speculation_paused(self) -> Iterator[None]:
        """Steps inside run as plain decoding: nothing is drafted, measured or remembered."""
        saved, self.speculation = self.speculation, NoSpeculation()
        try:
            yield
        finally:
            self.speculation = saved

    def launch(self, plan: StepPlan, token_sources: TokenSources | None = None) -> LaunchedStep:
        """Queue a plain step (no tree in it) on the device: the forward, the draws and
        the copy of its readback; nothing waits (``complete`` does). ``token_sources``
        feed the input tokens of chunks scheduled ahead (``Scheduler.schedule_ahead``)
        from the draws of a launched step not read back yet."""
        if any(chunk.phase in (Phase.DRAFT, Phase.VERIFY) for chunk in plan.chunks):
            raise ValueError("only plain steps are launched ahead of their readback")
        started = time.perf_counter()
        output, failed = self._forward(plan, token_sources) if not plan.is_empty() else (StepOutput(), [])
        return LaunchedStep(plan, output, output.queue_read_back() if output.has_rows else None, failed, started)

    def complete(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's readback (its one sync) and return its result."""
        host = launched.queued.wait() if launched.queued is not None else HostStep()
        failed = list(launched.failed)
        committed = _committed_samples(launched.plan.chunks, host, failed)
        return StepResult(committed=committed, failed=failed,
                          forward_seconds=time.perf_counter() - launched.started)

    def _forward(self, plan: StepPlan, token_sources: TokenSources | None = None,
                 ) -> tuple[StepOutput, list[tuple[Request, Exception]]]:
        """The target's forward over ``plan``; if it raises, each request again alone:
        the output, and the requests that still fail."""
        try:
            return self.runner.execute(plan, token_sources), []
        except TensorParallelError:
            raise  # a rank died or the ranks fell out of step: no request can run any more
        except Exception as exc:  # noqa: BLE001 - one bad request must not sink the batch
            if len(plan.chunks) == 1:
                return StepOutput(), [(plan.chunks[0].request, exc)]
            logger.warning("step failed (%s); retrying its %d requests one by one", exc, len(plan.chunks))
        merged, failed = StepOutput(), []
        copies_done = False
        for chunk in plan.chunks:
            single = StepPlan(chunks=[chunk], block_copies=[] if copies_done else plan.block_copies)
            copies_done = True
            try:
                merged.merge(self.runner.execute(single, token_sources))
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001
                failed.append((chunk.request, exc))
        return merged, failed


def _committed_samples(chunks: list[ScheduledChunk], host: HostStep, failed: list[tuple[Request, Exception]],
                       ) -> dict[str, list[Committed]]:
    """Each plain chunk's draw, read back, as its committed token; a draw from a
    distribution that was not finite fails its request (appended to ``failed``)."""
    committed: dict[str, list[Committed]] = {}
    for chunk in chunks:
        rid = chunk.request.request_id
        sample = host.samples.get(rid)
        if chunk.phase == Phase.VERIFY or sample is None or _failed(failed, chunk):
            continue
        if sample.valid:
            committed[rid] = [(sample.token_id, sample.logprob, sample.top_logprobs)]
        else:
            failed.append((chunk.request, NonFiniteDistributionError()))
    return committed


def _with_tree(chunk: ScheduledChunk, tree: TokenTree | None) -> ScheduledChunk:
    """A DRAFT chunk becomes the VERIFY chunk of its tree (a plain decode without one)."""
    if chunk.phase != Phase.DRAFT:
        return chunk
    if tree is None:
        return chunk.with_tree([], [], [])
    if tree.root_token != chunk.token_ids[0]:
        raise ValueError("the tree's root is not the request's newest token")
    return chunk.with_tree(tree.tokens, tree.parents, tree.depths)


def _failed(failed: list[tuple[Request, Exception]], chunk: ScheduledChunk) -> bool:
    return any(request is chunk.request for request, _ in failed)
