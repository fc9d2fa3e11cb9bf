"""The per-step tree budget: static from the config, or adaptive from measurements.

``BudgetPolicy`` owns what the adaptive mode measures (forward costs of the target
and of the drafts, per-rank acceptance, what each budget delivered, whole-step
rates) and the static shapes each budget stands for; the math is in ``adaptive``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedtree.speculative.adaptive import BudgetOutcome, CostModel, RankAcceptance, RealizedRates, choose_budget
from pagedtree.config import SpeculativeConfig
from pagedtree.speculative.sequoia import optimal_shape
from pagedtree.speculative.tree import TreeShape

# Re-derive Sequoia shapes from the measured rates after this many verifications.
_SEQUOIA_REFRESH = 64


class BudgetPolicy:
    """Chooses each step's node budget per request (0 = plain decoding)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.target_cost = CostModel()
        self.draft_cost = CostModel()
        self.rank_acceptance = RankAcceptance()
        self._shapes: dict[int, TreeShape] = {}
        self._outcomes: dict[int, BudgetOutcome] = {}
        self._realized = RealizedRates()
        self._verifications_since_refresh = 0
        self.num_steps_speculation_off = 0
        self.last_budget = config.max_nodes

    def reconfigure(self, config: SpeculativeConfig) -> None:
        """New tree settings: forget shapes and what budgets delivered (costs stay)."""
        self.config = config
        self._shapes.clear()
        self._outcomes.clear()
        self._realized = RealizedRates()

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

    def choose(self, num_decoding: int, other_tokens: int) -> int:
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

    def observe_step(self, budget: int, committed: Sequence[int], nodes: Sequence[int], levels: int, fed: int) -> None:
        """Record what one speculative step delivered for its budget (adaptive mode)."""
        if budget <= 0 or not committed:
            return
        n = len(committed)
        outcome = self._outcomes.get(budget)
        if outcome is None:
            outcome = self._outcomes[budget] = BudgetOutcome(0.0, 0.0, 0.0, 0.0)
        outcome.observe(sum(committed) / n, sum(nodes) / n, float(levels), fed / n)

    def observe_step_rate(self, num_decoding: int, budget: int, tokens: int, seconds: float) -> None:
        """Record a whole decode-only step: tokens committed and wall time."""
        if num_decoding > 0 and seconds > 0:
            self._realized.observe(num_decoding, budget, tokens / seconds)

    def observe_trials(self, rank_trials: Sequence[tuple[int, bool]]) -> None:
        """Per-rank acceptance of one verification; measured Sequoia shapes follow it."""
        self.rank_acceptance.observe(rank_trials)
        if self.config.tree in ("sequoia", "dynamic") and self.config.acceptance_rates is None:
            self._verifications_since_refresh += 1
            if self._verifications_since_refresh >= _SEQUOIA_REFRESH:
                self._verifications_since_refresh = 0
                self._shapes.clear()
