"""The adaptive budget: calibrated costs, acceptance priors per class, per-request
budgets, re-tries on evidence."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedtree import LLM, SamplingParams
from pagedtree.config import SpeculativeConfig
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams as Params
from pagedtree.speculative.budget.acceptance import AcceptanceTable, RequestEvidence
from pagedtree.speculative.budget import planner
from pagedtree.speculative.budget.planner import CostModel, HostOverhead, StepCosts, fed_per_level, plan_budgets
from pagedtree.speculative.budget.policy import BudgetPolicy
from pagedtree.speculative.budget.priors import DEFAULT_PRIORS, PAIR_PRIORS, acceptance_prior
from pagedtree.speculative.tree import ROOT, TreeShape
from pagedtree.speculative.budget import calibration
from tests.conftest import assert_no_leaks


class FrozenCost(CostModel):
    """A cost curve that the run's (tiny, fast) timings do not move."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def cpu_like_costs(draft_ratio: float = 1 / 3) -> tuple[CostModel, CostModel]:
    """Flat (memory bound) up to 64 tokens, then proportional; the draft a fraction."""
    target, draft = CostModel(), CostModel()
    target.seed({n: 0.3 * max(1.0, n / 64) for n in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)})
    draft.seed({n: 0.3 * draft_ratio * max(1.0, n / 64) for n in (1, 8, 16, 32, 64, 128, 256, 512, 1024)})
    return target, draft


def chain_costs(draft_ratio: float = 1 / 3, overhead: HostOverhead | None = None) -> StepCosts:
    target, draft = cpu_like_costs(draft_ratio)
    levels = {b: fed_per_level(TreeShape.chain(b)) for b in (1, 2, 3, 5)}
    return StepCosts(target, draft, overhead or HostOverhead(plain=0.0, speculating=0.0), levels)


def chain_expectations(num_requests: int, rate: float) -> dict[str, dict[int, float]]:
    table = AcceptanceTable([[rate]])
    return {f"r{i}": {b: table.expected_accepted(TreeShape.chain(b)) for b in (1, 2, 3, 5)}
            for i in range(num_requests)}


def test_cost_model_seeds_from_a_calibration():
    cost = CostModel()
    cost.seed({1: 0.1, 64: 0.2, 0: 5.0})
    assert cost.estimate(1) == pytest.approx(0.1) and cost.estimate(128) == pytest.approx(0.4)
    cost.observe(64, 0.4)  # online timings refine the seeded point
    assert 0.2 < cost.estimate(64) < 0.4
    cost.seed({1: 0.13, 2: 0.11, 4: 0.09, 8: 0.12, 16: 0.2})  # noise: more tokens never cost less
    assert [cost.estimate(n) for n in (1, 2, 4, 8, 16)] == pytest.approx([0.11, 0.11, 0.11, 0.12, 0.2])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_single_request_is_planned_exactly_as_the_array_planner_plans_it(data):
    """One stream's plan takes a scalar path (``_plan_one``): for any costs, gains,
    backlog, load and margin it decides what the array planner decides, at the same
    predicted rates and seconds."""
    draw = data.draw
    positive = st.floats(1e-4, 1.0, allow_nan=False)
    target, draft = CostModel(), CostModel()
    target.seed({n: draw(positive) for n in draw(st.sets(st.integers(1, 4096), min_size=1, max_size=6))})
    if draw(st.booleans()):
        draft.seed({n: draw(positive) for n in draw(st.sets(st.integers(1, 1024), min_size=1, max_size=6))})
    candidates = sorted(draw(st.sets(st.integers(1, 16), min_size=1, max_size=4)))
    shapes = {b: draw(st.sampled_from([TreeShape.chain(b), TreeShape.from_expansion((2, 2, 1, 1, 1, 1), b)]))
              for b in candidates}
    with_drafts = draw(st.booleans())
    levels = {b: fed_per_level(shape) for b, shape in shapes.items()} if with_drafts else {}
    overhead = HostOverhead(plain=draw(st.floats(0, 0.01)), speculating=draw(st.floats(0, 0.01)))
    costs = StepCosts(target, draft, overhead, levels, speculation_factor=draw(st.floats(0.5, 2.0)))
    expected = {"r": {b: draw(st.floats(0, float(shapes[b].depth))) for b in candidates}}
    catch_up = {"r": draw(st.floats(0, 200))} if draw(st.booleans()) else None
    draft_free = {"r"} if draw(st.booleans()) else set()
    other, margin = draw(st.integers(0, 512)), draw(st.sampled_from([1.0, 1.05, 1.2]))
    one = planner._plan_one(expected, other, costs, margin, catch_up, draft_free)
    many = planner._plan_many(expected, other, costs, margin, catch_up, draft_free)
    assert one.budgets == many.budgets
    assert one.plain_rate == pytest.approx(many.plain_rate, rel=1e-12)
    assert one.best_rate == pytest.approx(many.best_rate, rel=1e-12)
    assert one.seconds == pytest.approx(many.seconds, rel=1e-12)
    assert plan_budgets(expected, other, costs, margin, catch_up, draft_free) == one


