"""Tree speculation as the engine sees it: four calls per step.

- ``draft(plan)``: the scheduler put decoding requests in the DRAFT phase with tree
  slots reserved; every draft model grows their trees (``TreeProposer``) and the
  scheduler attaches them, turning DRAFT chunks into VERIFY chunks.
- ``stage_verify(plan, step_output)``: after the target's pass over every tree,
  decide each tree's row outcomes on the device, for the step's one readback.
- ``verify(plan, step_output)``: after the readback, accept a path per request
  (``Verifier.walk``), have the scheduler record the KV slot moves that
  put the accepted path in sequence order (``Scheduler.commit_tree``, into the
  plan), and keep the drafts' KV of that path only. Returns the committed tokens.
- ``end_step(...)``: every measurement the adaptive budget uses.

Between steps, ``choose_budget`` picks the next step's node budget per request
(``BudgetPolicy``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.distributed.group import TensorParallelError
from pagedtree.request import Request, RequestStatus
from pagedtree.scheduler.plan import Phase, StepPlan
from pagedtree.scheduler.scheduler import Scheduler
from pagedtree.speculative.budget import BudgetPolicy
from pagedtree.config import SpeculativeConfig
from pagedtree.speculative.draft_worker import DraftWorker
from pagedtree.speculative.metrics import SpecMetrics
from pagedtree.speculative.noise import NoiseCache
from pagedtree.speculative.presets import AcceptancePrior, acceptance_prior
from pagedtree.speculative.proposer import TreeProposer, proposal_rule
from pagedtree.speculative.suffix_drafter import SuffixConfig, SuffixDrafter
from pagedtree.speculative.tree import TokenTree
from pagedtree.speculative.verifier import Verifier
from pagedtree.worker.model_runner import StepOutput

logger = logging.getLogger("pagedtree")

# (token, logprob, top_logprobs) of one committed token.
Committed = tuple[int, float, "dict[int, float] | None"]


@dataclass(slots=True)
class VerifyOutput:
    """What ``verify`` decided: committed tokens per request, and requests whose
    verification raised (the engine fails them alone)."""

    committed: dict[str, list[Committed]] = field(default_factory=dict)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)


class Speculator:
    """Drafting, verification and measurements of tree speculation (see module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafts: Sequence[DraftWorker],
        scheduler: Scheduler,
        vocab_size: int,
        device: torch.device | str = "cpu",
        prior: AcceptancePrior | None = None,
    ):
        self.scheduler = scheduler
        if prior is None:
            prior = acceptance_prior(None, [d.name for d in drafts], config.drafter)
        self.budget = BudgetPolicy(config, prior, num_drafts=len(drafts))
        noise = NoiseCache(vocab_size, device)
        suffix = None
        if config.drafter in ("suffix", "model+suffix"):
            suffix = SuffixDrafter(SuffixConfig(
                max_depth=2 * config.suffix_max_match, max_match=config.suffix_max_match,
                alpha=config.suffix_alpha, min_prob=config.suffix_min_prob,
                global_tokens=config.suffix_global_tokens,
            ))
        self.proposer = TreeProposer(drafts, self.budget, noise, suffix)
        if suffix is not None and not drafts:
            self.budget.suffix_reach = suffix.reach
        if suffix is not None and drafts:
            self.budget.suffix_tree = lambda request: suffix.plan_tree(request, self.config.max_nodes)
        if drafts:
            self.budget.draft_backlog = lambda request: max(d.backlog(request) for d in self.drafts)
        self.verifier = Verifier(noise, device)
        self.metrics = SpecMetrics()
        self._noise = noise
        self._sized_for_nodes = config.max_nodes
        self._trees: dict[str, TokenTree] = {}
        self._failed: list[tuple[Request, Exception]] = []

    @property
    def config(self) -> SpeculativeConfig:
        """The tree settings in force."""
        return self.budget.config

    @property
    def drafts(self) -> list[DraftWorker]:
        """The draft workers."""
        return self.proposer.drafts

    def reconfigure(self, config: SpeculativeConfig) -> None:
        """Switch tree settings between runs (benchmarks sweep them on one engine).

        ``max_nodes`` may not exceed the one the drafts' caches were sized for.
        """
        if config.max_nodes > self._sized_for_nodes:
            raise ValueError(f"max_nodes {config.max_nodes} > {self._sized_for_nodes} the draft caches were sized for")
        self.budget.reconfigure(config)

    def choose_budget(self, decoding: Sequence[Request], other_tokens: int) -> dict[str, int]:
        """Node budget per decoding request for the next step (0 = decode without
        speculation), given the prefill tokens that ride along."""
        return self.budget.choose(decoding, other_tokens)

    # ----------------------------------------------------------------- step
    def draft(self, plan: StepPlan) -> None:
        """Grow the trees of the plan's DRAFT chunks and attach them (see module docstring)."""
        for request in plan.preempted:
            self.release(request.request_id)
        self._noise.clear()
        self._trees = {}
        self.proposer.last_draft_seconds = 0.0
        drafting = [c for c in plan.chunks if c.phase == Phase.DRAFT]
        if not drafting:
            return
        try:
            # Failures of single requests are handled inside (they decode plainly).
            trees = self.proposer.propose([(c.request, c.tree_budget) for c in drafting])
        except TensorParallelError:
            raise  # a rank is gone: the engine stops (LLMEngine._execute)
        except Exception as exc:  # noqa: BLE001 - a bug in drafting must not lose the step
            logger.exception("drafting failed (%s: %s); decoding this step without speculation",
                             type(exc).__name__, exc)
            for chunk in drafting:
                self.proposer.release(chunk.request.request_id)
            trees = {}
        for chunk in drafting:
            tree = trees.get(chunk.request.request_id)
            if tree is None:
                self.scheduler.attach_tree(chunk, chunk.token_ids[0], [], [], [])
            else:
                self.scheduler.attach_tree(chunk, tree.root_token, tree.tokens, tree.parents, tree.depths)
        self._trees = trees
        self.metrics.tree_sizes_per_step.append(sum(t.num_nodes for t in trees.values()))

    def stage_verify(self, plan: StepPlan, step: StepOutput) -> None:
        """Decide every VERIFY chunk's row outcomes from the target's logits, on the
        device (``Verifier.row_outcomes``), into ``step.verify_rows`` for the step's
        one readback. A request whose staging raises is failed alone by ``verify``."""
        self._failed = []
        for chunk in plan.chunks:
            if chunk.phase != Phase.VERIFY:
                continue
            request = chunk.request
            logits = step.verify_logits.get(request.request_id)
            if logits is None or request.status.finished:  # failed in the forward
                continue
            try:
                step.verify_rows[request.request_id] = self.verifier.row_outcomes(
                    request, self._trees[request.request_id], logits, proposal_rule(request, self.config))
            except Exception as exc:  # noqa: BLE001 - fail this request, not the batch
                self._failed.append((request, exc))

    def verify(self, plan: StepPlan, step: StepOutput) -> VerifyOutput:
        """Accept a path of every staged tree from its rows read back, and commit it."""
        out = VerifyOutput(failed=self._failed)
        self._failed = []
        for chunk in plan.chunks:
            if chunk.phase != Phase.VERIFY:
                continue
            request = chunk.request
            rid = request.request_id
            staged = step.verified_rows.get(rid)
            if staged is None or request.status.finished:  # failed in the forward or in staging
                self.release(rid)
                continue
            tree = self._trees[rid]
            try:
                verified = self.verifier.walk(tree, *staged)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the batch
                out.failed.append((request, exc))
                continue
            self.scheduler.commit_tree(plan, chunk, verified.result.accepted_nodes)
            self.proposer.commit(rid, verified.token_ids[:-1])
            self.metrics.record(request, tree, verified.result)
            self.budget.observe_verification(request, verified.result.trials)
            out.committed[rid] = verified.entries()
        return out

    def end_step(self, plan: StepPlan, committed: dict[str, list[Committed]], forward_seconds: float,
                 step_seconds: float, queue_empty: bool) -> None:
        """Take the step's measurements (target cost, host overhead, requests that did
        not verify a tree) and register the drafts' newly full blocks for prefix reuse."""
        self.budget.target_cost.observe(plan.num_tokens, forward_seconds)
        plain = [c.request.request_id for c in plan.chunks if c.phase == Phase.DECODE]
        self.budget.observe_no_verification(plain)
        for chunk in plan.chunks:
            if chunk.phase == Phase.VERIFY and chunk.request.status == RequestStatus.RUNNING:
                self.proposer.cache_blocks(chunk.request)
        decode_only = all(c.phase in (Phase.DECODE, Phase.VERIFY) for c in plan.chunks)
        if decode_only and queue_empty and plan.chunks:
            host = step_seconds - forward_seconds - self.proposer.last_draft_seconds
            self.budget.observe_host(host, len(plan.chunks), len(committed))
            self.budget.observe_step_seconds(step_seconds)
        self._trees = {}

    def finish(self, request: Request) -> None:
        """A request ended: the suffix drafter remembers a completed output, then
        everything speculation holds for the request is freed."""
        suffix = self.proposer.suffix
        if suffix is not None and request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            suffix.remember(request)
        self.release(request.request_id)

    def release(self, request_id: str) -> None:
        """Free everything speculation holds for a request (finished, preempted, failed)."""
        self.proposer.release(request_id)
        self.verifier.release(request_id)
        self.budget.release(request_id)

    def stats(self) -> dict[str, object]:
        """Speculation counters for ``LLM.stats()``."""
        bms = [d.block_manager for d in self.drafts]
        suffix = self.proposer.suffix.stats() if self.proposer.suffix is not None else {}
        if suffix and self.drafts:
            suffix["suffix_num_alone"] = self.proposer.num_suffix_alone
            suffix["suffix_plan_factor"] = self.budget.suffix_factor
        return self.metrics.stats() | suffix | {
            "num_draft_forward_passes": sum(d.num_forward_passes for d in self.drafts),
            "num_steps_speculation_off": self.budget.num_steps_speculation_off,
            "last_tree_budget": self.budget.last_budget,
            "rank_acceptance_rates": list(self.budget.rank_acceptance.rates()),
            "acceptance_rates_by_depth": {c: t.rows() for c, t in self.budget.tables.items()},
            "draft_num_total_blocks": sum(bm.num_blocks for bm in bms),
            "draft_num_free_blocks": sum(bm.num_free_blocks for bm in bms),
            "draft_num_cached_blocks": sum(bm.num_cached_blocks for bm in bms),
        }
