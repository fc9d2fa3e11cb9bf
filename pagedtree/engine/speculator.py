"""Tree speculation in the engine: budgets, drafting, verification, bookkeeping.

The engine asks the speculator for the step's tree budget before scheduling, hands
it the requests the scheduler put in the DRAFT phase, gets their token trees back
(built by every draft worker and merged), and after the target's verify pass asks
it which path of each tree was accepted. The speculator also keeps the metrics and
the measurements (forward costs, per-rank acceptance) the adaptive budget uses.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedtree.request import Request
from pagedtree.spec.adaptive import BudgetOutcome, CostModel, RankAcceptance, RealizedRates, choose_budget
from pagedtree.spec.builders import DynamicTreeBuilder, ShapeTreeBuilder, TreeBuilder
from pagedtree.spec.config import SpeculativeConfig
from pagedtree.spec.merge import merge_trees
from pagedtree.spec.sequoia import optimal_shape
from pagedtree.spec.tree import DETERMINISTIC_RULES, RANDOM_RULES, TokenTree, TreeShape
from pagedtree.spec.verify import VerifyResult, verify_greedy, verify_stochastic
from pagedtree.worker.draft_worker import DraftJob, DraftWorker
from pagedtree.worker.sampler import SamplingRow, apply_penalties, coupled_tokens, gumbel_noise, target_probs

logger = logging.getLogger("pagedtree")

# Re-derive Sequoia shapes from the measured rates after this many verifications.
_SEQUOIA_REFRESH = 64
# Per-step tree sizes kept for stats (bounded so long runs do not grow without end).
_TREE_SIZE_HISTORY = 10_000


class NoiseCache:
    """Seeded requests' Gumbel noise for one step, by (seed, output position).

    The draft proposes and the target verifies a position with the same noise;
    generating it (one uniform number per vocabulary entry) once per step serves both.
    """

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = device
        self._by_seed: dict[int, dict[int, torch.Tensor]] = {}

    def get(self, seed: int, position: int) -> torch.Tensor:
        """The noise of ``seed`` at output ``position`` (made on first use)."""
        per_position = self._by_seed.setdefault(seed, {})
        noise = per_position.get(position)
        if noise is None:
            noise = per_position[position] = gumbel_noise(seed, position, self.vocab_size, self.device)
        return noise

    def drop(self, seed: int) -> None:
        """Forget a seed's noise (its request has been verified)."""
        self._by_seed.pop(seed, None)

    def clear(self) -> None:
        """Forget everything (a new step)."""
        self._by_seed.clear()


def _log_draft_failure(draft: DraftWorker, request: Request, exc: Exception) -> None:
    logger.warning("%s failed for request %s (%s: %s); it decodes without speculation this step",
                   draft.name, request.request_id, type(exc).__name__, exc)


@dataclass(slots=True)
class VerifiedTokens:
    """What one verification commits: tokens in order, with their raw logprobs."""

    result: VerifyResult
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