def test_speculation_shrinks_and_turns_off_as_the_batch_grows():
    costs = chain_costs()
    chosen = []
    for r in (1, 4, 16, 64, 256):
        plan = plan_budgets(chain_expectations(r, 0.8), 0, costs)
        budget = max(plan.budgets.values())
        chosen.append(budget)
        assert plan.best_rate >= plan.plain_rate
    assert chosen[0] >= 3 and chosen[-1] == 0
    assert chosen == sorted(chosen, reverse=True)


def test_no_speculation_where_the_prediction_says_it_cannot_pay():
    # A draft as costly as the target: nothing to gain at any batch size.
    for r in (1, 8):
        plan = plan_budgets(chain_expectations(r, 0.8), 0, chain_costs(draft_ratio=1.0))
        assert plan.num_speculating == 0 and plan.best_rate == plan.plain_rate


def test_only_requests_likely_to_gain_speculate():
    expected = chain_expectations(6, 0.85)
    for rid in ("r1", "r4"):
        expected[rid] = {b: 0.0 for b in expected[rid]}  # e.g. no suffix match
    plan = plan_budgets(expected, 0, chain_costs())
    assert plan.budgets["r1"] == plan.budgets["r4"] == 0
    assert all(plan.budgets[r] > 0 for r in ("r0", "r2", "r3", "r5"))


def test_prefill_load_and_host_overhead_count_against_speculation():
    expected = chain_expectations(8, 0.7)
    alone = plan_budgets(expected, 0, chain_costs())
    assert alone.num_speculating > 0
    # A big prefill chunk rides along: the pass is compute bound, tree tokens cost
    # their full price, and speculation gains less.
    loaded = plan_budgets(expected, 1500, chain_costs())
    assert loaded.best_rate / loaded.plain_rate < alone.best_rate / alone.plain_rate
    slow_host = HostOverhead(plain=0.0, speculating=0.2)
    assert plan_budgets(expected, 0, chain_costs(overhead=slow_host)).num_speculating == 0


def test_a_marginal_gain_is_not_taken():
    expected = {"r0": {1: 0.04}}
    target = CostModel()
    target.seed({1: 0.1, 2: 0.1})
    costs = StepCosts(target, CostModel(), HostOverhead(plain=0.0, speculating=0.0), {})
    assert plan_budgets(expected, 0, costs).num_speculating == 0  # +4% < the 5% margin
    expected = {"r0": {1: 0.2}}
    assert plan_budgets(expected, 0, costs).budgets == {"r0": 1}


