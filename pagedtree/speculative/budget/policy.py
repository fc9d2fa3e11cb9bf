"""The per-request tree budgets of each step: static from the config, or adaptive.

``BudgetPolicy`` owns what the adaptive mode knows: the forward-cost curves of the
target and the drafts (calibrated at load, refined online), the host overhead, the
acceptance tables per request class (from a prior, refined online), each request's
own evidence, and the static shapes each budget stands for. The planning math is in
``adaptive``; acceptance in ``acceptance``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pagedtree.config import SpeculativeConfig
from pagedtree.request import Request
from pagedtree.speculative.budget.acceptance import (
    REQUEST_CLASSES,
    AcceptanceTable,
    PlanCalibration,
    RankAcceptance,
    RequestEvidence,
    request_class,
)
from pagedtree.speculative.budget.planner import (
    SPECULATE_MARGIN,
    BudgetPlan,
    CostModel,
    HostOverhead,
    StepCosts,
    fed_per_level,
    plan_budgets,
)
from pagedtree.speculative.budget.priors import AcceptancePrior
from pagedtree.speculative.budget.sequoia import optimal_shape
from pagedtree.speculative.budget.suffix_acceptance import SuffixAcceptance, best_shape
from pagedtree.speculative.tree import TokenTree, TreeShape

# Weight of each speculative step in the measured/predicted correction.
_FACTOR_EMA = 0.1
# Re-derive Sequoia shapes from the measured rates after this many verifications.
_SEQUOIA_REFRESH = 64

# request -> how many nodes the suffix drafter would propose for it now (its matched
# suffix times alpha; 0 when nothing matched).
SuffixReach = Callable[[Request], int]
# request -> how many tokens of its newest suffix the suffix drafter matched (0: none):
# what its trees' acceptance is priced by (``SuffixAcceptance``).
SuffixMatch = Callable[[Request], int]
# request -> tokens the draft models have yet to feed before drafting for it.
DraftBacklog = Callable[[Request], int]
# (request, node budget) -> the tree the suffix drafter would propose for it
# (None: no match). Beside draft models, a request whose suffix tree is chosen alone
# is "draft-free": the draft models sit it out for the step.
SuffixTreeOf = Callable[[Request, int], TokenTree | None]
# With static budgets (no cost model), a suffix tree expected (by its match) to get
# this many tokens accepted is verified alone.
ALONE_MIN_EXPECTED = 2.0
# A step whose requests have no acceptance of their own on record speculates where
# predicted at least this fraction of plain decoding's rate (instead of the usual
# margin above it): a request's acceptance can sit far from its class's prior (the
# Qwen pair accepted 5.6 tokens a step on code where the prior expects 3.3), and one
# that never speculates never shows it. A request probes until its first verification,
# which then speaks for it (re-tries after that follow its fading evidence at the
# usual margin: probing again each time it faded cost prose requests 5-8%).
PROBE_MARGIN = 0.85
# ... but only where a tree would pay if every node were accepted: at least this many
# times plain decoding's rate at full acceptance. Where verifying rows costs nearly a
# step each (llama.cpp's kernels on two cores: a second row 0.7 of a step), a probe
# cannot find a tree worth its cost, and the draft's feed of the prompt and the probe
# itself cost a request 2-5% (benchmarks/RESULTS.md, "One stream as one ggml graph").
PROBE_CEILING = 1.2


def _accepted_path(trials: Sequence[tuple[int, int, bool]]) -> int:
    """Tokens accepted by one verification: the deepest accepted trial's depth."""
    return max((depth for depth, _, hit in trials if hit), default=0)