class Speculator:
    """Drives the draft workers and verifies their trees (see module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafts: Sequence[DraftWorker],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ):
        if not drafts:
            raise ValueError("speculation needs at least one draft model")
        self.config = config
        self._noise = NoiseCache(vocab_size, device)
        self._sized_for_nodes = config.max_nodes
        self.drafts = list(drafts)
        self.target_cost = CostModel()
        self.draft_cost = CostModel()
        for draft in self.drafts:
            draft.on_forward = self.draft_cost.observe
        self.rank_acceptance = RankAcceptance()
        self._shapes: dict[int, TreeShape] = {}
        self._outcomes: dict[int, BudgetOutcome] = {}
        self._realized = RealizedRates()
        self._verifications_since_refresh = 0
        # Metrics (vLLM's names where vLLM has them).
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.tree_sizes_per_step: deque[int] = deque(maxlen=_TREE_SIZE_HISTORY)
        self.num_steps_speculation_off = 0
        self.last_budget = config.max_nodes
        self.last_levels = 0
        self.last_fed = 0

    def reconfigure(self, config: SpeculativeConfig) -> None:
        """Switch tree settings between runs (benchmarks sweep them on one engine).

        ``max_nodes`` may not exceed the one the drafts' caches were sized for.
        """
        if config.max_nodes > self._sized_for_nodes:
            raise ValueError(f"max_nodes {config.max_nodes} > {self._sized_for_nodes} the draft caches were sized for")
        self.config = config
        self._shapes.clear()
        self._outcomes.clear()
        self._realized = RealizedRates()

    # --------------------------------------------------------------- budget
    def shape_for(self, budget: int) -> TreeShape:
        """The static shape used for a per-request budget (an estimate for dynamic trees)."""
        cfg = self.config
        shape = self._shapes.get(budget)
        if shape is None:
            if cfg.tree == "static":
                shape = TreeShape.from_expansion(cfg.expansion, budget)
            elif cfg.tree == "chain":
                shape = TreeShape.chain(min(cfg.depth, budget))
            else:  # sequoia, and the cost estimate of a dynamic tree
                shape = optimal_shape(self._rates(), budget, cfg.depth)
            self._shapes[budget] = shape
        return shape

    def _rates(self) -> tuple[float, ...]:
        return self.config.acceptance_rates or self.rank_acceptance.rates()

    def candidate_budgets(self) -> list[int]:
        """The budgets the adaptive mode chooses among (besides 0): halvings of max_nodes."""
        top = self.config.max_nodes
        return sorted({top, max(1, top // 2), max(1, top // 4)})

    def choose_budget(self, num_decoding: int, other_tokens: int) -> int:
        """Node budget per request for the next step (0 = decode without speculation)."""
        cfg = self.config
        if num_decoding == 0 or not cfg.adaptive:
            budget = cfg.max_nodes
        else:
            outcomes = {
                b: self._outcomes.get(b) or BudgetOutcome.prior(self.shape_for(b), self._rates())
                for b in self.candidate_budgets()
            }
            choice = choose_budget(num_decoding, other_tokens, outcomes, self.target_cost, self.draft_cost)
            budget = choice.budget
            if other_tokens == 0:
                # Where whole steps were timed at this batch size, believe them over the
                # model: it misses per-step overheads (verification, tree building).
                budget = self._realized.best(num_decoding, choice.expected_tokens_per_second, budget)
        if budget == 0 and num_decoding:
            self.num_steps_speculation_off += 1
        self.last_budget = budget
        return budget

    def observe_step_rate(self, num_decoding: int, budget: int, tokens: int, seconds: float) -> None:
        """Record a whole decode-only step: tokens committed and wall time."""
        if num_decoding > 0 and seconds > 0:
            self._realized.observe(num_decoding, budget, tokens / seconds)

    def observe_step(self, budget: int, committed: Sequence[int], nodes: Sequence[int], levels: int, fed: int) -> None:
        """Record what one speculative step delivered for its budget (adaptive mode)."""
        if budget <= 0 or not committed:
            return
        n = len(committed)
        outcome = self._outcomes.get(budget)
        if outcome is None:
            outcome = self._outcomes[budget] = BudgetOutcome(0.0, 0.0, 0.0, 0.0)
        outcome.observe(sum(committed) / n, sum(nodes) / n, float(levels), fed / n)

    # -------------------------------------------------------------- drafting
    def rule_for(self, request: Request) -> str:
        """How this request's children are proposed, which fixes how they are verified.

        Greedy requests take the draft's top tokens; seeded sampling requests the
        coupled ones (top tokens under the seed's Gumbel noise, verified by the same
        noise, so their output depends on the seed alone); other sampling requests
        ``draft_sampling`` (dynamic trees: always top-k).
        """
        params = request.params
        if params.greedy:
            return "topk"
        if params.seed is not None:
            return "coupled"
        if self.config.tree == "dynamic":
            return "topk"
        return self.config.draft_sampling

    def _noise_for(self, request: Request):
        """Depth of the children to propose -> the request's noise at that position."""
        seed = request.sampling_seed
        root_position = len(request.output_token_ids) - 1  # the root is the newest output token
        return lambda depth: self._noise.get(seed, root_position + depth)

    def _builder(self, request: Request, budget: int, draft: DraftWorker) -> TreeBuilder:
        cfg = self.config
        params = request.params
        rule = self.rule_for(request)
        generator = draft.generator_for(request) if rule in RANDOM_RULES else None
        noise = self._noise_for(request) if rule == "coupled" else None
        root = request.output_token_ids[-1]
        if cfg.tree == "dynamic":
            return DynamicTreeBuilder(cfg.top_k, cfg.depth, budget, root, params, rule, noise)
        return ShapeTreeBuilder(self.shape_for(budget), root, params, rule, generator, noise)

    def shares(self, request: Request, budget: int) -> list[int]:
        """Each draft model's node budget for one request.

        Deterministic proposals can be pruned after merging, so every draft builds a
        full tree and the merge keeps the best nodes. Random draws cannot be pruned
        (that would bias them), so the budget is split and the merged tree fits by
        construction; a draft with a share of 0 sits this step out for the request.
        """
        n = len(self.drafts)
        if n == 1 or self.rule_for(request) in DETERMINISTIC_RULES:
            return [budget] * n
        base, extra = divmod(budget, n)
        return [base + (1 if i < extra else 0) for i in range(n)]

    def propose(self, requests_and_budgets: Sequence[tuple[Request, int]]) -> dict[str, TokenTree]:
        """Trees for the requests in the DRAFT phase, each within its node budget.

        A request whose drafting fails gets no tree (it decodes without speculation
        this step); the others are unaffected.
        """
        self._noise.clear()
        shares = {r.request_id: self.shares(r, budget) for r, budget in requests_and_budgets}
        per_draft: list[dict[str, TokenTree]] = []
        for index, draft in enumerate(self.drafts):
            wanted = [(r, shares[r.request_id][index]) for r, _ in requests_and_budgets]
            per_draft.append(self._propose_isolated(draft, [(r, s) for r, s in wanted if s > 0]))
        trees: dict[str, TokenTree] = {}
        for request, budget in requests_and_budgets:
            rid = request.request_id
            found = [d[rid] for d in per_draft if rid in d]
            if not found:
                continue
            try:
                tree = found[0] if len(found) == 1 and found[0].num_nodes <= budget else merge_trees(found, budget)
            except Exception as exc:  # noqa: BLE001 - this request decodes plainly, the others go on
                logger.warning("merging the drafts' trees of request %s failed (%s: %s); it decodes "
                               "without speculation this step", rid, type(exc).__name__, exc)
                for draft in self.drafts:
                    draft.commit(rid, [])
                continue
            trees[rid] = tree
        sizes = sum(t.num_nodes for t in trees.values())
        self.tree_sizes_per_step.append(sizes)
        self.last_levels = sum(d.last_levels for d in self.drafts)
        self.last_fed = sum(d.last_fed for d in self.drafts)
        return trees

    def _propose_isolated(self, draft: DraftWorker, wanted: list[tuple[Request, int]]) -> dict[str, TokenTree]:
        """``draft.propose`` for all of ``wanted`` at once; if that fails, for each
        request alone, so that a failure costs only the requests that fail."""
        if not wanted:
            return {}
        try:
            return draft.propose([DraftJob(r, self._builder(r, share, draft)) for r, share in wanted])
        except Exception as exc:  # noqa: BLE001
            if len(wanted) > 1:
                logger.warning("%s failed on a batch of %d requests (%s: %s); drafting them one by one",
                               draft.name, len(wanted), type(exc).__name__, exc)
            else:
                _log_draft_failure(draft, wanted[0][0], exc)
            for request, _ in wanted:
                draft.release(request.request_id)
            if len(wanted) == 1:
                return {}
        trees: dict[str, TokenTree] = {}
        for request, share in wanted:
            try:
                trees.update(draft.propose([DraftJob(request, self._builder(request, share, draft))]))
            except Exception as exc:  # noqa: BLE001
                _log_draft_failure(draft, request, exc)
                draft.release(request.request_id)
        return trees

    # ---------------------------------------------------------- verification
    def verify(
        self,
        request: Request,
        tree: TokenTree,
        logits: torch.Tensor,
        generator: torch.Generator | None,
    ) -> VerifiedTokens:
        """Accept a path of ``tree`` from the target's logits at every verify row."""
        params = request.params
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        rows = self._sampling_rows(request, tree, generator)
        processed = apply_penalties(logits.clone(), rows)
        rule = self.rule_for(request)
        if params.greedy:
            result = verify_greedy(tree, processed.argmax(dim=-1).tolist())
        elif rule == "coupled":
            # Row r's token is drawn at output position root + depth(r) + 1, with the
            # same noise plain decoding uses there.
            first = len(request.output_token_ids)
            noise = torch.stack([self._noise.get(request.sampling_seed, first + d) for d in [0] + tree.depths])
            result = verify_greedy(tree, coupled_tokens(target_probs(processed, params), noise).tolist())
            self._noise.drop(request.sampling_seed)
        else:
            result = verify_stochastic(tree, target_probs(processed, params), generator)
        tokens = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
        # Each token was drawn from the distribution at its parent's row.
        source_rows = [0] + [1 + n for n in result.accepted_nodes]
        chosen = raw_logprobs[torch.as_tensor(source_rows), torch.as_tensor(tokens)].tolist()
        tops: list[dict[int, float] | None] = []
        for row, token, lp in zip(source_rows, tokens, chosen):
            if params.logprobs is None:
                tops.append(None)
                continue
            top: dict[int, float] = {}
            if params.logprobs > 0:
                values, ids = torch.topk(raw_logprobs[row], params.logprobs)
                top = dict(zip(ids.tolist(), values.tolist()))
            top[token] = lp
            tops.append(top)
        self._record(request, tree, result)
        return VerifiedTokens(result, tokens, chosen, tops)

    def _sampling_rows(self, request: Request, tree: TokenTree, generator) -> list[SamplingRow]:
        """One sampling row per verify row: the history and output count the target
        would have at that node in plain decoding (for penalties and min_tokens)."""
        params = request.params
        needs_history = params.repetition_penalty != 1.0
        base = request.all_token_ids if needs_history else ()
        n_out = len(request.output_token_ids)
        rows = [SamplingRow(params, base, n_out, generator)]
        for node in range(tree.num_nodes):
            history = base
            if needs_history:
                history = list(base) + [tree.tokens[i] for i in tree.path_to(node)]
            rows.append(SamplingRow(params, history, n_out + tree.depths[node], generator))
        return rows

    def _record(self, request: Request, tree: TokenTree, result: VerifyResult) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += tree.num_nodes
        self.num_accepted_tokens += result.num_accepted
        while len(self.accepted_per_position) < result.num_accepted:
            self.accepted_per_position.append(0)
        for i in range(result.num_accepted):
            self.accepted_per_position[i] += 1
        request.spec_num_drafts += 1
        request.spec_num_draft_tokens += tree.num_nodes
        request.spec_num_accepted_tokens += result.num_accepted
        self.rank_acceptance.observe(result.rank_trials)
        if self.config.tree in ("sequoia", "dynamic") and self.config.acceptance_rates is None:
            self._verifications_since_refresh += 1
            if self._verifications_since_refresh >= _SEQUOIA_REFRESH:
                self._verifications_since_refresh = 0
                self._shapes.clear()

    # ------------------------------------------------------------ bookkeeping
    def commit(self, request: Request, accepted_tokens: Sequence[int]) -> None:
        """Every draft keeps the KV of the accepted path and frees its other branches."""
        for draft in self.drafts:
            draft.commit(request.request_id, accepted_tokens)

    def cache_blocks(self, request: Request) -> None:
        """Register the drafts' full computed blocks for prefix reuse."""
        tokens = request.all_token_ids
        for draft in self.drafts:
            draft.cache_blocks(request.request_id, tokens)

    def release(self, request_id: str) -> None:
        """Free a request's draft KV everywhere."""
        for draft in self.drafts:
            draft.release(request_id)

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """Record one target forward's cost."""
        self.target_cost.observe(num_tokens, seconds)

    def stats(self) -> dict[str, object]:
        """Speculation counters for ``LLM.stats()``."""
        drafts = max(self.num_drafts, 1)
        bms = [d.block_manager for d in self.drafts]
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_tokens_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if self.num_drafts else 0.0,
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "num_draft_forward_passes": sum(d.num_forward_passes for d in self.drafts),
            "tree_sizes_per_step": list(self.tree_sizes_per_step),
            "num_steps_speculation_off": self.num_steps_speculation_off,
            "last_tree_budget": self.last_budget,
            "rank_acceptance_rates": list(self.rank_acceptance.rates()),
            "draft_num_total_blocks": sum(bm.num_blocks for bm in bms),
            "draft_num_free_blocks": sum(bm.num_free_blocks for bm in bms),
            "draft_num_cached_blocks": sum(bm.num_cached_blocks for bm in bms),
        }