def test_acceptance_table_expectation_by_depth_and_rank():
    table = AcceptanceTable([[0.5, 0.4], [0.8]], strength=10)
    # Two root children (ranks 0, 1), the first with a child at depth 2.
    shape = TreeShape([ROOT, ROOT, 0], [0, 1, 0])
    assert table.expected_accepted(shape) == pytest.approx(0.5 + 0.5 * 0.4 + 0.5 * 0.8)
    table.observe([(1, 0, False)] * 10)  # depth 1 rank 0 now 5/20
    assert table.rate(1, 0) == pytest.approx(0.25)
    assert table.rate(3, 0) == pytest.approx(0.8)  # deeper than the table: the deepest row
    table.observe([(3, 0, True)])
    assert len(table.rows()) == 3 and table.rate(3, 0) > 0.8


def test_request_evidence_drops_and_recovers():
    evidence = RequestEvidence()
    assert evidence.factor == 1.0
    for _ in range(5):
        evidence.observe(0, 2.5)  # expected 2.5 accepted, got none
    assert evidence.factor < 0.3
    for _ in range(80):
        evidence.fade()
    assert evidence.factor > 0.9


def _requests(n: int, temperature: float = 0.0) -> list[Request]:
    return [Request(f"q{i}", None, [1, 2, 3], Params(temperature=temperature, max_tokens=50), 0) for i in range(n)]


def test_a_request_that_drafts_badly_stops_and_is_retried():
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
    target, draft = cpu_like_costs(0.15)
    policy.target_cost, policy.draft_cost = target, draft
    policy.overhead = HostOverhead(plain=0.0, speculating=0.02)
    good, bad = _requests(2)
    assert all(b > 0 for b in policy.choose([good, bad], 0).values())
    for _ in range(12):
        policy.observe_verification(good, [(1, 0, True), (2, 0, True), (3, 0, True), (4, 0, False)])
        policy.observe_verification(bad, [(1, 0, False)])
    budgets = policy.choose([good, bad], 0)
    assert budgets[good.request_id] > 0 and budgets[bad.request_id] == 0
    # It does not speculate, its bad evidence fades: it is tried again.
    for _ in range(30):
        policy.observe_no_verification([bad.request_id])
        if policy.choose([good, bad], 0)[bad.request_id] > 0:
            break
    else:
        pytest.fail("the request was never re-tried")


def test_an_unproven_request_probes_a_tree_predicted_just_short_of_plain():
    """A request with no acceptance of its own on record speculates where the prior
    predicts a little less than plain decoding's rate (its real acceptance may be far
    better: a request that never speculates never shows it); with poor evidence it
    does not, and with good evidence it goes on."""
    from pagedtree.speculative.budget.policy import PROBE_MARGIN

    def policy_for(draft_ratio: float) -> BudgetPolicy:
        policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
        policy.target_cost, policy.draft_cost = cpu_like_costs(draft_ratio)
        policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
        return policy

    # A draft dear enough that the prior's best tree is predicted below plain decoding's
    # usual margin: an unproven request still probes it.
    for percent in range(20, 100):
        policy = policy_for(percent / 100)
        budget = policy.choose(_requests(1), 0)["q0"]
        plan = policy.last_plan
        if budget > 0 and plan.best_rate < 1.05 * plan.plain_rate:
            break
    else:
        pytest.fail("no draft cost left the prior's tree between the probe's margin and the usual one")
    assert PROBE_MARGIN * plan.plain_rate <= plan.best_rate
    poor, good = _requests(2)
    for _ in range(3):
        policy.observe_verification(poor, [(1, 0, False)])
        policy.observe_verification(good, [(1, 0, True), (2, 0, True), (3, 0, True), (4, 0, True), (5, 0, True)])
    assert policy.choose([poor], 0)["q0"] == 0
    assert policy.choose([good], 0)["q1"] > 0


