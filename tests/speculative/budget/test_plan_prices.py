"""``plan_budgets`` prices every (budget, number of requests speculating) at once;
here each is priced one at a time, by the rule its docstring states, and the plan
must pick the best of them (random costs, expectations, backlogs, draft-free
requests, margins and batch sizes)."""

from __future__ import annotations

import random

import pytest

from pagedtree.speculative.budget.planner import CostModel, HostOverhead, StepCosts, plan_budgets


def _priced(expected, other, costs: StepCosts, catch_up, draft_free, budget: int, k: int) -> tuple[float, float]:
    """Rate and seconds of the step where the ``k`` requests expecting most at
    ``budget`` (draft-free ones first among equals) speculate with it."""
    ids = list(expected)
    r = len(ids)
    plain = costs.target.estimate(r) + costs.overhead.plain * r
    order = sorted(ids, key=lambda i: (-expected[i].get(budget, 0.0), i not in draft_free))[:k]
    drafting = [i for i in order if i not in draft_free]
    extra = costs.target.estimate(other + r + k * budget) - costs.target.estimate(r + other)
    levels = costs.draft_levels.get(budget, ())
    for level, fed in enumerate(levels):
        tokens = len(drafting) * fed
        if level == 0:
            tokens += sum(expected[i].get(budget, 0.0) + (catch_up or {}).get(i, 0.0) for i in drafting)
        extra += costs.draft.estimate(tokens) if tokens > 0 else 0.0
    extra += costs.overhead.speculating * k
    seconds = plain + extra * costs.speculation_factor
    return (r + sum(expected[i].get(budget, 0.0) for i in order)) / seconds, seconds


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_the_best_of_every_budget_and_count_priced_alone(seed):
    rng = random.Random(seed)
    target, draft = CostModel(), CostModel()
    target.seed({n: 0.04 + 0.002 * n * rng.random() for n in sorted(rng.sample(range(1, 300), 4))})
    draft.seed({n: 0.01 + 0.001 * n * rng.random() for n in sorted(rng.sample(range(1, 300), 3))})
    candidates = sorted(rng.sample([1, 2, 3, 5, 8, 12], rng.randint(1, 4)))
    levels = {b: tuple(rng.choice([1, 1, 2, 3]) for _ in range(rng.randint(1, 5))) for b in candidates}
    costs = StepCosts(target, draft, HostOverhead(plain=0.001, speculating=0.002), levels,
                      rng.choice([0.8, 1.0, 1.3]))
    r = rng.randint(1, 10)
    expected = {f"r{i}": {b: rng.random() * b for b in candidates} for i in range(r)}
    catch_up = {rid: rng.random() * 20 for rid in expected} if seed % 2 else None
    draft_free = {rid for rid in expected if rng.random() < 0.3}
    other, margin = rng.choice([0, 16, 128]), rng.choice([0.85, 1.05])
    plan = plan_budgets(expected, other, costs, margin=margin, catch_up=catch_up, draft_free=draft_free)
    priced = {(b, k): _priced(expected, other, costs, catch_up, draft_free, b, k)
              for b in candidates for k in range(1, r + 1)}
    best_rate = max(rate for rate, _ in priced.values())
    if best_rate > plan.plain_rate * margin:
        chosen = {b for b in plan.budgets.values() if b}
        assert len(chosen) == 1
        budget = chosen.pop()
        k = sum(1 for b in plan.budgets.values() if b)
        assert plan.best_rate == pytest.approx(best_rate, rel=1e-9)
        assert priced[(budget, k)][0] == pytest.approx(best_rate, rel=1e-9)
        assert plan.seconds == pytest.approx(priced[(budget, k)][1], rel=1e-9)
    else:
        assert not any(plan.budgets.values()) and plan.best_rate == plan.plain_rate


@pytest.mark.parametrize("seed", range(40))
def test_plain_float_estimates_are_the_array_ones_bit_for_bit(seed):
    """A single stream's plan prices its forwards in plain floats (``estimate_values``):
    the same numbers as ``estimate_many``'s ``np.interp``, at the curve's points,
    between them, below, beyond, at zero, and with no curve yet."""
    import numpy as np

    rng = random.Random(seed)
    model = CostModel()
    if seed % 8:
        sizes = rng.sample([1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 65, 128], rng.randrange(1, 9))
        model.seed({n: rng.uniform(0.001, 0.2) * (1 + n / rng.choice([8, 64])) for n in sizes})
        for _ in range(rng.randrange(3)):
            model.observe(rng.randrange(1, 200), rng.uniform(0.001, 0.5))
    values = [rng.choice([0.0, -1.0, 1.0, 2.0, 3.5, 64.0, 65.0, 129.0, 1e4]) if rng.random() < 0.4
              else rng.uniform(0.0, 300.0) for _ in range(24)]
    assert model.estimate_values(values) == model.estimate_many(np.asarray(values)).tolist()
