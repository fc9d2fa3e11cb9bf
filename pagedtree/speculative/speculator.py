"""Tree speculation for the step runner: propose, stage, accept, observe.

- ``propose(plan)``: the scheduler put decoding requests in the DRAFT phase with tree
  slots reserved; every draft model grows their trees (``TreeProposer``). Returns the
  trees, from which the step runner makes the VERIFY chunks.
- ``stage(chunks, trees, verify_logits)``: after the target's pass over every tree,
  decide each tree's row outcomes on the device, for the step's one readback.
- ``accept(chunks, trees, verified_rows)``: after the readback, accept a path per
  tree (``Verifier.walk``) and keep the drafts' KV of that path only. Returns the
  committed tokens, the accepted node counts and the KV slot moves (``Verified``).
- ``observe(plan, result, ...)``: every measurement the adaptive budget uses.

The scheduler asks ``budget`` (``BudgetPolicy``) for each step's node budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from pagedtree.distributed.group import TensorParallelError
from pagedtree.request import Request, RequestStatus
from pagedtree.speculative.budget.policy import BudgetPolicy
from pagedtree.config import SpeculativeConfig
from pagedtree.speculative.drafting.draft_worker import DraftWorker
from pagedtree.speculative.spec_counters import SpecMetrics
from pagedtree.speculative.noise import NoiseCache
from pagedtree.speculative.budget.priors import AcceptancePrior, acceptance_prior
from pagedtree.speculative.drafting.proposer import TreeProposer, proposal_rule
from pagedtree.speculative.drafting.suffix_drafter import SuffixConfig, SuffixDrafter
from pagedtree.speculative.tree import TokenTree
from pagedtree.speculative.verification.verifier import Verifier, tree_bitmasks_of
from pagedtree.step_data import Phase, ScheduledChunk, StepPlan, StepResult, Verified
from pagedtree.sampling import DeviceRows
from pagedtree.worker.step_output import HostRows

logger = logging.getLogger("pagedtree")


class Speculator:
    """Drafting, verification and measurements of tree speculation (see module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafts: Sequence[DraftWorker],
        vocab_size: int,
        device: torch.device | str = "cpu",
        prior: AcceptancePrior | None = None,
    ):
        if prior is None:
            prior = acceptance_prior(None, [d.name for d in drafts], config.drafter)
        suffix = SuffixDrafter(_suffix_config(config)) if config.drafter in ("suffix", "model+suffix") else None
        drafts = list(drafts)
        self.budget = BudgetPolicy(
            config, prior, num_drafts=len(drafts),
            suffix_reach=suffix.reach if suffix is not None and not drafts else None,
            suffix_tree=suffix.plan_tree if suffix is not None and drafts else None,
            suffix_match=suffix.match_length if suffix is not None else None,
            draft_backlog=(lambda request: max(d.backlog(request) for d in drafts)) if drafts else None,
        )
        noise = NoiseCache(vocab_size, device)
        self.proposer = TreeProposer(drafts, self.budget, noise, suffix)
        self.verifier = Verifier(noise, device)
        self.metrics = SpecMetrics()
        self._noise = noise
        self._sized_for_nodes = config.max_nodes
        # The suffix drafter, also while ``reconfigure`` has it sit out (then the
        # proposer has none): switched back on, it still knows recent outputs.
        self._suffix = suffix

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

        ``max_nodes`` may not exceed the one the drafts' caches were sized for. Beside
        draft models the suffix drafter can be switched on and off (``drafter``
        "model" or "model+suffix"); an engine without draft models keeps "suffix".
        """
        if config.max_nodes > self._sized_for_nodes:
            raise ValueError(f"max_nodes {config.max_nodes} > {self._sized_for_nodes} the draft caches were sized for")
        allowed = ("model", "model+suffix") if self.drafts else ("suffix",)
        if config.drafter not in allowed:
            raise ValueError(f"drafter {config.drafter!r} needs {'no ' if self.drafts else ''}draft models; "
                             f"this engine takes {' or '.join(allowed)}")
        if self.drafts:
            suffix = self._switched_suffix(config)
            self.proposer.set_suffix(suffix)
            self.budget.suffix_tree = suffix.plan_tree if suffix is not None else None
            self.budget.suffix_match = suffix.match_length if suffix is not None else None
        self.budget.reconfigure(config)

    def _switched_suffix(self, config: SpeculativeConfig) -> SuffixDrafter | None:
        """The suffix drafter beside the draft models under ``config`` (None: none): the
        last one while its settings stay, a new one if they change."""
        if config.drafter == "model":
            return None
        wanted = _suffix_config(config)
        if self._suffix is None or self._suffix.config != wanted:
            self._suffix = SuffixDrafter(wanted)
        return self._suffix

    # ----------------------------------------------------------------- step
    def propose(self, plan: StepPlan) -> dict[str, TokenTree]:
        """The trees of the plan's DRAFT chunks (a request whose drafting failed has
        none and decodes plainly); first releases what preempted requests held."""
        for request in plan.preempted:
            self.release(request.request_id)
        self._noise.clear()
        self.proposer.last_draft_seconds = 0.0
        drafting = [c for c in plan.chunks if c.phase == Phase.DRAFT]
        if not drafting:
            return {}
        try:
            # Failures of single requests are handled inside (they decode plainly).
            trees = self.proposer.propose([(c.request, c.tree_budget) for c in drafting])
        except TensorParallelError:
            raise  # a rank is gone: the engine stops
        except Exception as exc:  # noqa: BLE001 - a bug in drafting must not lose the step
            logger.exception("drafting failed (%s: %s); decoding this step without speculation",
                             type(exc).__name__, exc)
            for chunk in drafting:
                self.proposer.release(chunk.request.request_id)
            trees = {}
        self.metrics.tree_sizes_per_step.append(sum(t.num_nodes for t in trees.values()))
        return trees

    @property
    def last_draft_seconds(self) -> float:
        """Time the draft models' forwards took in the last ``propose``."""
        return self.proposer.last_draft_seconds

    def stage(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
              verify_logits: Mapping[str, torch.Tensor]) -> tuple[dict[str, DeviceRows], list[tuple[Request, Exception]]]:
        """Decide the VERIFY ``chunks``' row outcomes from the target's logits, on the
        device (``Verifier.row_outcomes``), for the step's one readback: the rows by
        request id, and the requests whose staging raised (to fail alone)."""
        rows: dict[str, DeviceRows] = {}
        failed = []
        try:  # every constrained tree's masks in one fill; on failure each request fills its own
            masks = tree_bitmasks_of([c.request for c in chunks if c.request.request_id in verify_logits], trees)
        except Exception:  # noqa: BLE001 - the per-request fill below fails only its request
            masks = {}
        for chunk in chunks:
            request = chunk.request
            logits = verify_logits.get(request.request_id)
            if logits is None:  # failed in the forward
                continue
            try:
                rows[request.request_id] = self.verifier.row_outcomes(
                    request, trees[request.request_id], logits, proposal_rule(request, self.config),
                    masks.get(request.request_id))
            except Exception as exc:  # noqa: BLE001 - fail this request, not the batch
                failed.append((request, exc))
        return rows, failed

    def accept(self, chunks: Sequence[ScheduledChunk], trees: dict[str, TokenTree],
               verified_rows: Mapping[str, HostRows]) -> Verified:
        """Accept a path of every staged tree from its rows read back: the committed
        tokens, accepted node counts and slot moves, and the requests whose walk raised."""
        out = Verified()
        for chunk in chunks:
            request = chunk.request
            rid = request.request_id
            staged = verified_rows.get(rid)
            if staged is None:  # failed in the forward or in staging
                continue
            tree = trees[rid]
            try:
                verified = self.verifier.walk(tree, *staged)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the batch
                out.failed.append((request, exc))
                continue
            out.slot_moves += chunk.accepted_slot_moves(verified.accepted_nodes)
            out.accepted[rid] = verified.num_accepted
            out.committed[rid] = verified.committed
            self.proposer.commit(rid, [token for token, _, _ in verified.committed[:-1]])
            self.metrics.record(request, tree, verified)
            if rid not in self.proposer.forced:
                # Tokens a grammar forced are accepted almost always: counted, they
                # would tell the budget the drafts do better than they do.
                self.budget.observe_verification(request, verified.trials)
        return out

    def observe(self, plan: StepPlan, result: StepResult, step_seconds: float, queue_empty: bool) -> None:
        """Take the step's measurements (target cost, host overhead, requests that did
        not verify a tree) and register the drafts' newly full blocks for prefix reuse.
        ``plan`` is the scheduler's (DRAFT chunks, before their trees)."""
        self.budget.target_cost.observe(plan.num_tokens + result.num_tree_nodes, result.forward_seconds)
        failed = {r.request_id for r, _ in result.failed}
        plain = [c.request.request_id for c in plan.chunks
                 if (c.phase == Phase.DECODE or (c.phase == Phase.DRAFT and c.request.request_id not in result.accepted))
                 and c.request.request_id not in failed]
        self.budget.observe_no_verification(plain)
        for chunk in plan.chunks:
            if chunk.request.request_id in result.accepted and chunk.request.status == RequestStatus.RUNNING:
                self.proposer.cache_blocks(chunk.request)
        decode_only = all(c.phase in (Phase.DECODE, Phase.DRAFT) for c in plan.chunks)
        if decode_only and queue_empty and plan.chunks:
            host = step_seconds - result.forward_seconds - result.draft_seconds
            self.budget.observe_host(host, len(plan.chunks), len(result.accepted))
            self.budget.observe_step_seconds(step_seconds)

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

    def request_metrics(self, requests: Sequence[Request]) -> dict[str, float]:
        """Drafts, draft tokens and accepted tokens over a user request's sequences,
        and their mean acceptance length (1 + accepted per draft; 0 without a draft)."""
        drafts = sum(r.spec_num_drafts for r in requests)
        accepted = sum(r.spec_num_accepted_tokens for r in requests)
        return {
            "spec_num_drafts": float(drafts),
            "spec_num_draft_tokens": float(sum(r.spec_num_draft_tokens for r in requests)),
            "spec_num_accepted_tokens": float(accepted),
            "spec_mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        }

    def stats(self) -> dict[str, object]:
        """Speculation counters for ``LLM.stats()``."""
        bms = [d.block_manager for d in self.drafts]
        suffix = self.proposer.suffix.stats() if self.proposer.suffix is not None else {}
        if suffix and self.drafts:
            suffix["suffix_num_alone"] = self.proposer.num_suffix_alone
        if suffix:
            # The first proposal's acceptance after a match of each length bucket.
            suffix["suffix_match_rates"] = {f"{cls}@{bucket}": table.rate(1, 0) for (cls, bucket), table
                                            in self.budget.suffix_acceptance.tables.items()}
        return self.metrics.stats() | suffix | {
            "num_draft_forward_passes": sum(d.num_forward_passes for d in self.drafts),
            "num_steps_speculation_off": self.budget.num_steps_speculation_off,
            "last_tree_budget": self.budget.last_budget,
            "rank_acceptance_rates": list(self.budget.rank_acceptance.rates()),
            "acceptance_rates_by_depth": {c: t.rows() for c, t in self.budget.tables.items()},
            # Per class: accepted over expected tokens of the draft trees the plan chose.
            "plan_acceptance_factor": {c: cal.factor for c, cal in self.budget.calibration.items()},
            "draft_num_total_blocks": sum(bm.num_blocks for bm in bms),
            "draft_num_free_blocks": sum(bm.num_free_blocks for bm in bms),
            "draft_num_cached_blocks": sum(bm.num_cached_blocks for bm in bms),
            "num_forced_tokens": self.proposer.num_forced_tokens,
        }


def _suffix_config(config: SpeculativeConfig) -> SuffixConfig:
    """The suffix drafter's sizes from ``config``'s ``suffix_*`` fields."""
    return SuffixConfig(
        max_depth=2 * config.suffix_max_match, max_match=config.suffix_max_match, min_match=config.suffix_min_match,
        alpha=config.suffix_alpha, min_prob=config.suffix_min_prob, global_tokens=config.suffix_global_tokens,
    )