def test_no_probe_where_no_tree_could_pay_even_fully_accepted():
    """Where each verified row costs most of a step (llama.cpp's kernels past one row
    on two cores), even a tree accepted in full would not beat plain decoding by
    ``PROBE_CEILING``: an unproven request decodes plainly instead of probing; with
    near-flat row costs it probes."""
    from pagedtree.speculative.budget.policy import PROBE_CEILING

    def policy_with(row_cost: float) -> BudgetPolicy:
        policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
        target, draft = CostModel(), CostModel()
        target.seed({n: 0.03 * (1 + row_cost * (n - 1)) for n in (1, 2, 4, 8, 16, 64)})
        draft.seed({n: 0.01 * (1 + row_cost * (n - 1)) for n in (1, 2, 4, 8, 16, 64)})
        policy.target_cost, policy.draft_cost = target, draft
        policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
        return policy

    steep = policy_with(0.7)
    assert steep.choose(_requests(1), 0)["q0"] == 0
    full = {"q0": {b: float(TreeShape.chain(b).depth) for b in steep.candidate_budgets()}}
    costs = StepCosts(steep.target_cost, steep.draft_cost, steep.overhead,
                      {b: fed_per_level(TreeShape.chain(b)) for b in steep.candidate_budgets()})
    ceiling = plan_budgets(full, 0, costs, margin=1.0)
    assert ceiling.best_rate < PROBE_CEILING * ceiling.plain_rate
    assert policy_with(0.05).choose(_requests(1), 0)["q0"] > 0


def test_plans_learn_per_class_how_the_trees_they_chose_did():
    """What the plan expected of each tree it chose is checked against its
    verification, per class. A request's estimate is highest just after a lucky
    verification, so a plan picks overestimates where acceptance is low and noisy;
    where the chosen trees accept less than expected, the class's expectations shrink
    until it stops speculating, and while it decodes plainly the correction drifts
    back and speculation is tried again."""
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
    policy.target_cost, policy.draft_cost = cpu_like_costs(0.4)
    policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
    for table in policy.tables.values():  # the rates stay the prior's: only the plan's check learns
        table.observe = lambda trials: None

    def fresh(name: str) -> Request:
        return Request(name, None, [1, 2, 3], Params(temperature=0.0, max_tokens=50), 0)

    prior_expectation = policy._expected(fresh("x"), [5])[5]
    for i in range(60):
        request = fresh(f"g{i}")
        factor = policy.calibration["greedy"].factor
        expectation = policy._expected(request, [5])[5]
        if policy.choose([request], 0)[request.request_id] == 0:
            break
        policy.observe_verification(request, [(1, 0, False)])  # nothing accepted
        policy.release(request.request_id)
    else:
        pytest.fail("the plan kept choosing trees that accepted nothing")
    assert factor < 0.5 and policy.calibration["sampling"].factor == 1.0
    assert expectation == pytest.approx(prior_expectation * factor)
    sampling = Request("s", None, [1, 2, 3], Params(temperature=0.8, max_tokens=50), 0)
    assert policy._expected(sampling, [5])[5] == pytest.approx(
        policy.tables["sampling"].expected_accepted(policy.shape_for(5)))  # the other class: untouched
    for _ in range(300):
        if policy.choose([fresh("again")], 0)["again"] > 0:
            break
    else:
        pytest.fail("the class was never tried again")
    assert policy.calibration["greedy"].factor > factor


def test_greedy_and_sampling_requests_learn_separately():
    policy = BudgetPolicy(SpeculativeConfig(), DEFAULT_PRIORS["model"])
    greedy, sampling = _requests(1)[0], _requests(1, temperature=0.8)[0]
    before = policy.tables["greedy"].rate(1, 0)
    for _ in range(50):
        policy.observe_verification(sampling, [(1, 0, False)])
    assert policy.tables["greedy"].rate(1, 0) == before
    assert policy.tables["sampling"].rate(1, 0) < 0.2


