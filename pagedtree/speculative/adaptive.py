"""Choosing each step's tree budget from measured costs and acceptance rates.

Speculation pays when the extra tokens it commits outweigh what drafting and the
wider verify pass cost. Both sides are measured while the engine runs:

- ``CostModel``: seconds of one forward as a function of the tokens in it, per
  model (piecewise-linear over log-spaced buckets of observed steps). On a CPU the
  curve is flat while the weights' memory traffic dominates and linear once the
  matmuls are compute bound, which is why trees must shrink as the batch grows.
- ``RankAcceptance``: how often the rank-``r`` child is accepted when it is tried,
  the per-rank rates of Sequoia (they also size Sequoia shapes).

- ``BudgetOutcome``: what speculating with each candidate budget delivered —
  committed tokens, tree nodes, draft levels and fed tokens per request and step.

``choose_budget`` predicts committed tokens per second of every candidate budget at
the current batch, 0 (plain decoding) included, and takes the best; a budget never
tried is tried once if its prediction is not hopeless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedtree.speculative.sequoia import expected_accepted
from pagedtree.speculative.tree import TreeShape

_EMA = 0.2


@dataclass(slots=True)
class CostModel:
    """Measured forward time (seconds) against tokens per forward."""

    prior_seconds_per_forward: float = 0.05
    buckets: dict[int, tuple[float, float]] = field(default_factory=dict)  # bucket -> (mean n, mean s)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one forward of ``num_tokens`` tokens that took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        b = int(math.log2(num_tokens) * 2)  # half-octave buckets
        if b in self.buckets:
            n0, s0 = self.buckets[b]
            self.buckets[b] = (n0 + _EMA * (num_tokens - n0), s0 + _EMA * (seconds - s0))
        else:
            self.buckets[b] = (float(num_tokens), seconds)

    @property
    def has_data(self) -> bool:
        """Whether any forward was observed."""
        return bool(self.buckets)

    def estimate(self, num_tokens: int) -> float:
        """Predicted seconds of a forward of ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return 0.0
        points = sorted(self.buckets.values())
        if not points:
            return self.prior_seconds_per_forward * max(1.0, num_tokens / 64)
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (n0, s0), (n1, s1) in zip(points, points[1:]):
            if num_tokens <= n1:
                return s0 + (s1 - s0) * (num_tokens - n0) / (n1 - n0)
        n_last, s_last = points[-1]
        # Beyond what was seen: assume compute bound (proportional), never cheaper.
        return s_last * max(1.0, num_tokens / n_last)


@dataclass(slots=True)
class RankAcceptance:
    """Per-rank acceptance counts, with a weak prior so early estimates are sane."""

    tried: list[float] = field(default_factory=lambda: [4.0, 4.0, 4.0, 4.0])
    accepted: list[float] = field(default_factory=lambda: [2.4, 0.8, 0.4, 0.2])

    def observe(self, rank_trials: Sequence[tuple[int, bool]]) -> None:
        """Record the children tested by one verification."""
        for rank, hit in rank_trials:
            while rank >= len(self.tried):
                self.tried.append(1.0)
                self.accepted.append(0.0)
            self.tried[rank] += 1
            self.accepted[rank] += 1 if hit else 0

    def rates(self) -> tuple[float, ...]:
        """Conditional acceptance rate per rank (see ``pagedtree.speculative.sequoia``)."""
        return tuple(a / t if t > 0 else 0.0 for a, t in zip(self.accepted, self.tried))


