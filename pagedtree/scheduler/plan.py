"""The per-step plan handed from the scheduler to the workers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedtree.request import Request
from pagedtree.scheduler.block_manager import BlockCopy


class Phase(enum.Enum):
    """What a request does in one step. Different requests mix phases in one step."""

    PREFILL = "prefill"  # computing prompt (or recomputed) tokens, possibly a chunk
    DECODE = "decode"  # computing the last token and sampling the next
    DRAFT = "draft"  # draft-model tree expansion (tree speculation)
    VERIFY = "verify"  # target-model verification of a token tree (tree speculation)


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: a run of new tokens whose KV the step computes.

    ``positions`` are rotary positions (for a token tree: prefix length + depth);
    ``slot_mapping`` are the physical KV slots they are written to. ``context_len``
    is how many KV entries the request can see once this step has written its
    tokens. ``tree_parents`` (index of each new token's parent among the new
    tokens, -1 for a root attached to the prefix) replaces the causal mask among
    the new tokens when set. ``logits_from`` is the first of the new tokens whose
    logits the step must produce (None: none, e.g. a prefill chunk that does not
    reach the end of the prompt).

    A decoding request that may speculate is scheduled in the DRAFT phase with
    ``tree_budget`` slots reserved after its newest token; once its tree is drafted
    the scheduler turns the chunk into a VERIFY chunk holding ``[root] + tree``.
    """

    request: Request
    phase: Phase
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_table: list[int]
    context_len: int
    logits_from: int | None
    tree_parents: list[int] | None = None
    tree_budget: int = 0
    num_accepted: int = 0  # VERIFY: tree nodes accepted (set by Scheduler.commit_tree)

    @property
    def num_tokens(self) -> int:
        """How many new tokens this chunk computes."""
        return len(self.token_ids)


@dataclass(slots=True)
class SlotMove:
    """Copy one token's KV from slot ``src`` to slot ``dst`` in every layer."""

    src: int
    dst: int


@dataclass(slots=True)
class StepPlan:
    """Everything one engine step runs: the block copies to do before the forward,
    the chunks, and (after verification) the slot moves that put accepted tree paths
    in sequence order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    slot_moves: list[SlotMove] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total new tokens in the step (the token budget used)."""
        return sum(c.num_tokens for c in self.chunks)

    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.chunks