def test_priors_are_looked_up_by_pair_and_drafter():
    assert acceptance_prior("x", None, "suffix") is DEFAULT_PRIORS["suffix"]
    assert acceptance_prior("x", ["y"], "model") is DEFAULT_PRIORS["model"]
    for (target, draft), prior in PAIR_PRIORS.items():
        assert acceptance_prior(f"/some/where/{target}/", [draft], "model+suffix") is prior
        assert set(prior) == {"greedy", "sampling"}


# ---------------------------------------------------------------- calibration
def test_calibration_is_cached_per_key(tiny_llama, tmp_path, monkeypatch):
    calls = []
    real = calibration.measure_forward_seconds

    def counting(runner, counts, repeats=2):
        calls.append(list(counts))
        return real(runner, counts, repeats=1)

    monkeypatch.setattr(calibration, "measure_forward_seconds", counting)
    monkeypatch.setenv("PAGEDTREE_CALIBRATION_DIR", str(tmp_path))
    kwargs = dict(dtype="float32", device="cpu", max_num_seqs=4,
                  speculative=SpeculativeConfig(drafter="suffix", max_nodes=4))
    llm = LLM(str(tiny_llama.path), **kwargs)
    assert len(calls) == 1 and calls[0][0] == 1 and calls[0][-1] == 4 * 5
    assert llm.engine.speculation.budget.target_cost.has_data
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["dtype"] == "torch.float32"
    LLM(str(tiny_llama.path), **kwargs)  # same key: read from the cache
    assert len(calls) == 1
    LLM(str(tiny_llama.path), **(kwargs | {"max_num_seqs": 8}))  # another size: measured again
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    files[0].write_text("not json")  # a damaged file is measured again, not trusted
    LLM(str(tiny_llama.path), **kwargs)
    assert len(calls) == 3


def test_calibration_key_tells_a_cut_draft_head_apart(tmp_path):
    """A draft whose LM head is cut costs less per forward: its curve has its own key."""
    import torch

    key = lambda vocab: calibration.calibration_key(tmp_path, torch.device("cpu"), torch.float32, "q4", 16,
                                                    head_vocab=vocab)
    assert key(None) == key(None) and key(None) != key(32768) and key(32768) != key(65536)


