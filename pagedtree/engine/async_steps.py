"""Plain decoding with each step launched before the previous one is read back.

vLLM's async scheduling, SGLang's overlap loop: while a decode step runs on the GPU,
the host reads the step before it back, appends its tokens, finishes the requests
that stopped and plans the next step, so the GPU does not wait for the host between
steps. A call of ``step`` then:

1. plans the next step ahead (``Scheduler.schedule_ahead``): one token per running
   request at the position after its token in flight, fed from the device draws of
   the launched step (``StepOutput.token_sources``);
2. launches it (``StepRunner.launch``: forward, draws and the readback's copy queued);
3. waits for the launched step's readback (``StepRunner.complete``: its copy was
   queued before the new step, so the wait ends when that step's draws are done)
   and updates the engine from it, returning its outputs.

Tokens are the same as stepping one at a time: a request's draw at output position
``p`` sees the same inputs and, seeded, the same noise (``pending_tokens``). What
only the readback shows (an EOS, a stop string) costs the step ahead its row of that
request, which is dropped. Steps that cannot be planned ahead (speculation on,
requests waiting, a prompt mid-prefill, structured outputs or a repetition penalty,
which need the host's view of the newest token, too few free blocks) run the
ordinary way after the readback.
"""

from __future__ import annotations

import time
from typing import Protocol

from pagedtree.outputs import RequestOutput
from pagedtree.scheduler.scheduler import Scheduler
from pagedtree.engine.step_runner import LaunchedStep, StepRunner
from pagedtree.step_data import StepPlan, StepResult


class SteppingEngine(Protocol):
    """What the async steps need of the engine (``LLMEngine``)."""

    scheduler: Scheduler
    step_runner: StepRunner

    @property
    def speculation_enabled(self) -> bool:
        """Whether requests get token trees."""

    def update(self, plan: StepPlan, result: StepResult, started: float) -> list[RequestOutput]:
        """A step's update call: tokens appended, requests finished, the scheduler's bookkeeping."""


class AsyncSteps:
    """The engine's steps, each launched before its predecessor is read back."""

    def __init__(self, engine: SteppingEngine, enabled: bool):
        self.engine = engine
        self.pending: LaunchedStep | None = None
        self.num_steps_ahead = 0  # steps planned and launched ahead of a readback
        self.enabled = enabled  # ``LLMEngine.set_async_scheduling``

    def applies(self) -> bool:
        """Whether the engine's steps may run this way now (on, and speculation off)."""
        return self.enabled and not self.engine.speculation_enabled

    def step(self) -> list[RequestOutput]:
        """One call of the engine's ``step`` (see module docstring)."""
        engine = self.engine
        pending = self.pending
        if pending is None:
            started = time.perf_counter()
            plan = engine.scheduler.schedule()
            if plan.is_empty():
                return engine.update(plan, engine.step_runner.execute(plan), started)
            self.pending = engine.step_runner.launch(plan)
            return []
        ahead = None
        if all(self._goes_ahead(r) for r in engine.scheduler.running):
            ahead = engine.scheduler.schedule_ahead(pending.plan)
        self.pending = None
        if ahead is not None and not ahead.is_empty():
            self.pending = engine.step_runner.launch(ahead, pending.output.token_sources())
            self.num_steps_ahead += 1
        return self.complete(pending)

    def complete(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read ``launched`` back and update the engine from it."""
        result = self.engine.step_runner.complete(launched)
        return self.engine.update(launched.plan, result, launched.started)

    def flush(self) -> list[RequestOutput]:
        """Read the launched step back, if any (before the engine changes how it steps)."""
        pending, self.pending = self.pending, None
        return self.complete(pending) if pending is not None else []

    @staticmethod
    def _goes_ahead(request) -> bool:
        """Whether a request's next draw can be made before its newest token is on the
        host: not with structured outputs (the grammar's mask follows that token) or a
        repetition penalty (its history holds it)."""
        return request.grammar is None and request.params.repetition_penalty == 1.0
