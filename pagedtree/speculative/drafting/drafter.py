"""What a source of draft trees is to the proposer.

A ``Drafter`` grows a token tree for each ``DraftJob`` of a step (within the job's
node budget) and forgets a request on ``release``. Two kinds exist: a draft model
(``DraftWorker``, which needs the job's ``TreeBuilder`` to shape its tree and keeps
KV until ``commit``) and the model-free suffix drafter (``SuffixDrafter``, which
shapes its own). ``TreeProposer`` treats them alike: one call per drafter for the
whole batch, then each request alone if that call fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedtree.request import Request
from pagedtree.speculative.drafting.builders import TreeBuilder
from pagedtree.speculative.tree import TokenTree


@dataclass(slots=True)
class Drafted:
    """What one ``propose`` call grew: a tree per request that got one, and each
    draft forward it ran as ``(tokens, seconds)`` for the cost model (measured
    without a sync of its own; a forward left unmeasured is not listed)."""

    trees: dict[str, TokenTree] = field(default_factory=dict)
    forwards: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class DraftJob:
    """One request to draft for this step: its node budget, and for a draft model the
    builder that shapes its tree."""

    request: Request
    builder: TreeBuilder | None
    budget: int = 0


class Drafter(Protocol):
    """A source of draft trees (see module docstring)."""

    name: str
    needs_builder: bool  # whether each job must carry a TreeBuilder

    def propose(self, jobs: Sequence[DraftJob]) -> Drafted:
        """A tree for each job that gets one, by request id, and the forwards run."""

    def release(self, request_id: str) -> None:
        """Forget what is held for a request (finished, preempted, failed)."""
