"""The engine: requests in, outputs out, one step at a time.

A step is three calls, each with one owner:

- ``Scheduler.schedule()`` -> ``StepPlan``: which requests compute which tokens,
  the KV slots they write (and, with speculation, the slots reserved for each
  request's token tree, sized by the budget policy);
- ``StepRunner.execute(plan)`` -> ``StepResult``: drafting, one forward of the
  target, one device readback, verification; plain data;
- ``LLMEngine.update(plan, result)``: append the committed tokens (exact stops),
  fail and finish requests, the scheduler's KV bookkeeping (``Scheduler.update``),
  and the measurements speculation learns from.

Everything else has its own place: set-up in ``build.build_engine``, prompts and
request ids in ``input_processor``, tokens and outputs in ``output_processor``,
counters in ``stats``; speculation, or plain decoding, behind the step runner's
``Speculation``.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from dataclasses import fields

import torch

from pagedtree.config import EngineConfig
from pagedtree.engine.async_steps import AsyncSteps
from pagedtree.engine.build import EngineParts, build_engine
from pagedtree.engine.errors import EngineStoppedError
from pagedtree.engine.input_processor import ParentRequest, PromptType
from pagedtree.engine.stats import engine_stats
from pagedtree.outputs import RequestOutput
from pagedtree.request import Request, RequestStatus
from pagedtree.sampling_params import SamplingParams
from pagedtree.speculative.speculation import Speculation
from pagedtree.step_data import StepPlan, StepResult

logger = logging.getLogger("pagedtree")


class LLMEngine(EngineParts):
    """Owns the model, the KV cache, the scheduler; ``step()`` advances every request.
    Its attributes are its parts (``build.EngineParts``)."""

    def __init__(self, config: EngineConfig):
        parts = build_engine(config)
        for part in fields(EngineParts):
            setattr(self, part.name, getattr(parts, part.name))
        self._finalizer = weakref.finalize(self, self.tensor_parallel.shutdown) if self.tensor_parallel else None
        self._shut_down = False
        self.async_steps = AsyncSteps(self, self.asynchronous)
        self.num_prompt_tokens = self.num_failed_requests = 0

    @property
    def speculation(self) -> Speculation:
        """Tree speculation, or plain decoding (``NoSpeculation``), as the steps run now."""
        return self.step_runner.speculation

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and the grammar compiler, and free the models,
        caches and graphs (on CUDA at once, for a next engine to size its cache from);
        no step after it. Idempotent; the ranks also stop with the engine's garbage
        collection or the interpreter, the compiler when its input closes."""
        self.grammars.close()
        if self._finalizer is not None:
            self._finalizer()
        self._shut_down = True
        self.async_steps.pending = None  # its tensors go with the runners
        for runner in [self.runner] + [draft.runner for draft in self.speculation.drafts]:
            runner.close()
        if self.device.type == "cuda":
            gc.collect()  # whatever still refers to them in cycles
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None) -> str:
        """Validate and queue a request; returns its id."""
        request_id = self.requests.next_id() if request_id is None else request_id
        return self.add_parent(self.input_processor.make_requests(request_id, prompt, params))

    def add_parent(self, parent: ParentRequest) -> str:
        """Queue requests built by ``InputProcessor.make_requests``."""
        self.requests.add(parent)
        for child in parent.children:
            self.scheduler.add_request(child)
            self.num_prompt_tokens += child.num_prompt_tokens
        return parent.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        parent = self.requests.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.status.finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
        return self._output(parent)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running, or a launched step is not read back."""
        return self.scheduler.has_unfinished() or self.async_steps.pending is not None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update (see module docstring); return
        the outputs of the requests it touched."""
        if self._shut_down:
            if self.tensor_parallel is not None:  # the group's own error says so too
                raise self.tensor_parallel.group.mark_broken("the engine was shut down")
            raise EngineStoppedError("the engine was shut down")
        if self.async_steps.applies():
            return self.async_steps.step()
        if self.async_steps.pending is not None:  # speculation or async steps were switched off
            return self.async_steps.flush()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        result = self.step_runner.execute(plan)
        return self.update(plan, result, started)

    def update(self, plan: StepPlan, result: StepResult, started: float) -> list[RequestOutput]:
        """Append each request's committed tokens one by one (exact stops), fail and
        finish requests, then the scheduler's KV bookkeeping and speculation's
        measurements."""
        self.scheduler.check_progress(plan)
        if plan.is_empty():
            return []
        # A request that ended before this update (a step planned ahead of the readback
        # that showed its stop, or an abort meanwhile) has nothing more to report.
        ended = {id(chunk.request) for chunk in plan.chunks if chunk.request.status.finished}
        for request, exc in result.failed:
            if id(request) not in ended:
                self._fail(request, exc)
        touched: dict[int, ParentRequest] = {}
        for chunk in plan.chunks:
            request, tokens = chunk.request, result.committed.get(chunk.request.request_id)
            if id(request) in ended or (tokens is None and not request.status.finished):
                continue  # ended before, or a prefill chunk that does not reach the end of its prompt
            if not request.status.finished:
                status, error = self.output_processor.commit(request, tokens)
                if error is not None:
                    self._fail(request, error)
                elif status is not None:
                    self._finish(request, status)
            parent = self.requests.parent_of[request.request_id]
            touched[id(parent)] = parent
        self.scheduler.update(plan, result)
        self.speculation.observe(plan, result, time.perf_counter() - started, queue_empty=not self.scheduler.waiting)
        return [self._output(parent) for parent in touched.values()]

    def set_speculation(self, enabled: bool) -> None:
        """Turn tree speculation on or off for the following steps (benchmarks use it
        to measure plain decoding with the same engine in the same run)."""
        if enabled and self.speculation.budget is None:
            raise ValueError("this engine has no draft model or drafter")
        self.scheduler.budget_policy = self.speculation.budget if enabled else None

    def set_async_scheduling(self, enabled: bool) -> None:
        """Launch plain steps ahead of their readback, or not, from the next step on
        (a launched step is read back first); benchmarks use it to compare both in one
        run. Refused under tensor parallelism."""
        if enabled and self.tensor_parallel is not None:
            raise ValueError("async scheduling needs one process")
        self.async_steps.enabled = enabled

    @property
    def speculation_enabled(self) -> bool:
        """Whether the scheduler gives requests token trees."""
        return self.scheduler.budget_policy is not None

    def _fail(self, request: Request, exc: Exception) -> None:
        logger.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self.num_failed_requests += 1
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        request.finish_time = time.monotonic()
        self.runner.release([request.request_id])
        self.output_processor.release(request.request_id)
        self.speculation.finish(request)

    def _output(self, parent: ParentRequest) -> RequestOutput:
        self.requests.drop_if_finished(parent)
        return self.output_processor.request_output(parent, self.speculation.request_metrics(parent.children))

    def stats(self) -> dict[str, object]:
        """Counters of the cache, the scheduler and the work done so far (``stats.engine_stats``)."""
        return engine_stats(self, self.speculation, self.num_prompt_tokens, self.num_failed_requests)
