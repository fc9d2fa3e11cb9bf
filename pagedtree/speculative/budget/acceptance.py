"""How likely draft tokens are to be accepted: per request class, depth and rank,
and per request.

- ``AcceptanceTable``: conditional acceptance rates by depth (1 = the root's
  children) and rank (0 = the drafter's first choice at a node; rank ``r`` is tried
  after ranks ``0..r-1`` were rejected), as counts over a prior. The prior comes
  with the drafter (``priors``), so the first step's prediction is already sane; the
  counts of the run move it. Greedy and sampling requests keep separate tables
  (sampling accepts less).
- ``RequestEvidence``: how one request's trials compare with its class's rates (a
  discounted hits / expected-hits ratio). A request that drafts badly gets smaller
  trees or none; because the evidence is discounted every step, including steps it
  does not speculate, a request that stopped speculating is re-tried once its bad
  evidence has faded, and at once when a zero-cost drafter (the suffix tree) finds a
  match for it.
- ``PlanCalibration``: per class, the tokens the draft models' trees got accepted
  against what the plan expected of them when it chose them (the same discounted
  ratio, slower). The plan speculates where a request's estimate is high, and a
  request's estimate is high most often just after a lucky verification, so the
  chosen trees accept less than predicted where acceptance is low and noisy: on
  prose at temperature 0.8 the Qwen pair's chosen chains accepted 1.05 tokens where
  1.59 were expected (coding: 3.53 against 3.62), so the steps ran at plain speed
  for twice a plain step's work. The plan scales its expectations by this ratio.
- ``RankAcceptance``: per-rank acceptance pooled over depths (it sizes Sequoia shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedtree.sampling_params import SamplingParams
from pagedtree.speculative.tree import ROOT, TreeShape

GREEDY, SAMPLING = "greedy", "sampling"
REQUEST_CLASSES = (GREEDY, SAMPLING)
_MAX_RATE = 0.98


def request_class(params: SamplingParams) -> str:
    """The acceptance class of a request."""
    return GREEDY if params.greedy else SAMPLING


class AcceptanceTable:
    """Conditional acceptance by (depth, rank): counts on top of a prior (see module docstring)."""

    def __init__(self, prior: Sequence[Sequence[float]], strength: float = 16.0):
        if not prior or not all(prior):
            raise ValueError("an acceptance prior needs at least one depth with one rank")
        self._tried = [[strength] * len(row) for row in prior]
        self._accepted = [[strength * min(max(a, 0.0), 1.0) for a in row] for row in prior]

    def observe(self, trials: Sequence[tuple[int, int, bool]]) -> None:
        """Record ``(depth, rank, accepted)`` of every proposal one verification tested."""
        for depth, rank, hit in trials:
            d = depth - 1
            while d >= len(self._tried):  # deeper than seen: start from the deepest row
                self._tried.append(list(self._tried[-1]))
                self._accepted.append(list(self._accepted[-1]))
            tried, accepted = self._tried[d], self._accepted[d]
            while rank >= len(tried):
                tried.append(1.0)
                accepted.append(0.0)
            tried[rank] += 1.0
            accepted[rank] += 1.0 if hit else 0.0

    def rate(self, depth: int, rank: int) -> float:
        """P(the rank-``rank`` proposal at ``depth`` is accepted | it is tried)."""
        d = min(depth, len(self._tried)) - 1
        tried, accepted = self._tried[d], self._accepted[d]
        return accepted[rank] / tried[rank] if rank < len(tried) else 0.0

    def rows(self) -> list[list[float]]:
        """The rates, one row per depth."""
        return [[a / t for a, t in zip(acc, tri)] for acc, tri in zip(self._accepted, self._tried)]

    def expected_accepted(self, shape: TreeShape, scale: float = 1.0) -> float:
        """Expected accepted tokens of ``shape`` with every rate scaled by ``scale``
        (a request's evidence), the bonus token not counted."""
        depth = [0] * shape.num_nodes
        reach = [0.0] * shape.num_nodes
        # P(no earlier sibling accepted) per parent, as siblings are visited by rank.
        none_before: dict[int, float] = {}
        for i, (p, r) in enumerate(zip(shape.parents, shape.ranks)):
            depth[i] = 1 if p == ROOT else depth[p] + 1
            rate = min(_MAX_RATE, self.rate(depth[i], r) * scale)
            before = none_before.get(p, 1.0)
            reach[i] = (1.0 if p == ROOT else reach[p]) * before * rate
            none_before[p] = before * (1.0 - rate)
        return float(sum(reach))


@dataclass(slots=True)
class RequestEvidence:
    """One request's discounted accepted and expected-accepted counts."""

    hits: float = 0.0
    expected: float = 0.0

    # A pseudo-count that keeps one trial from moving the factor far; the weight of
    # each older verification; and of the evidence at each step without one (slower,
    # so that a request that stopped speculating is re-tried after some steps).
    STRENGTH = 1.0
    DISCOUNT = 0.85
    FADE = 0.93

    def observe(self, hits: int, expected: float) -> None:
        """Fold in one verification: accepted proposals against the class's expectation."""
        self.hits = self.hits * self.DISCOUNT + hits
        self.expected = self.expected * self.DISCOUNT + expected

    def fade(self) -> None:
        """A step without a verification: old evidence counts for less."""
        self.hits *= self.FADE
        self.expected *= self.FADE

    @property
    def factor(self) -> float:
        """How this request's acceptance compares with its class's (1 = the same)."""
        return (self.STRENGTH + self.hits) / (self.STRENGTH + self.expected)


@dataclass(slots=True)
class PlanCalibration(RequestEvidence):
    """A class's accepted tokens against the plan's expectation for the trees it chose
    (``hits``: accepted path tokens; ``expected``: the plan's expected accepted tokens
    before this correction). Slower than a request's evidence: the pseudo-count is four
    tokens, a verification's weight halves over about 25 more, and while the class does
    not speculate the ratio drifts back to 1 (halfway in about 35 steps), so that a
    class the correction stopped is tried again."""

    STRENGTH = 4.0
    DISCOUNT = 0.97
    FADE = 0.98


@dataclass(slots=True)
class RankAcceptance:
    """Per-rank acceptance counts pooled over depths, with a weak prior."""

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
        """Conditional acceptance rate per rank (see ``pagedtree.speculative.budget.sequoia``)."""
        return tuple(a / t if t > 0 else 0.0 for a, t in zip(self.accepted, self.tried))
