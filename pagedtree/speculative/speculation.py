"""What the step runner and the engine ask of speculation, and plain decoding's answer.

``Speculation`` is the one interface behind which an engine speculates or not:
the step runner calls ``propose`` (trees for the plan's DRAFT chunks), ``stage``
and ``accept`` (verification around the target's forward and its readback); the
engine calls ``observe`` after each step, ``finish`` when a request ends, and
``request_metrics`` / ``stats`` for its outputs. ``Speculator`` (tree speculation)
implements it; ``NoSpeculation`` is plain decoding: no trees, nothing to learn,
nothing to report, so the engine never asks whether it speculates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from pagedtree.request import Request
from pagedtree.sampling import DeviceRows
from pagedtree.step_data import ScheduledChunk, StepPlan, StepResult, Verified
from pagedtree.worker.step_output import HostRows

if TYPE_CHECKING:  # the types of attributes only
    from pagedtree.speculative.budget.policy import BudgetPolicy
    from pagedtree.speculative.drafting.draft_worker import DraftWorker
    from pagedtree.speculative.tree import TokenTree


class Speculation(Protocol):
    """Drafting, verification and what they learn, as the step runner and engine use them."""

    @property
    def budget(self) -> BudgetPolicy | None:
        """The per-step tree budgets the scheduler asks for (None: no trees)."""

    @property
    def drafts(self) -> Sequence[DraftWorker]:
        """The draft workers (their runners are closed with the engine's)."""

    @property
    def last_draft_seconds(self) -> float:
        """Time the draft forwards of the last ``propose`` took."""

    def propose(self, plan: StepPlan) -> dict[str, TokenTree]:
        """The token tree of each of the plan's DRAFT chunks."""

    def stage(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
              verify_logits: Mapping[str, torch.Tensor]) -> tuple[dict[str, DeviceRows], list[tuple[Request, Exception]]]:
        """Every VERIFY chunk's row outcomes, on the device, for the step's readback;
        the requests whose staging raised."""

    def accept(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
               verified_rows: Mapping[str, HostRows]) -> Verified:
        """Each tree's accepted path, from its rows read back."""

    def observe(self, plan: StepPlan, result: StepResult, step_seconds: float, queue_empty: bool) -> None:
        """The step's measurements."""

    def finish(self, request: Request) -> None:
        """A request ended: free what speculation holds for it."""

    def request_metrics(self, requests: Sequence[Request]) -> dict[str, float]:
        """Speculation's per-request output metrics over a user request's sequences."""

    def stats(self) -> dict[str, object]:
        """Speculation counters for the engine's ``stats()``."""


class NoSpeculation:
    """Plain decoding as a ``Speculation``: no trees, no measurements, no metrics."""

    budget = None
    drafts: tuple[DraftWorker, ...] = ()
    last_draft_seconds = 0.0

    def propose(self, plan: StepPlan) -> dict[str, TokenTree]:
        """No trees."""
        return {}

    def stage(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
              verify_logits: Mapping[str, torch.Tensor]) -> tuple[dict[str, DeviceRows], list[tuple[Request, Exception]]]:
        """Nothing to stage (plain decoding has no VERIFY chunks)."""
        return {}, []

    def accept(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
               verified_rows: Mapping[str, HostRows]) -> Verified:
        """Nothing to accept."""
        return Verified()

    def observe(self, plan: StepPlan, result: StepResult, step_seconds: float, queue_empty: bool) -> None:
        """Nothing to learn."""

    def finish(self, request: Request) -> None:
        """Nothing held."""

    def request_metrics(self, requests: Sequence[Request]) -> dict[str, float]:
        """No speculation metrics."""
        return {}

    def stats(self) -> dict[str, object]:
        """No speculation counters."""
        return {}
