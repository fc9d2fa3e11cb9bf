"""Proposing token trees: every draft model grows its trees, and they are merged.

``TreeProposer`` decides, per request, how children are proposed (which fixes how
they are verified), how the node budget is shared between draft models, and keeps a
draft failure to the requests it hits. A new kind of drafter (a model-free one, say)
is one more source here: the suffix drafter (``suffix_drafter``) is one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from pagedtree.distributed.group import TensorParallelError
from pagedtree.request import Request
from pagedtree.speculative.budget.policy import BudgetPolicy
from pagedtree.speculative.drafting.builders import DynamicTreeBuilder, ShapeTreeBuilder, TreeBuilder
from pagedtree.config import SpeculativeConfig
from pagedtree.speculative.drafting.draft_worker import DraftWorker
from pagedtree.speculative.drafting.drafter import Drafted, DraftJob, Drafter
from pagedtree.speculative.drafting.grammar_spans import forced_chain, prune_to_grammar
from pagedtree.speculative.drafting.merge import merge_trees
from pagedtree.speculative.noise import NoiseCache
from pagedtree.speculative.drafting.suffix_drafter import SuffixDrafter
from pagedtree.speculative.tree import DETERMINISTIC_RULES, RANDOM_RULES, TokenTree

logger = logging.getLogger("pagedtree")

def proposal_rule(request: Request, config: SpeculativeConfig) -> str:
    """How this request's children are proposed, which fixes how they are verified.

    Greedy requests take the draft's top tokens; seeded sampling requests the coupled
    ones (top tokens under the seed's Gumbel noise, verified with the same noise, so
    their output depends on the seed alone); other sampling requests
    ``draft_sampling`` (dynamic trees: always top-k).
    """
    params = request.params
    if params.greedy:
        return "topk"
    if params.seed is not None:
        return "coupled"
    if config.tree == "dynamic":
        return "topk"
    return config.draft_sampling


class TreeProposer:
    """Grows and merges the trees of every draft model (and of the suffix drafter)
    for one step."""

    def __init__(self, drafts: Sequence[DraftWorker], budget: BudgetPolicy, noise: NoiseCache,
                 suffix: SuffixDrafter | None = None):
        if not drafts and suffix is None:
            raise ValueError("speculation needs a draft model or the suffix drafter")
        self.drafts = list(drafts)
        self.suffix = suffix
        # Every source of trees, the draft models first (``shares`` follows this order).
        self.sources: list[Drafter] = [*self.drafts, *([suffix] if suffix is not None else [])]
        self.budget = budget
        self.noise = noise
        self.last_draft_seconds = 0.0  # time they took
        self.num_suffix_alone = 0  # trees the suffix drafter proposed without the draft models
        self.num_forced_tokens = 0  # proposals a grammar forced (no draft pass)
        self.forced: set[str] = set()  # this step's requests whose tree holds forced tokens

    @property
    def config(self) -> SpeculativeConfig:
        return self.budget.config

    def set_suffix(self, suffix: SuffixDrafter | None) -> None:
        """Draft beside the draft models with ``suffix`` from now on (None: without)."""
        if suffix is None and not self.drafts:
            raise ValueError("speculation needs a draft model or the suffix drafter")
        if suffix is not self.suffix and self.suffix is not None:
            # Its requests' trees are released nowhere while it sits out (a request's
            # is rebuilt from its tokens when it drafts again).
            self.suffix.release_all()
        self.suffix = suffix
        self.sources = [*self.drafts, *([suffix] if suffix is not None else [])]

    def shares(self, request: Request, budget: int) -> list[int]:
        """Each source's node budget for one request: the draft models', then the
        suffix drafter's if there is one.

        Deterministic proposals can be pruned after merging, so every source builds a
        full tree and the merge keeps the best nodes. Random draws cannot be pruned
        (that would bias them), so the budget is split and the merged tree fits by
        construction; a source with a share of 0 sits this step out for the request.
        """
        n = len(self.drafts) + (self.suffix is not None)
        if n == 1 or proposal_rule(request, self.config) in DETERMINISTIC_RULES:
            return [budget] * n
        # The suffix drafter takes only what its match can fill (nothing without a
        # match), at most half; the draft models share the rest.
        suffix_share = min(self.suffix.reach(request), budget // 2) if self.suffix is not None else 0
        base, extra = divmod(budget - suffix_share, len(self.drafts))
        models = [base + (1 if i < extra else 0) for i in range(len(self.drafts))]
        return models + ([suffix_share] if self.suffix is not None else [])

    def propose(self, requests_and_budgets: Sequence[tuple[Request, int]]) -> dict[str, TokenTree]:
        """Trees for the given requests, each within its node budget.

        A request whose drafting fails gets no tree (it decodes without speculation
        this step); the others are unaffected.
        """
        self.last_draft_seconds = 0.0
        self.forced = set()
        shares = {r.request_id: self.shares(r, budget) for r, budget in requests_and_budgets}
        # The requests the budget made draft-free get the suffix tree (or the tokens
        # their grammar forces) alone, at the whole budget (drafting them costs
        # nothing); the others get it within its share, merged with the draft
        # models' trees.
        if self.drafts:
            for request, budget in requests_and_budgets:
                if request.request_id in self.budget.draft_free:
                    shares[request.request_id] = [0] * len(self.drafts) + ([budget] if self.suffix else [])
                    self.num_suffix_alone += self.suffix is not None
        per_source: list[dict[str, TokenTree]] = []
        for index, source in enumerate(self.sources):
            wanted = [(r, shares[r.request_id][index]) for r, _ in requests_and_budgets]
            per_source.append(self._propose_isolated(source, [(r, n) for r, n in wanted if n > 0]))
        trees: dict[str, TokenTree] = {}
        for request, budget in requests_and_budgets:
            rid = request.request_id
            found = [d[rid] for d in per_source if rid in d]
            # The draft models' trees (and the tokens a grammar forces, which lead
            # them) stay whole in a merge; the suffix drafter's fill what is left.
            preferred = sum(rid in d for d in per_source[:len(self.drafts)])
            try:
                if request.grammar is not None:
                    found, preferred = self._under_grammar(request, found, budget, preferred)
                if not found:
                    continue
                tree = found[0] if len(found) == 1 and found[0].num_nodes <= budget \
                    else merge_trees(found, budget, preferred)
            except Exception as exc:  # noqa: BLE001 - this request decodes plainly, the others go on
                logger.warning("merging the drafts' trees of request %s failed (%s: %s); it decodes "
                               "without speculation this step", rid, type(exc).__name__, exc)
                self.commit(rid, [])
                continue
            trees[rid] = tree
        return trees

    def _under_grammar(self, request: Request, found: list[TokenTree], budget: int,
                       preferred: int) -> tuple[list[TokenTree], int]:
        """The trees to merge for a request under a grammar, and how many of them lead
        (``merge_trees``' ``preferred``): the tokens the grammar forces first (free
        proposals), then the sources' trees without the proposals it forbids. Random
        draws cannot share a budget they were not sized for, so where the grammar
        forces tokens, a request drafting at random proposes those alone this step."""
        grammar = request.grammar
        forced = forced_chain(grammar, request.output_token_ids[-1], budget)
        if forced is not None:
            self.num_forced_tokens += forced.num_nodes
            self.forced.add(request.request_id)
            if proposal_rule(request, self.config) not in DETERMINISTIC_RULES:
                return [forced], 1
        pruned = [prune_to_grammar(tree, grammar) for tree in found]
        kept = [(i < preferred, t) for i, t in enumerate(pruned) if t.num_nodes]
        lead = [forced] if forced is not None else []
        return lead + [t for _, t in kept], len(lead) + sum(first for first, _ in kept)

    def _observed(self, drafted: Drafted) -> dict[str, TokenTree]:
        """A source's trees, its forwards taken into the draft cost model."""
        for num_tokens, seconds in drafted.forwards:
            self.budget.draft_cost.observe(num_tokens, seconds)
            self.last_draft_seconds += seconds
        return drafted.trees

    def _propose_isolated(self, source: Drafter, wanted: list[tuple[Request, int]]) -> dict[str, TokenTree]:
        """``source.propose`` for all of ``wanted`` at once; if that fails, for each
        request alone, so that a failure costs only the requests that fail."""
        if not wanted:
            return {}
        try:
            return self._observed(source.propose([self._job(r, share, source) for r, share in wanted]))
        except TensorParallelError:
            raise  # a sharded draft's rank is gone: fatal, not one request's failure
        except Exception as exc:  # noqa: BLE001
            if len(wanted) > 1:
                logger.warning("%s failed on a batch of %d requests (%s: %s); drafting them one by one",
                               source.name, len(wanted), type(exc).__name__, exc)
            else:
                _log_draft_failure(source, wanted[0][0], exc)
            for request, _ in wanted:
                source.release(request.request_id)
            if len(wanted) == 1:
                return {}
        trees: dict[str, TokenTree] = {}
        for request, share in wanted:
            try:
                trees.update(self._observed(source.propose([self._job(request, share, source)])))
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001
                _log_draft_failure(source, request, exc)
                source.release(request.request_id)
        return trees

    def _job(self, request: Request, budget: int, source: Drafter) -> DraftJob:
        """A request's job for ``source``: with a tree builder if it needs one."""
        return DraftJob(request, self._builder(request, budget, source) if source.needs_builder else None, budget)

    def _builder(self, request: Request, budget: int, draft: Drafter) -> TreeBuilder:
        cfg = self.config
        params = request.params
        rule = proposal_rule(request, cfg)
        generator = draft.generator_for(request) if rule in RANDOM_RULES else None
        noise = self._noise_for(request) if rule == "coupled" else None
        root = request.output_token_ids[-1]
        grammar = request.grammar
        if cfg.tree == "dynamic":
            return DynamicTreeBuilder(cfg.top_k, cfg.depth, budget, root, params, rule, noise, grammar,
                                      cfg.draft_min_prob)
        return ShapeTreeBuilder(self.budget.shape_for(budget), root, params, rule, generator, noise, grammar,
                                cfg.draft_min_prob)

    def _noise_for(self, request: Request) -> Callable[[int], torch.Tensor]:
        """Depth of the children to propose -> the request's noise at that position."""
        seed = request.sampling_seed
        root_position = len(request.output_token_ids) - 1  # the root is the newest output token
        return lambda depth: self.noise.get(seed, root_position + depth)

    # ------------------------------------------------------------ draft KV
    def commit(self, request_id: str, accepted_tokens: Sequence[int]) -> None:
        """Every draft keeps the KV of the accepted path and frees its other branches."""
        for draft in self.drafts:
            draft.commit(request_id, accepted_tokens)

    def cache_blocks(self, request: Request) -> None:
        """Register the drafts' full computed blocks for prefix reuse."""
        tokens = request.all_token_ids
        for draft in self.drafts:
            draft.cache_blocks(request.request_id, tokens)

    def release(self, request_id: str) -> None:
        """Free a request's draft KV (and suffix tree) everywhere."""
        for draft in self.drafts:
            draft.release(request_id)
        if self.suffix is not None:
            self.suffix.release(request_id)


def _log_draft_failure(source: Drafter, request: Request, exc: Exception) -> None:
    logger.warning("%s failed for request %s (%s: %s); it decodes without its proposals this step",
                   source.name, request.request_id, type(exc).__name__, exc)
