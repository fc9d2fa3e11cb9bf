"""FCFS continuous batching under a token budget, with chunked prefill and preemption."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from pagedtree.config import SchedulerConfig
from pagedtree.request import Request, RequestStatus
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.step_data import Phase, ScheduledChunk, StepPlan, StepResult


class TreeBudget(Protocol):
    """Chooses each decoding request's token-tree node budget for the next step
    (tree speculation's ``BudgetPolicy``)."""

    def choose(self, decoding: Sequence[Request], other_tokens: int) -> dict[str, int]:
        """Node budget per request id (missing or 0: decode plainly), given the
        decoding requests and the prefill tokens that ride along."""


class Scheduler:
    """Decides, each step, which requests compute which tokens.

    Running requests go first, in arrival order; each computes all its uncomputed
    tokens (one for a decoding request, the rest of its prompt for a prefilling one)
    as far as the token budget allows. Waiting requests are then admitted in FCFS
    order while the budget, ``max_num_seqs`` and free blocks allow. When a running
    request cannot get a block, the most recently admitted running request is
    preempted: its blocks are freed and it is recomputed later (its prefix blocks
    usually survive in the prefix cache).

    With a ``budget_policy``, decoding requests it gives nodes to are scheduled
    in the DRAFT phase with that many KV slots reserved for their token trees.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, budget_policy: TreeBudget | None = None):
        self.config = config
        self.block_manager = block_manager
        self.budget_policy = budget_policy  # None: no speculation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add_request(self, request: Request) -> None:
        """Queue a new request (FCFS)."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def check_progress(self, plan: StepPlan) -> None:
        """Raise if ``plan`` is empty while requests wait and none runs: cannot happen
        while max_model_len fits the cache; failing loudly beats a generate() that
        spins forever."""
        if plan.is_empty() and self.waiting and not self.running:
            raise RuntimeError(
                f"scheduler made no progress: {len(self.waiting)} waiting, "
                f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free"
            )

    def pending_load(self) -> tuple[list[Request], int]:
        """``(decoding requests, other tokens)`` the next step will see: requests with
        one token to compute (they may speculate) and prefill work, capped by the
        token budget. The speculation budgets are chosen from these."""
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1 and r.output_token_ids]
        pending = sum(r.num_tokens - r.num_computed_tokens for r in self.running) - len(decoding)
        pending += sum(r.num_tokens for r in self.waiting)
        return decoding, min(pending, self.config.max_num_batched_tokens)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` with ``status`` and return its blocks to the pool."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        # Tolerant of a request that is in neither queue (ended halfway through a
        # failed step): finishing must never raise, it is the recovery path.
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        if self.block_manager.has_sequence(request.request_id):
            self.block_manager.free(request.request_id)
        request.status = status

    # ---------------------------------------------------------------- schedule
    def schedule(self, node_budgets: int | Mapping[str, int] | None = None) -> StepPlan:
        """Plan one step within the token budget; reserve the KV slots it writes.

        ``node_budgets`` is a node budget for every decoding request, or one per
        request id (missing ids: 0); by default the ``budget_policy``'s choice
        (none: 0). A decoding request with a budget > 0 goes into the DRAFT phase
        with up to that many extra slots reserved for its token tree (fewer near its
        length limits or when blocks are short — a smaller tree is better than
        preempting someone). Tree nodes count against the token budget.
        """
        if node_budgets is None:
            node_budgets = self.budget_policy.choose(*self.pending_load()) if self.budget_policy is not None else 0
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:  # a prompt chunk needs more of the budget than is left
                index += 1
                continue
            wanted = node_budgets.get(request.request_id, 0) if isinstance(node_budgets, Mapping) else node_budgets
            nodes = self._nodes_for(request, wanted, budget - num_new) if num_new == 1 else 0
            # Slots up to the computed tokens exist; a decode step needs one for the
            # newest token (plus its tree's).
            needed = request.num_computed_tokens + num_new + nodes - bm.num_tokens(request.request_id)
            while nodes > 0 and not bm.can_append_slots(request.request_id, needed):
                nodes -= 1
                needed -= 1
            while needed > 0 and not bm.can_append_slots(request.request_id, needed):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself; everyone after it is gone too
            if needed > 0:
                plan.block_copies.extend(bm.append_slots(request.request_id, needed))
            chunk = self._chunk(request, num_new)
            if nodes > 0:
                chunk.phase = Phase.DRAFT
                chunk.tree_budget = nodes
                chunk.tree_slots = bm.slots(request.request_id, request.num_tokens, request.num_tokens + nodes)
            plan.chunks.append(chunk)
            budget -= num_new + nodes
            index += 1

        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and not plan.preempted  # admitting now would just thrash
        ):
            request = self.waiting[0]
            if not bm.can_allocate(request.all_token_ids):
                break
            if not self.config.enable_chunked_prefill and (
                request.num_tokens - self._cached_prefix_len(request) > budget
            ):
                break  # the whole uncached prompt must fit in this step
            self.waiting.popleft()
            request.num_cached_tokens = bm.allocate(request.request_id, request.all_token_ids)
            request.num_computed_tokens = request.num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:  # running now; its first chunk comes with the next step
                break
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return plan

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """The tokens ``request`` computes in a step with ``budget`` tokens left: all it
        has, or a prompt chunk that stops at a multiple of ``prompt_chunk_multiple``
        positions (0 where the budget does not reach the next one: a later step's
        does, unless the step budget itself is smaller than the multiple).

        Products whose kernel depends on how a chunk's rows group (ggml's repacked
        4-bit GEMM takes 4 rows at a time from the chunk's first, its tiled K-quant
        GEMM a product of 8 or more) then meet a prompt's rows the same way however
        the budget cut it, so its keys and values have the same bits whatever else
        shared its steps (speculation changes what does)."""
        computed = request.num_computed_tokens
        remaining = request.num_tokens - computed
        if remaining <= budget:
            return remaining
        multiple = self.config.prompt_chunk_multiple
        if self.config.max_num_batched_tokens < multiple:
            return budget
        return max(0, (computed + budget) // multiple * multiple - computed)

    def schedule_ahead(self, launched: StepPlan) -> StepPlan | None:
        """The next step of a batch that only decodes, planned before ``launched`` (a
        step on the device, not read back yet) has given its tokens to the host
        (vLLM's async scheduling): a one-token chunk per running request at the
        position after its token in flight, its input that token, fed from the device
        (``pending_tokens`` 1). A request whose token in flight is its last by
        ``max_tokens`` or the context limit gets none; one that stops on a token only
        the readback shows wastes its row, and ``update`` never counts it.

        None when the step must be planned the ordinary way, after the readback:
        speculation on, requests waiting, a running request without a draw in
        ``launched`` (one in the middle of its prompt), more requests than the token
        budget, or too few free blocks (preemption decides then)."""
        if self.budget_policy is not None or self.waiting:
            return None
        drawn = {c.request.request_id for c in launched.chunks
                 if c.logits_from is not None and c.phase in (Phase.DECODE, Phase.PREFILL)}
        if any(r.request_id not in drawn for r in self.running) or len(self.running) > self.config.max_num_batched_tokens:
            return None
        bm = self.block_manager
        ahead = []
        for request in self.running:
            params = request.params
            if request.num_tokens + 1 >= self.config.max_model_len or (
                    params.max_tokens is not None and len(request.output_token_ids) + 1 >= params.max_tokens):
                continue  # the token in flight ends it
            if bm.num_tokens(request.request_id) != request.num_tokens:
                return None  # not one slot per token so far: not a plain decode
            ahead.append(request)
        # Every append checked together before any is made: a copy-on-write order
        # made and then dropped would leave a block uncopied.
        if sum(bm.append_cost(r.request_id, 1) for r in ahead) > bm.num_free_blocks:
            return None
        plan = StepPlan()
        for request in ahead:
            position = request.num_tokens  # the token in flight's
            plan.block_copies.extend(bm.append_slots(request.request_id, 1))
            plan.chunks.append(ScheduledChunk(
                request=request, phase=Phase.DECODE, token_ids=[0], positions=[position],
                slot_mapping=bm.slots(request.request_id, position, position + 1),
                block_table=bm.block_table(request.request_id), context_len=position + 1, logits_from=0,
                pending_tokens=1,
            ))
        return plan

    def _nodes_for(self, request: Request, wanted: int, tokens_left: int) -> int:
        """Tree nodes a decoding request may verify this step (of ``wanted``)."""
        if wanted <= 0 or not request.output_token_ids:
            return 0
        nodes = min(wanted, tokens_left, self.config.max_model_len - request.num_tokens)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            # The step always adds the target's own token after the accepted nodes.
            nodes = min(nodes, max_tokens - len(request.output_token_ids) - 1)
        return max(nodes, 0)

    def _cached_prefix_len(self, request: Request) -> int:
        return len(self.block_manager.find_cached_prefix(request.all_token_ids)) * (
            self.block_manager.block_size
        )

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        finishes_sequence = end == request.num_tokens
        phase = Phase.DECODE if (num_new == 1 and request.output_token_ids) else Phase.PREFILL
        return ScheduledChunk(
            request=request,
            phase=phase,
            token_ids=request.token_ids_range(start, end),
            positions=list(range(start, end)),
            slot_mapping=self.block_manager.slots(request.request_id, start, end),
            block_table=self.block_manager.block_table(request.request_id),
            context_len=end,
            logits_from=num_new - 1 if finishes_sequence else None,
        )

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        plan.preempted.append(request)

    # ------------------------------------------------------------------ update
    def update(self, plan: StepPlan, result: StepResult | None = None) -> None:
        """Record what a step computed and make newly full blocks findable by prefix.

        The engine appends the committed tokens (and calls ``finish`` for requests
        that ended) before calling this. Of a DRAFT chunk, the newest token and the
        ``result.accepted`` tree nodes (already moved into sequence order) count as
        computed; the slots of rejected or unused tree nodes are released here.
        """
        bm = self.block_manager
        bs = bm.block_size
        accepted = result.accepted if result is not None else {}
        for chunk in plan.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue
            before = request.num_computed_tokens
            if chunk.phase == Phase.DRAFT:
                request.num_computed_tokens += 1 + accepted.get(request.request_id, 0)
                bm.truncate(request.request_id, request.num_computed_tokens)
            else:
                request.num_computed_tokens += chunk.num_tokens
            if request.num_computed_tokens // bs > before // bs:
                bm.cache_computed_blocks(
                    request.request_id, request.all_token_ids, request.num_computed_tokens
                )