class BudgetPolicy:
    """Chooses each step's node budget per request (0 = plain decoding)."""

    def __init__(self, config: SpeculativeConfig, prior: AcceptancePrior, num_drafts: int = 1, *,
                 suffix_reach: SuffixReach | None = None, suffix_tree: SuffixTreeOf | None = None,
                 suffix_match: SuffixMatch | None = None, draft_backlog: DraftBacklog | None = None):
        self.config = config
        self.num_drafts = num_drafts
        self.target_cost = CostModel()
        self.draft_cost = CostModel()
        self.overhead = HostOverhead()
        self.rank_acceptance = RankAcceptance()
        self.prior = prior
        self.tables = {c: AcceptanceTable(prior[c]) for c in REQUEST_CLASSES}
        self.evidence: dict[str, RequestEvidence] = {}
        self.suffix_reach = suffix_reach
        self.draft_backlog = draft_backlog
        self.suffix_tree = suffix_tree
        self.suffix_match = suffix_match
        self.draft_free: set[str] = set()  # this step's requests the draft models sit out
        # Acceptance of suffix trees by match length, and this step's suffix trees to
        # learn from: request -> the match its tree followed.
        self.suffix_acceptance = SuffixAcceptance()
        self._suffix_matches: dict[str, int] = {}
        self._shapes: dict[int, TreeShape] = {}
        self._levels: dict[int, tuple[int, ...]] = {}  # budget -> fed per level (``_draft_levels``)
        self._verifications_since_refresh = 0
        self.num_steps_speculation_off = 0
        self.last_budget = config.max_nodes
        self.last_plan: BudgetPlan | None = None
        self._plan_feeds_prompt = False  # the last plan's drafts feed a prompt (see ``choose``)
        self.speculation_factor = 1.0  # see StepCosts.speculation_factor
        # Per class: the draft models' trees' accepted tokens against the plan's
        # expectation (see ``PlanCalibration``), and this step's expectations to check.
        self.calibration = {c: PlanCalibration() for c in REQUEST_CLASSES}
        self._plan_expected: dict[str, float] = {}

    def reconfigure(self, config: SpeculativeConfig) -> None:
        """New tree settings: forget shapes and what was learnt about acceptance (costs stay)."""
        self.config = config
        self._shapes.clear()
        self._levels.clear()
        self.tables = {c: AcceptanceTable(self.prior[c]) for c in REQUEST_CLASSES}
        self.suffix_acceptance = SuffixAcceptance()
        self.evidence.clear()
        self.calibration = {c: PlanCalibration() for c in REQUEST_CLASSES}
        self._plan_expected.clear()

    # ---------------------------------------------------------------- shapes
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

    def _draft_levels(self, budget: int) -> tuple[int, ...]:
        """Nodes the draft models feed per level for one request at ``budget`` (cached
        with the shape it is read from)."""
        levels = self._levels.get(budget)
        if levels is None:
            levels = self._levels[budget] = tuple(self.num_drafts * f for f in fed_per_level(self.shape_for(budget)))
        return levels

    def _rates(self) -> tuple[float, ...]:
        return self.config.acceptance_rates or self.rank_acceptance.rates()

    def candidate_budgets(self) -> list[int]:
        """The budgets the adaptive mode chooses among (besides 0)."""
        top = self.config.max_nodes
        return sorted({top, max(1, round(top * 0.6)), max(1, round(top * 0.4)), max(1, round(top * 0.2))})

    # ---------------------------------------------------------------- choose
    def choose(self, requests: Sequence[Request], other_tokens: int) -> dict[str, int]:
        """Node budget per decoding request for the next step (0 = no speculation);
        sets ``draft_free``."""
        cfg = self.config
        self.draft_free = set()
        self._suffix_matches = {}
        if not requests:
            return {}
        suffix_trees: dict[str, TokenTree] = {}
        matches: dict[str, int] = {}  # request -> its suffix match (requests with a tree)
        if self.num_drafts and self.suffix_tree is not None:
            for r in requests:
                tree = self.suffix_tree(r, cfg.max_nodes)
                match = self._match(r) if tree is not None else 0
                if match > 0:
                    suffix_trees[r.request_id], matches[r.request_id] = tree, match
        if not cfg.adaptive:
            self.last_budget = cfg.max_nodes
            by_class = {r.request_id: request_class(r.params) for r in requests}
            self.draft_free = {rid for rid, t in suffix_trees.items() if self.suffix_acceptance.expected(
                best_shape(t), by_class[rid], matches[rid]) >= ALONE_MIN_EXPECTED}
            budgets = {r.request_id: cfg.max_nodes for r in requests}
            self._keep_suffix_matches(requests, budgets, matches)
            return budgets
        candidates = self.candidate_budgets()
        expected = {r.request_id: self._expected(r, candidates) for r in requests}
        model_levels = {b: self._draft_levels(b) for b in candidates} if self.num_drafts else {}
        catch_up = {r.request_id: self._amortised_backlog(r, expected[r.request_id]) for r in requests} \
            if self.draft_backlog is not None else None
        costs = StepCosts(self.target_cost, self.draft_cost, self.overhead, model_levels, self.speculation_factor)
        margin, plan = SPECULATE_MARGIN, None
        if all(self._unproven(r) for r in requests):
            ceiling = self._ceiling(requests, other_tokens, costs, catch_up)
            if ceiling.best_rate >= PROBE_CEILING * ceiling.plain_rate:
                margin = PROBE_MARGIN
            elif ceiling.best_rate < SPECULATE_MARGIN * ceiling.plain_rate:
                # Not even trees accepted in full would pay: plain decoding, unpriced.
                plan = BudgetPlan({rid: 0 for rid in expected}, ceiling.plain_rate, ceiling.plain_rate,
                                  ceiling.plain_seconds, ceiling.plain_seconds)
        if plan is None:
            plan = plan_budgets(expected, other_tokens, costs, margin=margin, catch_up=catch_up)
        free: set[str] = set()
        if suffix_trees:
            # A request with a suffix tree may go draft-free: its own tree, priced by the
            # match it follows, at no draft cost. Where that tree is expected to get at
            # least what the drafts would, it dominates; whether the others should too
            # (less gained, no draft levels) is the plans' call.
            by_suffix = {r.request_id: self._suffix_expected(r, suffix_trees[r.request_id], matches[r.request_id],
                                                              candidates)
                         for r in requests if r.request_id in suffix_trees}
            dominant = {rid for rid, e in by_suffix.items() if e[cfg.max_nodes] >= expected[rid][cfg.max_nodes]}
            for option in (dominant, set(suffix_trees)):
                mixed = {rid: by_suffix[rid] if rid in option else e for rid, e in expected.items()}
                other = plan_budgets(mixed, other_tokens, costs, margin=margin, catch_up=catch_up, draft_free=option)
                if other.best_rate > plan.best_rate:
                    plan, free = other, option
        self.last_plan = plan
        self.draft_free = {rid for rid in free if plan.budgets.get(rid, 0) > 0}
        # A step whose drafts feed a prompt pays all of it, where the plan priced a share
        # (``_amortised_backlog``): such a step says nothing about the plan's accuracy.
        self._plan_feeds_prompt = self.draft_backlog is not None and any(
            plan.budgets.get(r.request_id, 0) > 0 and r.request_id not in self.draft_free
            and self._unfed(r)[0] > 0 for r in requests)
        self._keep_suffix_matches(requests, plan.budgets, matches)
        self._check_plan(requests, plan, expected)
        self._add_forced_spans(requests, plan.budgets)
        if plan.num_speculating == 0:
            self.num_steps_speculation_off += 1
        self.last_budget = max(plan.budgets.values(), default=0)
        return plan.budgets

    def _keep_suffix_matches(self, requests: Sequence[Request], budgets: Mapping[str, int],
                             matches: Mapping[str, int]) -> None:
        """Remember the match each suffix tree verified alone this step follows, for its
        verification to teach (``observe_verification``): beside draft models the
        draft-free requests; without them every speculating request."""
        if self.num_drafts:
            self._suffix_matches = {rid: matches[rid] for rid in self.draft_free}
        else:
            self._suffix_matches = {rid: m for r in requests if budgets.get(rid := r.request_id, 0) > 0
                                    and (m := self._match(r)) > 0}

    def _ceiling(self, requests: Sequence[Request], other_tokens: int, costs: StepCosts,
                 catch_up: Mapping[str, float] | None) -> BudgetPlan:
        """The plan of the draft models' trees if every node on their deepest path were
        accepted: the most speculation could give this step (``PROBE_CEILING``)."""
        full = {r.request_id: {b: float(self.shape_for(b).depth) for b in self.candidate_budgets()} for r in requests}
        return plan_budgets(full, other_tokens, costs, margin=1.0, catch_up=catch_up)

    def _check_plan(self, requests: Sequence[Request], plan: BudgetPlan,
                    expected: Mapping[str, Mapping[int, float]]) -> None:
        """Keep what the plan expects of each draft-model tree it chose (before the
        class's correction), to compare with its verification; a class the plan keeps
        plain this step lets its correction drift back."""
        self._plan_expected = {}
        plain_classes = set()
        for request in requests:
            rid, cls = request.request_id, request_class(request.params)
            budget = plan.budgets.get(rid, 0)
            if budget > 0 and rid not in self.draft_free and self.num_drafts:
                self._plan_expected[rid] = expected[rid][budget] / self.calibration[cls].factor
            elif budget == 0:
                plain_classes.add(cls)
        for cls in plain_classes - {request_class(r.params) for r in requests if r.request_id in self._plan_expected}:
            self.calibration[cls].fade()

    def _add_forced_spans(self, requests: Sequence[Request], budgets: dict[str, int]) -> None:
        """A request the plan keeps plain whose grammar forces the next tokens still
        verifies them (a few rows, no draft pass): it gets a budget of that many
        nodes and goes draft-free."""
        for request in requests:
            rid = request.request_id
            if request.grammar is None or budgets.get(rid, 0) > 0:
                continue
            forced = len(request.grammar.forced_tokens(self.config.max_nodes))
            if forced:
                budgets[rid] = forced
                self.draft_free.add(rid)

    def _amortised_backlog(self, request: Request, expected: Mapping[int, float]) -> float:
        """The draft's backlog for a request as tokens fed this step: the prompt tokens
        the drafts have not fed (all of a first prompt, or what follows a prefix-cache
        hit) spread over the speculative steps they enable (the request's remaining
        tokens at the best expected rate); tokens decoded plainly since the drafts last
        fed the request in full."""
        prompt_left, gap = self._unfed(request)
        if prompt_left + gap <= 0:
            return 0.0
        # A gap of one is the accepted leaf every chain leaves unfed, which the
        # expected tokens already stand for. A longer gap, left while the request
        # decoded plainly, is paid whole in this step's first draft forward: nothing
        # says the request will keep speculating long enough to spread it (amortised,
        # a request that kept stopping re-paid a many-row catch-up at every retry).
        # A prompt is fed once whatever follows, so it is spread. (Charging a prompt
        # after a prefix-cache hit in full, as a gap, had kept chat requests, whose
        # template prefix is cached, from ever starting to speculate.)
        whole = float(gap) if gap > 1 else 0.0
        spread = prompt_left + (gap if gap <= 1 else 0)
        if not spread:
            return whole
        max_tokens = request.params.max_tokens or 256
        remaining = max(1, max_tokens - len(request.output_token_ids))
        steps = max(1.0, remaining / (1.0 + max(expected.values(), default=0.0)))
        return whole + spread / steps

    def _unfed(self, request: Request) -> tuple[int, int]:
        """The request's prompt tokens the drafts have not fed, and its decoded ones."""
        backlog = self.draft_backlog(request)
        if backlog <= 0:
            return 0, 0
        fed = request.num_tokens - 1 - backlog
        prompt_left = max(0, request.num_prompt_tokens - fed)
        return prompt_left, backlog - prompt_left

    def _unproven(self, request: Request) -> bool:
        """Whether ``request`` has no acceptance of its own on record (never verified)."""
        return request.request_id not in self.evidence

    def _evidence_scale(self, request: Request) -> float:
        evidence = self.evidence.get(request.request_id)
        return evidence.factor if evidence is not None else 1.0

    def _expected(self, request: Request, candidates: Sequence[int]) -> dict[int, float]:
        """Expected accepted tokens of the request's tree at every candidate budget."""
        cls = request_class(request.params)
        table = self.tables[cls]
        scale = self._evidence_scale(request)
        out: dict[int, float] = {}
        if self.num_drafts:
            correction = self.calibration[cls].factor
            for b in candidates:
                out[b] = table.expected_accepted(self.shape_for(b), scale) * correction
            return out
        # Model-free: the suffix drafter proposes only where a suffix matched, about
        # alpha nodes per matched token, mostly one branch; priced by its match.
        reach = self.suffix_reach(request) if self.suffix_reach is not None else 0
        match = self._match(request) if reach else 0
        for b in candidates:
            n = min(b, reach)
            out[b] = self.suffix_acceptance.expected(TreeShape.chain(n), cls, match, scale) if n and match else 0.0
        return out

    def _match(self, request: Request) -> int:
        """The suffix drafter's match for ``request`` (0: none, or no drafter said)."""
        return self.suffix_match(request) if self.suffix_match is not None else 0

    def _suffix_expected(self, request: Request, tree: TokenTree, match: int,
                         candidates: Sequence[int]) -> dict[int, float]:
        """Expected accepted tokens of the best nodes of ``request``'s suffix tree at
        every candidate budget, by the match it follows and the request's evidence."""
        cls, scale = request_class(request.params), self._evidence_scale(request)
        return {b: self.suffix_acceptance.expected(best_shape(tree, b), cls, match, scale) for b in candidates}

    # -------------------------------------------------------------- observe
    def observe_verification(self, request: Request, trials: Sequence[tuple[int, int, bool]]) -> None:
        """One verified tree: the class's table and the request's evidence learn from it."""
        cls = request_class(request.params)
        match = self._suffix_matches.pop(request.request_id, 0)
        # A suffix tree verified alone teaches its match's table; any other tree (the
        # draft models', alone or merged with a suffix tree) the class's table.
        table = self.suffix_acceptance.table(cls, match) if match else self.tables[cls]
        expected = sum(table.rate(depth, rank) for depth, rank, _ in trials)
        hits = sum(1 for _, _, hit in trials if hit)
        table.observe(trials)
        planned = self._plan_expected.pop(request.request_id, None)
        if planned is not None:  # a draft-model tree the plan chose: how its expectation did
            self.calibration[cls].observe(_accepted_path(trials), planned)
        evidence = self.evidence.get(request.request_id)
        if evidence is None:
            evidence = self.evidence[request.request_id] = RequestEvidence()
        evidence.observe(hits, expected)
        if not match:
            self.rank_acceptance.observe([(rank, hit) for _, rank, hit in trials])
        if self.config.tree in ("sequoia", "dynamic") and self.config.acceptance_rates is None:
            self._verifications_since_refresh += 1
            if self._verifications_since_refresh >= _SEQUOIA_REFRESH:
                self._verifications_since_refresh = 0
                self._shapes.clear()
                self._levels.clear()

    def observe_no_verification(self, request_ids: Sequence[str]) -> None:
        """Requests that decoded without a tree this step: their old evidence fades,
        so a request that stopped speculating is re-tried in time."""
        for rid in request_ids:
            evidence = self.evidence.get(rid)
            if evidence is not None:
                evidence.fade()

    def observe_host(self, host_seconds: float, num_requests: int, num_speculating: int) -> None:
        """Host time of a decode-only step outside its forwards."""
        self.overhead.observe(host_seconds, num_requests, num_speculating)

    def observe_step_seconds(self, step_seconds: float) -> None:
        """A whole decode-only step as planned: if it speculated, compare what
        speculation added with what the plan predicted it would add."""
        plan, self.last_plan = self.last_plan, None
        feeds_prompt, self._plan_feeds_prompt = self._plan_feeds_prompt, False
        if plan is None or plan.num_speculating == 0 or feeds_prompt:
            return
        predicted = plan.seconds - plan.plain_seconds
        if predicted <= 0:
            return
        ratio = min(max((step_seconds - plan.plain_seconds) / predicted, 0.5), 4.0)
        self.speculation_factor += _FACTOR_EMA * (ratio - self.speculation_factor)

    def seed_costs(self, target: Mapping[int, float] | None, draft: Mapping[int, float] | None) -> None:
        """Start the cost curves from calibrations."""
        if target:
            self.target_cost.seed(target)
        if draft:
            self.draft_cost.seed(draft)

    def release(self, request_id: str) -> None:
        """Forget a request's evidence."""
        self.evidence.pop(request_id, None)
        self._plan_expected.pop(request_id, None)
        self._suffix_matches.pop(request_id, None)