@dataclass(slots=True)
class BudgetOutcome:
    """What speculating with one budget has delivered, per request and step (EMAs).

    Acceptance does not depend on the batch size, so what a budget delivered at any
    batch size predicts what it delivers at another; only the costs change.
    """

    committed: float  # tokens committed per request-step (accepted + the target's own)
    nodes: float  # tree nodes per request
    levels: float  # draft forwards per step
    fed: float  # tokens the draft feeds per request and step, all levels together
    count: int = 0

    def observe(self, committed: float, nodes: float, levels: float, fed: float) -> None:
        """Fold in one step's averages."""
        if self.count == 0:
            self.committed, self.nodes, self.levels, self.fed = committed, nodes, levels, fed
        else:
            self.committed += _EMA * (committed - self.committed)
            self.nodes += _EMA * (nodes - self.nodes)
            self.levels += _EMA * (levels - self.levels)
            self.fed += _EMA * (fed - self.fed)
        self.count += 1

    @classmethod
    def prior(cls, shape: TreeShape, rates: Sequence[float]) -> BudgetOutcome:
        """Before any measurement: Sequoia's estimate for the shape (pessimistic on
        predictable text, where acceptances along a path are correlated)."""
        fed = _fed_per_level(shape)
        return cls(1.0 + expected_accepted(shape, rates), float(shape.num_nodes), float(len(fed)), float(sum(fed)))


@dataclass(slots=True)
class BudgetChoice:
    """The budget picked for a step and the predicted rates that decided it."""

    budget: int
    expected_tokens_per_second: dict[int, float]


# A budget never tried is explored when its predicted rate is within this factor of
# the best prediction: cheap to learn at small batches, skipped where clearly hopeless.
EXPLORE_WITHIN = 0.6


def choose_budget(
    num_decoding: int,
    other_tokens: int,
    outcomes: dict[int, BudgetOutcome],
    target_cost: CostModel,
    draft_cost: CostModel,
) -> BudgetChoice:
    """The per-request node budget (0 = plain decoding) with the best predicted rate.

    ``outcomes`` maps every candidate budget to what it delivered (or its prior).
    ``other_tokens`` (prefill chunks) ride along in the target pass either way.
    """
    r = num_decoding
    rates: dict[int, float] = {0: r / max(target_cost.estimate(r + other_tokens), 1e-9)}
    for budget, out in outcomes.items():
        seconds = target_cost.estimate(int(r * (1 + out.nodes)) + other_tokens)
        if out.levels > 0:
            seconds += out.levels * draft_cost.estimate(max(1, int(r * out.fed / out.levels)))
        rates[budget] = r * out.committed / max(seconds, 1e-9)
    best = max(rates, key=lambda b: (rates[b], -b))
    untried = [b for b, out in outcomes.items() if out.count == 0 and rates[b] >= EXPLORE_WITHIN * rates[best]]
    if untried:
        best = max(untried)
    return BudgetChoice(best, rates)


def _fed_per_level(shape: TreeShape) -> list[int]:
    """Nodes the draft feeds per level: the root, then every node with children."""
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


@dataclass(slots=True)
class RealizedRates:
    """Measured committed tokens per second of whole decode-only steps, per batch-size
    bucket and budget: the final word on whether speculation pays at a batch size."""

    rates: dict[tuple[int, int], float] = field(default_factory=dict)

    @staticmethod
    def bucket(num_decoding: int) -> int:
        """Exact up to 4 requests, then half-octaves."""
        return num_decoding if num_decoding <= 4 else 4 + int(math.log2(num_decoding / 4) * 2)

    def observe(self, num_decoding: int, budget: int, tokens_per_second: float) -> None:
        """Fold in one step."""
        key = (self.bucket(num_decoding), budget)
        old = self.rates.get(key)
        self.rates[key] = tokens_per_second if old is None else old + 0.3 * (tokens_per_second - old)

    def best(self, num_decoding: int, predicted: dict[int, float], fallback: int) -> int:
        """The budget with the best rate, measured where measured, else predicted.

        Only budgets measured at this bucket, or the model's own pick, compete, so a
        budget the model rates highly but that measured slow loses to plain decoding.
        """
        b = self.bucket(num_decoding)
        measured = {budget: r for (bk, budget), r in self.rates.items() if bk == b}
        if not measured or fallback not in measured:
            return fallback
        if 0 not in measured:
            measured[0] = predicted.get(0, 0.0)
        return max(measured, key=lambda k: (measured[k], -k))