def test_adaptive_suffix_speculation_speculates_only_where_a_suffix_matched(tiny_llama):
    """With costs where speculation pays (a slow, memory-bound target), a repetitive
    prompt gets trees and a prompt without repeats gets none until its own output
    repeats; every output equals plain decoding."""
    repetitive, plain_prompt = [5, 6, 7, 8, 9, 10] * 4, list(range(20, 44))
    prompts = [{"prompt_token_ids": p} for p in (repetitive, plain_prompt)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_llama.path), dtype="float32", device="cpu")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu",
              speculative=SpeculativeConfig(drafter="suffix", max_nodes=8))
    budget = llm.engine.speculation.budget
    budget.target_cost = FrozenCost()
    budget.target_cost.seed({1: 0.5, 512: 0.5})
    budget.overhead = HostOverhead(plain=0.0, speculating=0.0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    first_output = want[1][0]
    drafts = [o.metrics["spec_num_drafts"] for o in outs]
    assert drafts[0] > 0
    if first_output not in plain_prompt:  # nothing to match until the output repeats
        assert drafts[1] < drafts[0]
    assert_no_leaks(llm)


def test_a_draft_backlog_is_priced():
    """A request whose prompt the draft has not seen costs its catch-up first."""
    expected = chain_expectations(2, 0.8)
    assert plan_budgets(expected, 0, chain_costs(0.15)).num_speculating == 2
    heavy = plan_budgets(expected, 0, chain_costs(0.15), catch_up={"r0": 0.0, "r1": 4000.0})
    assert heavy.budgets["r0"] > 0 and heavy.budgets["r1"] == 0


def test_a_first_prompt_is_amortised_and_a_gap_after_plain_steps_is_not():
    """The drafts' first prompt is spread over the steps it enables, whether they fed
    none of it or a cached prefix of it; tokens decoded plainly since the drafts last
    fed the request are paid in full when it resumes (and the one unfed accepted leaf
    of a chain is not counted twice)."""
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
    expected = {1: 0.8, 5: 2.0}

    def priced(outputs: int, backlog: int) -> float:
        request = Request("r", None, list(range(41)), Params(max_tokens=200), 0)
        request.output_token_ids.extend(range(outputs))
        policy.draft_backlog = lambda r: backlog
        return policy._amortised_backlog(request, expected)

    assert priced(1, 41) < 41 / 10  # a fresh request: the whole prompt, spread
    assert priced(1, 9) < 9 / 10  # a chat request whose first 32 prompt tokens were cached
    assert priced(9, 8) == 8  # 8 tokens decoded plainly after the drafts fed the prompt
    assert priced(9, 1) < 1 / 10  # a chain's unfed accepted leaf
    assert 8 < priced(9, 12) < 8.5  # 4 prompt tokens never fed (spread) and the 8 decoded (whole)


def test_whole_steps_slower_than_predicted_correct_the_plan():
    """Speculative steps that take longer than planned (costs the parts missed) make
    the policy speculate less, and it recovers the plan's margin when they do not."""
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
    target, draft = cpu_like_costs(0.15)
    policy.target_cost, policy.draft_cost = target, draft
    policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
    requests = _requests(8)
    first = max(policy.choose(requests, 0).values())
    assert first > 0 and policy.last_plan.num_speculating == 8
    for _ in range(40):
        plan = policy.last_plan
        policy.observe_step_seconds(plan.plain_seconds + 3.0 * (plan.seconds - plan.plain_seconds))
        policy.choose(requests, 0)
    assert max(policy.last_plan.budgets.values()) < first and policy.speculation_factor > 2
    policy.observe_step_seconds(1.0)  # a plain step: nothing to correct
    assert policy.speculation_factor > 2


def test_a_step_that_feeds_a_prompt_does_not_correct_the_plan():
    """The step whose drafts feed a request's prompt pays all of it where the plan priced
    a share: its time must not make speculation look dearer. A step that fed nothing
    still corrects the plan."""
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=5), DEFAULT_PRIORS["model"])
    target, draft = cpu_like_costs(0.15)
    policy.target_cost, policy.draft_cost = target, draft
    policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
    requests = _requests(2)
    for request in requests:  # 3 prompt tokens, 10 decoded
        request.output_token_ids.extend(range(10))
    backlog = {"value": 12}
    policy.draft_backlog = lambda r: backlog["value"]  # nothing fed yet: the prompt among it
    assert max(policy.choose(requests, 0).values()) > 0
    plan = policy.last_plan
    policy.observe_step_seconds(plan.plain_seconds + 3.0 * (plan.seconds - plan.plain_seconds))
    assert policy.speculation_factor == 1.0
    backlog["value"] = 1  # fed: only the chain's accepted leaf
    policy.choose(requests, 0)
    plan = policy.last_plan
    policy.observe_step_seconds(plan.plain_seconds + 3.0 * (plan.seconds - plan.plain_seconds))
    assert policy.speculation_factor > 1.0


def test_a_draft_free_tree_costs_no_draft_forward():
    """A request whose tree is the suffix drafter's alone speculates where a draft
    model's tree would not pay (a draft as costly as the target)."""
    expected = chain_expectations(2, 0.6)
    assert plan_budgets(expected, 0, chain_costs(1.0)).num_speculating == 0
    plan = plan_budgets(expected, 0, chain_costs(1.0), draft_free={"r1"})
    assert plan.budgets["r1"] > 0 and plan.budgets["r0"] == 0


def _chain_tree(length: int, logprob_step: float):
    from pagedtree.speculative.tree import TokenTree

    tree = TokenTree(5)
    parent = ROOT
    for token in range(length):
        parent = tree.add(parent, token, logprob_step * (token + 1))
    return tree


