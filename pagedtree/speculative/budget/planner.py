"""Choosing each step's tree budgets from calibrated costs and acceptance rates.

Speculation pays when the extra tokens it commits outweigh what drafting, the wider
verify pass and the extra host work cost. The pieces:

- ``CostModel``: seconds of one forward against the tokens in it, per model. Seeded
  at load from a calibration (``budget.calibration``: measured once per model,
  device and dtype, cached on disk), refined by the run's own timings. On a CPU the
  curve is flat while the weights' memory traffic dominates and linear once the
  matmuls are compute bound, which is why trees must shrink as the batch grows.
- ``HostOverhead``: host seconds per request and step outside the forwards, for
  plain decoding and the extra for a speculating request (tree building,
  verification), measured online.

``plan_budgets`` predicts committed tokens per second of the whole step for plain
decoding and for letting the ``k`` requests most likely to gain speculate with a
budget ``b``, for every ``k`` and candidate ``b``, and takes the best, plain
decoding unless speculating is predicted to be at least ``SPECULATE_MARGIN`` faster.
There is no exploration: the prediction is sane from the first step.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedtree.speculative.tree import TreeShape

_EMA = 0.2
# Speculate only where predicted at least this much faster than plain decoding:
# the prediction's errors must not make speculation lose.
SPECULATE_MARGIN = 1.05


@dataclass(slots=True)
class CostModel:
    """Forward time (seconds) against tokens per forward (half-octave buckets)."""

    prior_seconds_per_forward: float = 0.05
    buckets: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean n, mean s)
    # The buckets as sorted arrays for ``estimate_many``, rebuilt after a change: the
    # planner prices a few dozen forwards a step, and rebuilding them each time was
    # most of its host time.
    _curve: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)
    _points: tuple[list[float], list[float]] | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def _bucket(num_tokens: float) -> int:
        return int(math.log2(num_tokens) * 2)

    def seed(self, seconds: Mapping[int, float]) -> None:
        """Start from a calibration (``{tokens: seconds}``), replacing what was known.

        A forward never gets cheaper with more tokens, so timing noise that says
        otherwise is averaged out first (isotonic regression).
        """
        points = [(float(n), float(s)) for n, s in sorted(seconds.items()) if n > 0 and s > 0]
        smoothed = _non_decreasing([s for _, s in points])
        self.buckets = {self._bucket(n): (n, s) for (n, _), s in zip(points, smoothed)}
        self._curve = self._points = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one forward of ``num_tokens`` tokens that took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        b = self._bucket(num_tokens)
        if b in self.buckets:
            n0, s0 = self.buckets[b]
            self.buckets[b] = (n0 + _EMA * (num_tokens - n0), s0 + _EMA * (seconds - s0))
        else:
            self.buckets[b] = (float(num_tokens), seconds)
        self._curve = self._points = None

    @property
    def has_data(self) -> bool:
        """Whether any forward was observed or calibrated."""
        return bool(self.buckets)

    def estimate(self, num_tokens: int) -> float:
        """Predicted seconds of a forward of ``num_tokens`` tokens."""
        return float(self.estimate_many(np.asarray([num_tokens], dtype=np.float64))[0])

    def estimate_many(self, num_tokens: np.ndarray) -> np.ndarray:
        """``estimate`` of every entry (0 for entries <= 0)."""
        n = np.asarray(num_tokens, dtype=np.float64)
        if not self.buckets:
            out = self.prior_seconds_per_forward * np.maximum(1.0, n / 64)
        else:
            if self._curve is None:
                points = sorted(self.buckets.values())
                self._curve = (np.asarray([p[0] for p in points]), np.asarray([p[1] for p in points]))
            xs, ys = self._curve
            out = np.interp(n, xs, ys)
            # Beyond what was seen: assume compute bound (proportional), never cheaper.
            beyond = n > xs[-1]
            out[beyond] = ys[-1] * n[beyond] / xs[-1]
        return np.where(n > 0, out, 0.0)

    def estimate_values(self, num_tokens: Sequence[float]) -> list[float]:
        """``estimate_many`` of a few values, in plain floats: the same arithmetic as
        ``np.interp`` (and the same results, bit for bit), without numpy's per-call
        cost, which was most of a single stream's planning time."""
        if not self.buckets:
            return [self.prior_seconds_per_forward * max(1.0, n / 64) if n > 0 else 0.0 for n in num_tokens]
        if self._points is None:
            points = sorted(self.buckets.values())
            self._points = ([float(x) for x, _ in points], [float(y) for _, y in points])
        xs, ys = self._points
        last = len(xs) - 1
        out = []
        for n in num_tokens:
            if n <= 0:
                out.append(0.0)
            elif n > xs[last]:  # beyond what was seen: compute bound (proportional)
                out.append(ys[last] * n / xs[last])
            elif n < xs[0]:
                out.append(ys[0])
            else:
                j = bisect.bisect_right(xs, n) - 1
                if j == last or xs[j] == n:
                    out.append(ys[j])
                else:
                    out.append((ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (n - xs[j]) + ys[j])
        return out


def _non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out.extend([total / count] * int(count))
    return out


@dataclass(slots=True)
class HostOverhead:
    """Host seconds per request and step outside the forwards (EMAs).

    ``plain``: every decoding request (sampling, output processing); ``speculating``:
    the extra of a request that drafts and verifies a tree. The prior for the latter
    is deliberately not zero so that the first steps do not over-speculate.
    """

    plain: float = 0.0
    speculating: float = 0.002

    def observe(self, host_seconds: float, num_requests: int, num_speculating: int) -> None:
        """Fold in one decode-only step's host time."""
        if num_requests <= 0 or host_seconds < 0:
            return
        if num_speculating == 0:
            self.plain += _EMA * (host_seconds / num_requests - self.plain)
        else:
            extra = max(0.0, host_seconds - self.plain * num_requests) / num_speculating
            self.speculating += _EMA * (extra - self.speculating)


@dataclass(slots=True)
class StepCosts:
    """What the planner needs to price a step."""

    target: CostModel
    draft: CostModel
    overhead: HostOverhead
    # Budget -> nodes the drafts feed per level for one request (empty: no draft model).
    draft_levels: Mapping[int, Sequence[int]]
    # Measured / predicted extra seconds of the speculative steps taken so far: the
    # whole-step truth that corrects whatever the parts above miss.
    speculation_factor: float = 1.0


@dataclass(slots=True)
class BudgetPlan:
    """The budgets chosen for a step and the predictions behind them."""

    budgets: dict[str, int]
    plain_rate: float  # predicted committed tokens per second without speculation
    best_rate: float  # ... with the chosen budgets
    plain_seconds: float = 0.0  # predicted seconds of the step without speculation
    seconds: float = 0.0  # ... with the chosen budgets

    @property
    def num_speculating(self) -> int:
        """Requests given a tree."""
        return sum(1 for b in self.budgets.values() if b > 0)


def plan_budgets(
    expected: Mapping[str, Mapping[int, float]],
    other_tokens: int,
    costs: StepCosts,
    margin: float = SPECULATE_MARGIN,
    catch_up: Mapping[str, float] | None = None,
    draft_free: Collection[str] = (),
) -> BudgetPlan:
    """Per-request budgets (0 = plain decoding) that maximise the step's predicted
    committed tokens per second (see module docstring).

    ``expected[request][b]`` is the request's expected accepted tokens with a tree of
    budget ``b``; ``other_tokens`` (prefill chunks) ride along in the target pass:
    rates are of the decoding requests alone, with trees priced at what they add to
    the loaded pass. ``catch_up[request]`` are tokens the drafts must feed before
    they can draft for it (a prompt, or what was decoded while it did not
    speculate), as amortised by the caller. Requests in ``draft_free`` have a tree
    that costs no draft forward (the suffix drafter's, verified alone).
    """
    if len(expected) == 1:
        return _plan_one(expected, other_tokens, costs, margin, catch_up, draft_free)
    return _plan_many(expected, other_tokens, costs, margin, catch_up, draft_free)


def _plan_many(expected: Mapping[str, Mapping[int, float]], other_tokens: int, costs: StepCosts, margin: float,
               catch_up: Mapping[str, float] | None, draft_free: Collection[str]) -> BudgetPlan:
    """``plan_budgets`` for any number of requests, in array operations."""
    ids = list(expected)
    r = len(ids)
    # Prefill chunks ride along either way; what speculation must beat is decoding's
    # own rate, and what it costs is the pass's growth at the step's actual load.
    plain_seconds, loaded = (float(x) for x in costs.target.estimate_many(np.asarray([r, r + other_tokens])))
    plain_seconds += costs.overhead.plain * r
    plain_rate = r / max(plain_seconds, 1e-9)
    candidates = sorted({b for e in expected.values() for b in e if b > 0})
    if not candidates:
        return BudgetPlan({i: 0 for i in ids}, plain_rate, plain_rate, plain_seconds, plain_seconds)

    def by_gain(b: int) -> list[str]:
        # Most expected tokens first; of equals, those that cost no draft forward.
        return sorted(ids, key=lambda i: (-expected[i].get(b, 0.0), i not in draft_free))

    # Every candidate budget (rows) and every number k of requests speculating
    # (columns) priced at once: a step is planned in a few array operations whatever
    # the candidates and levels, which keeps the planner's host time small beside a
    # single stream's step.
    orders = [by_gain(b) for b in candidates]
    gained = np.cumsum([[expected[i].get(b, 0.0) for i in order] for b, order in zip(candidates, orders)], axis=1)
    # The draft models run only for requests that are not draft-free; they feed
    # those requests' accepted tokens and backlog.
    drafts_for = np.asarray([[i not in draft_free for i in order] for order in orders], dtype=np.float64)
    drafting = np.cumsum(drafts_for, axis=1)
    first_feed = [[expected[i].get(b, 0.0) + (catch_up.get(i, 0.0) if catch_up else 0.0) for i in order]
                  for b, order in zip(candidates, orders)]
    fed_first = np.cumsum(drafts_for * np.asarray(first_feed), axis=1)
    ks = np.arange(1, r + 1, dtype=np.float64)
    budgets_column = np.asarray(candidates, dtype=np.float64)[:, None]
    seconds = plain_seconds + costs.target.estimate_many(other_tokens + r + ks * budgets_column) - loaded
    # Draft levels of every candidate in one estimate: the first level also feeds the
    # tokens accepted last step and any backlog; later levels of one width cost alike
    # (a chain's are all one node wide).
    rows, tokens, weights = [], [], []
    for row, b in enumerate(candidates):
        levels = costs.draft_levels.get(b, ())
        if levels:
            rows.append(row)
            tokens.append(drafting[row] * levels[0] + fed_first[row])
            weights.append(1.0)
            for fed, count in _later_levels(tuple(levels)):
                rows.append(row)
                tokens.append(drafting[row] * fed)
                weights.append(float(count))
    if rows:
        draft_seconds = costs.draft.estimate_many(np.asarray(tokens)) * np.asarray(weights)[:, None]
        np.add.at(seconds, np.asarray(rows), draft_seconds)
    seconds = seconds + costs.overhead.speculating * ks
    seconds = plain_seconds + (seconds - plain_seconds) * costs.speculation_factor
    rates = (r + gained) / np.maximum(seconds, 1e-9)
    best = (plain_rate * margin, 0, 0, plain_seconds)  # (rate to beat, budget, k, seconds)
    for row, b in enumerate(candidates):  # the smallest budget of equal rates
        k = int(np.argmax(rates[row]))
        if rates[row, k] > best[0]:
            best = (float(rates[row, k]), b, k + 1, float(seconds[row, k]))
    _, budget, k, chosen_seconds = best
    chosen = set(orders[candidates.index(budget)][:k]) if budget else set()
    budgets = {i: (budget if i in chosen else 0) for i in ids}
    best_rate = best[0] if budget else plain_rate
    return BudgetPlan(budgets, plain_rate, best_rate, plain_seconds, chosen_seconds)


def _plan_one(expected: Mapping[str, Mapping[int, float]], other_tokens: int, costs: StepCosts, margin: float,
              catch_up: Mapping[str, float] | None, draft_free: Collection[str]) -> BudgetPlan:
    """``plan_budgets`` for a single request (one stream, planned every step): the same
    arithmetic as ``_plan_many`` in the same order, on scalars, with one cost-curve
    lookup per model (the array version's few dozen small array operations were most
    of a single stream's planning time)."""
    (rid, gains), = expected.items()
    candidates = sorted(b for b in gains if b > 0)
    drafts = 0.0 if rid in draft_free else 1.0
    extra = catch_up.get(rid, 0.0) if catch_up else 0.0
    # Every forward the plan prices, looked up at once per model.
    target_tokens = [1.0, 1.0 + other_tokens] + [other_tokens + 1.0 + b for b in candidates]
    draft_tokens: list[float] = []
    draft_weights: list[list[float]] = []
    for b in candidates:
        levels = costs.draft_levels.get(b, ())
        weights = []
        if levels:
            draft_tokens.append(drafts * levels[0] + drafts * (gains.get(b, 0.0) + extra))
            weights.append(1.0)
            for fed, count in _later_levels(tuple(levels)):
                draft_tokens.append(drafts * fed)
                weights.append(float(count))
        draft_weights.append(weights)
    target_seconds = costs.target.estimate_values(target_tokens)
    draft_seconds = costs.draft.estimate_values(draft_tokens) if draft_tokens else []
    plain_seconds, loaded = target_seconds[0], target_seconds[1]
    plain_seconds += costs.overhead.plain
    plain_rate = 1.0 / max(plain_seconds, 1e-9)
    best = (plain_rate * margin, 0, plain_seconds)  # (rate to beat, budget, seconds)
    at = 0
    for index, b in enumerate(candidates):
        seconds = plain_seconds + target_seconds[2 + index] - loaded
        for weight in draft_weights[index]:
            seconds += draft_seconds[at] * weight
            at += 1
        seconds += costs.overhead.speculating
        seconds = plain_seconds + (seconds - plain_seconds) * costs.speculation_factor
        rate = (1.0 + gains.get(b, 0.0)) / max(seconds, 1e-9)
        if rate > best[0]:
            best = (rate, b, seconds)
    rate, budget, chosen_seconds = best
    return BudgetPlan({rid: budget}, plain_rate, rate if budget else plain_rate, plain_seconds, chosen_seconds)


@functools.lru_cache(maxsize=256)
def _later_levels(levels: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """The draft levels after the first as ``(nodes fed, levels of that width)``, in
    order of first appearance (a chain's are all one node wide)."""
    return tuple(Counter(levels[1:]).items())


def fed_per_level(shape: TreeShape) -> list[int]:
    """Nodes a draft model feeds per level: the root, then every node with children."""
    if shape.num_nodes == 0:
        return []
    depth = [0] * shape.num_nodes
    has_children = [False] * shape.num_nodes
    for i, p in enumerate(shape.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
        if p >= 0:
            has_children[p] = True
    levels = [1]
    for i in range(shape.num_nodes):
        if has_children[i]:
            while len(levels) <= depth[i]:
                levels.append(0)
            levels[depth[i]] += 1
    return levels
