"""FCFS continuous batching under a token budget, with chunked prefill and preemption."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedtree.request import Request, RequestStatus
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.scheduler.plan import Phase, ScheduledChunk, StepPlan


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, got {self.max_num_batched_tokens}"
            )


class Scheduler:
    """Decides, each step, which requests compute which tokens.

    Running requests go first, in arrival order; each computes all its uncomputed
    tokens (one for a decoding request, the rest of its prompt for a prefilling one)
    as far as the token budget allows. Waiting requests are then admitted in FCFS
    order while the budget, ``max_num_seqs`` and free blocks allow. When a running
    request cannot get a block, the most recently admitted running request is
    preempted: its blocks are freed and it is recomputed later (its prefix blocks
    usually survive in the prefix cache).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
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

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End ``request`` with ``status`` and return its blocks to the pool."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        if self.block_manager.has_sequence(request.request_id):
            self.block_manager.free(request.request_id)
        request.status = status

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        """Plan one step within the token budget; reserve the KV slots it writes."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            # Slots up to request.num_tokens were reserved when the token was sampled
            # or at admission; a decode step needs a slot for the newest token.
            needed = request.num_computed_tokens + num_new - bm.num_tokens(request.request_id)
            while needed > 0 and not bm.can_append_slots(request.request_id, needed):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself; everyone after it is gone too
            if needed > 0:
                plan.block_copies.extend(bm.append_slots(request.request_id, needed))
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
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
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            plan.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return plan

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
    def update(self, plan: StepPlan) -> None:
        """Record what a step computed and make newly full blocks findable by prefix.

        The engine appends sampled tokens (and calls ``finish`` for requests that
        ended) before calling this.
        """
        bm = self.block_manager
        bs = bm.block_size
        for chunk in plan.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue
            before = request.num_computed_tokens
            request.num_computed_tokens += chunk.num_tokens
            if request.num_computed_tokens // bs > before // bs:
                bm.cache_computed_blocks(
                    request.request_id, request.all_token_ids, request.num_computed_tokens
                )
