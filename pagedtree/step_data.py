"""The data one engine step passes along: plan, attention metadata, result.

A step is three calls (``LLMEngine.step``): the scheduler returns a ``StepPlan``;
the step runner turns it into a ``StepResult`` (drafting token trees, one forward,
one device readback, verification); the engine and the scheduler update requests
and KV bookkeeping from that result. Everything here is plain data with no behaviour
beyond small pure helpers, so every layer may import it. (What a forward leaves on
the device until its readback is ``worker.step_output.StepOutput``.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pagedtree.request import Request

if TYPE_CHECKING:
    from collections.abc import Sequence

# (token, logprob, top_logprobs) of one committed token.
Committed = tuple[int, float, "dict[int, float] | None"]


class Phase(enum.Enum):
    """What a request does in one step. Different requests mix phases in one step."""

    PREFILL = "prefill"  # computing prompt (or recomputed) tokens, possibly a chunk
    DECODE = "decode"  # computing the last token and sampling the next
    DRAFT = "draft"  # a decode with slots reserved for a token tree (tree speculation)
    VERIFY = "verify"  # target-model verification of a drafted token tree


@dataclass(slots=True)
class BlockCopy:
    """A copy-on-write order for the worker: copy all slots of ``src`` into ``dst``."""

    src: int
    dst: int


@dataclass(slots=True)
class SlotMove:
    """Copy one token's KV from slot ``src`` to slot ``dst`` in every layer."""

    src: int
    dst: int


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
    ``tree_budget`` slots reserved after its newest token (``tree_slots``); once
    its tree is drafted, ``with_tree`` makes the VERIFY chunk of ``[root] + tree``.

    A decode scheduled ahead (``pending_tokens`` 1) holds a stand-in for its one
    input token: the step that drew it has not been read back, and the model runner
    feeds the drawn token from the device (``token_sources``).
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
    tree_slots: list[int] = field(default_factory=list)  # DRAFT: the reserved slots, in order
    # Tokens of the request the host does not have yet: a decode scheduled one step
    # ahead (``Scheduler.schedule_ahead``) takes its input token from the device,
    # and its draw is that many output positions further on.
    pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """How many new tokens this chunk computes."""
        return len(self.token_ids)

    def with_tree(self, tokens: Sequence[int], parents: Sequence[int], depths: Sequence[int]) -> ScheduledChunk:
        """The chunk that verifies a drafted tree: ``[root] + tokens`` at positions
        ``root + depth`` in the reserved slots (``parents`` index the tree's nodes,
        -1 = child of the root); an empty tree leaves a plain DECODE chunk. The
        reserved slots a smaller tree leaves unused are released by the scheduler's
        ``update``."""
        if self.phase != Phase.DRAFT:
            raise ValueError(f"with_tree needs a DRAFT chunk, got {self.phase}")
        num_nodes = len(tokens)
        if num_nodes > self.tree_budget:
            raise ValueError(f"tree of {num_nodes} nodes exceeds the reserved {self.tree_budget}")
        if not num_nodes:
            return replace(self, phase=Phase.DECODE, tree_budget=0, tree_slots=[])
        root = self.positions[0]
        return replace(
            self,
            phase=Phase.VERIFY,
            token_ids=[self.token_ids[0], *tokens],
            positions=[root] + [root + d for d in depths],
            slot_mapping=self.slot_mapping[:1] + self.tree_slots[:num_nodes],
            context_len=self.context_len + num_nodes,
            tree_parents=[-1] + [p + 1 for p in parents],
            logits_from=0,
            tree_budget=num_nodes,
            tree_slots=[],
        )

    def accepted_slot_moves(self, accepted_nodes: Sequence[int]) -> list[SlotMove]:
        """The KV moves that put a verified tree's accepted path (node indices, in
        depth order) in the slots right after the root."""
        if self.phase != Phase.VERIFY:
            raise ValueError(f"accepted_slot_moves needs a VERIFY chunk, got {self.phase}")
        moves = []
        for depth, node in enumerate(accepted_nodes, start=1):
            src, dst = self.slot_mapping[1 + node], self.slot_mapping[depth]
            if src != dst:  # a chain's accepted prefix is already in place
                moves.append(SlotMove(src, dst))
        return moves


@dataclass(slots=True)
class StepPlan:
    """What the scheduler decided for one step: the block copies to do before the
    forward, the chunks, and the requests it preempted."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Total new tokens in the step (the token budget used)."""
        return sum(c.num_tokens for c in self.chunks)

    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.chunks


@dataclass(slots=True)
class AttentionMetadata:
    """How the step's flat run of query tokens maps onto requests and the paged cache."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B] KV entries each request sees after this step's writes
    block_tables: list[list[int]]  # [B][num_blocks of the request]
    tree_parents: list[list[int] | None]  # [B] None = causal among the new tokens
    # (min, max) of slot_mapping, known on the host to whoever built it: the range
    # check then needs no read of the device tensor.
    slot_bounds: tuple[int, int] | None = None


@dataclass(slots=True)
class Verified:
    """What verification decided for a step's trees: the tokens each request
    commits (its accepted path, then the target's own token), the accepted node
    count, the KV moves that put each accepted path in place, and the requests whose
    verification raised (to fail alone)."""

    committed: dict[str, list[Committed]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    slot_moves: list[SlotMove] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What one step decided, on the host: the engine appends ``committed`` tokens
    (in order, each checked for stops), fails ``failed`` requests alone, and the
    scheduler keeps ``1 + accepted[rid]`` new KV entries of each request that
    verified a tree (``slot_moves`` have already put its accepted path in place)."""

    committed: dict[str, list[Committed]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    slot_moves: list[SlotMove] = field(default_factory=list)
    num_tree_nodes: int = 0  # tree nodes verified in the step
    forward_seconds: float = 0.0  # the target's forward, up to its one readback
    draft_seconds: float = 0.0  # the draft models' forwards

    def fail(self, request: Request, exc: Exception) -> None:
        """Record a request that must fail alone."""
        self.failed.append((request, exc))


@dataclass(frozen=True, slots=True)
class StaticShape:
    """A step padded to a fixed shape, whose plan must sit at the same addresses and
    pick the same kernels every time (a CUDA graph replays its launches): ``bucket``
    requests of ``tokens`` new tokens each (the caller pads the step), block tables
    ``max_blocks`` wide, a tree-mask section for every token when ``tokens > 1``
    (whether or not the step has trees), and every buffer in slots of its own shape
    but the block tables: the first ``bucket`` rows of one persistent device table
    of ``table_rows`` rows (the largest bucket; 0: ``bucket``) shared by every shape
    of that width (``DeviceBlockTables``)."""

    bucket: int
    max_blocks: int
    tokens: int = 1
    table_rows: int = 0

    @property
    def tag(self) -> str:
        """Suffix of this shape's buffer slots."""
        return f":b{self.bucket}t{self.tokens}"