def _merged_policy(draft_ratio: float) -> BudgetPolicy:
    policy = BudgetPolicy(SpeculativeConfig(tree="chain", depth=5, max_nodes=12), DEFAULT_PRIORS["model"])
    target, draft = cpu_like_costs(draft_ratio)
    policy.target_cost, policy.draft_cost = target, draft
    policy.overhead = HostOverhead(plain=0.0, speculating=0.0)
    return policy


def _with_suffix(policy: BudgetPolicy, tree, match: int, only=None) -> None:
    """Give ``policy`` a suffix drafter proposing ``tree`` after a match of ``match``
    tokens (to ``only`` that request, when given)."""
    policy.suffix_tree = lambda r, _nodes: tree if only is None or r is only else None
    policy.suffix_match = lambda r: match if only is None or r is only else 0


def test_the_budget_prices_a_suffix_tree_by_the_match_it_follows():
    """Beside a draft model, a request whose suffix tree follows a long match (the
    prompt being copied) is planned from that tree, draft-free (no draft levels
    priced), the others from the acceptance table; the same tree after a one-token
    match is not worth its rows."""
    policy = _merged_policy(1.0)  # drafting with the model cannot pay
    requests = _requests(2)
    _with_suffix(policy, _chain_tree(10, -0.01), 8, only=requests[1])
    budgets = policy.choose(requests, 0)
    assert budgets[requests[0].request_id] == 0 and budgets[requests[1].request_id] >= 7
    assert policy.draft_free == {requests[1].request_id}
    _with_suffix(policy, _chain_tree(10, -0.01), 1, only=requests[1])
    assert max(policy.choose(requests, 0).values()) == 0 and policy.draft_free == set()
    policy.suffix_tree = None
    assert max(policy.choose(requests, 0).values()) == 0 and policy.draft_free == set()


def test_a_weaker_suffix_tree_wins_only_where_drafting_costs_more_than_it_adds():
    """A suffix tree expected to get less than the draft model's chain (after a
    two-token match) is still taken alone when the draft levels cost more than the
    difference, and not when they are cheap."""
    requests = _requests(1)
    costly, cheap = _merged_policy(0.5), _merged_policy(0.02)
    for policy in (costly, cheap):
        _with_suffix(policy, _chain_tree(4, -0.4), 2)
        assert max(policy.choose(requests, 0).values()) > 0
    assert costly.draft_free == {requests[0].request_id}
    assert cheap.draft_free == set()


def test_suffix_trees_that_beat_their_match_are_trusted_more_and_teach_only_their_match():
    """Draft-free trees after two-token matches accepted in full raise that match's
    rates (not the draft model's, nor other matches'), until such a tree is taken
    over a cheap draft model's chain."""
    requests = _requests(1)
    costly, cheap = _merged_policy(0.5), _merged_policy(0.02)
    _with_suffix(costly, _chain_tree(4, -0.4), 2)
    _with_suffix(cheap, _chain_tree(4, -0.4), 2)
    model_rows = costly.tables["greedy"].rows()
    one_token = costly.suffix_acceptance.table("greedy", 1).rows()
    for _ in range(30):
        costly.choose(requests, 0)
        assert costly.draft_free == {requests[0].request_id}
        costly.observe_verification(requests[0], [(1, 0, True), (2, 0, True), (3, 0, True), (4, 0, True)])
    assert costly.suffix_acceptance.table("greedy", 2).rate(1, 0) > 0.8
    assert costly.tables["greedy"].rows() == model_rows
    assert costly.suffix_acceptance.table("greedy", 1).rows() == one_token
    cheap.choose(requests, 0)
    assert cheap.draft_free == set()
    cheap.suffix_acceptance = costly.suffix_acceptance
    cheap.choose(requests, 0)
    assert cheap.draft_free == {requests[0].request_id}
