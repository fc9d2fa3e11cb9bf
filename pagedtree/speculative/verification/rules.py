"""Verifying a token tree against the target model's outputs at every node.

Rows of the verify pass: row 0 is the root (the request's newest token), row
``1 + i`` is tree node ``i``. Three ways to verify, one per kind of request:

- **greedy**: follow the target's argmax down the tree;
- **coupled** (seeded sampling requests): the target's token at every row is the
  Gumbel-max draw with the request's noise for that output position, exactly the
  token plain decoding draws there, and the tree is walked as in greedy. The
  output is then a function of the seed alone, whatever the tree;
- **stochastic** (other sampling requests): SpecInfer's multi-step speculative
  sampling (recursive rejection sampling), which preserves the target distribution
  with the rule that matches how each proposal was drawn. The proposals below a
  node are replayed draw by draw, in drawing order:

  - ``iid`` (independent samples of q): accept ``x`` with probability
    ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))``;
  - ``without_replacement``: the same test with ``q`` renormalised over the tokens
    this draw had not yet drawn (the distribution the sibling was drawn from);
  - ``topk`` (deterministic): accept with probability ``p(x)``; on rejection
    ``p <- norm(p with x removed)``.

  Each step is a valid rejection-sampling step for the current residual whatever
  came before, so proposals of several independent draws (several draft models,
  merged into one tree) chain correctly, each with its own ``q``. A token rejected
  once has no mass left in the residual, so a second proposal of it is rejected
  at once (only the residual update remains).

If no child is accepted (or the node is a leaf) the bonus token is drawn from the
final residual ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.sampling import host_index, inverse_transform
from pagedtree.speculative.tree import ROOT, ChildDraw, TokenTree

_EPS = 1e-12


@dataclass(slots=True)
class VerifyResult:
    """The accepted path (node indices, root's child first) and the target's next token.

    ``trials`` records, for every proposal tested, its depth (1 for the root's
    children), its rank among the proposals below its node and whether it was
    accepted: the measurements behind Sequoia shapes and the adaptive budget.
    ``committed`` (set by ``Verifier.walk``) holds the tokens the path commits, the
    bonus token last, each with the logprob and top logprobs of the row it was
    drawn at.
    """

    accepted_nodes: list[int]
    bonus_token: int
    trials: list[tuple[int, int, bool]] = field(default_factory=list)
    committed: list[tuple[int, float, dict[int, float] | None]] = field(default_factory=list)

    @property
    def rank_trials(self) -> list[tuple[int, bool]]:
        """``(rank, accepted)`` of every proposal tested."""
        return [(rank, hit) for _, rank, hit in self.trials]

    @property
    def num_accepted(self) -> int:
        """Draft tokens accepted (the bonus token not counted)."""
        return len(self.accepted_nodes)


def _children_by_parent(tree: TokenTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(tree: TokenTree, target_tokens: Sequence[int]) -> VerifyResult:
    """Longest path whose tokens equal the target's; ``target_tokens[r]`` is the
    target's token at verify row ``r`` (its argmax, or its coupled draw)."""
    if len(target_tokens) != tree.num_nodes + 1:
        raise ValueError(f"{len(target_tokens)} target tokens for a tree of {tree.num_nodes} nodes")
    kids = _children_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        want = int(target_tokens[node + 1])
        nxt = None
        for rank, child in enumerate(kids.get(node, [])):
            hit = tree.tokens[child] == want
            result.trials.append((len(result.accepted_nodes) + 1, rank, hit))
            if hit:
                nxt = child
                break
        if nxt is None:
            result.bonus_token = want
            return result
        result.accepted_nodes.append(nxt)
        node = nxt


def _draws_by_parent(tree: TokenTree) -> dict[int, list[ChildDraw]]:
    out: dict[int, list[ChildDraw]] = {}
    for draw in tree.draws:
        if draw.rule not in ("topk", "iid", "without_replacement"):
            raise ValueError(f"proposals drawn by {draw.rule!r} are not verified by rejection sampling")
        out.setdefault(draw.parent, []).append(draw)
    return out


class RowTests:
    """Multi-step speculative sampling's tests at every verify row, with all the
    random numbers drawn up front.

    ``target_probs [1 + T, V]`` are the target's (processed) distributions. At a
    row, the proposals below its node are tested in drawing order against the
    residual left by the ones before, one coin each; the row's outcome is the first
    that passes (accepted), else a draw from the final residual. Coins are indexed by
    (row, proposal) and each row has its own uniform for the residual draw, so a
    row's outcome depends on nothing else: the walk down the tree reads the outcomes
    of the rows it reaches, whether they were decided all at once (``all_rows``: no
    host sync, the GPU way) or one by one as the walk reaches them (``along_walk``:
    the CPU way, which skips rows off the path). Both give the same outcomes.
    """

    def __init__(self, tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None):
        rows = tree.num_nodes + 1
        if target_probs.shape[0] != rows:
            raise ValueError(f"{target_probs.shape[0]} rows of target probabilities for {tree.num_nodes} nodes")
        self.tree = tree
        self.target_probs = target_probs
        self.draws = _draws_by_parent(tree)
        device = target_probs.device
        self._first_coin = []
        used = 0
        for row in range(rows):
            self._first_coin.append(used)
            used += sum(len(d.tokens) for d in self.draws.get(row - 1, []))
        # One call for every coin, then one uniform per row for its residual draw.
        self._coins = torch.rand(used + rows, generator=generator, dtype=torch.float64, device=device)
        self._uniforms = self._coins[used:]

    def outcome(self, row: int, read: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token, accepted)`` of ``row``, as 0-d device tensors, with no host sync;
        ``read`` lets the host read as it goes and skip what cannot change the
        outcome (the CPU way; same result)."""
        device = self.target_probs.device
        p = self.target_probs[row].double()
        chosen = torch.zeros((), dtype=torch.long, device=device)
        decided = torch.zeros((), dtype=torch.bool, device=device)
        coin = self._first_coin[row]
        for draw in self.draws.get(row - 1, []):
            q_draw = draw.probs.to(device=device, dtype=torch.float64) if draw.probs is not None else None
            tried: list[int] = []
            for x in draw.tokens:
                if q_draw is None:  # topk: accept with probability p(x)
                    q = None
                    accept_prob = p[x]
                else:
                    q = q_draw
                    if draw.rule == "without_replacement" and tried:
                        q = q_draw.index_fill(0, host_index(tried, device), 0.0)
                        q = q / q.sum()
                    qx = q[x]
                    accept_prob = torch.where(qx <= 0.0, 1.0, torch.clamp(p[x] / qx.clamp_min(_EPS), max=1.0))
                tried.append(x)
                # Coins are in [0, 1): a token with no mass left is never accepted.
                hit = ~decided & (self._coins[coin] < accept_prob)
                coin += 1
                chosen = torch.where(hit, x, chosen)
                decided = decided | hit
                if read and bool(hit):  # the rest cannot change this row's outcome
                    return chosen, decided
                if q is None:
                    residual = p.clone()
                    residual[x] = 0.0
                else:
                    residual = torch.clamp(p - q, min=0.0)
                total = residual.sum()
                # A vanishing residual means p == q up to rounding: rejection had
                # probability ~0, and p itself is the right distribution to continue with.
                if read:
                    p = residual / total if float(total) > _EPS else p
                else:
                    p = torch.where(total > _EPS, residual / total.clamp_min(_EPS), p)
        # A row without a finite distribution gets V here, reported invalid by row_results.
        bonus = inverse_transform(p.reshape(1, -1), self._uniforms[row:row + 1])[0]
        return torch.where(decided, chosen, bonus), decided

    def all_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's ``(tokens [1 + T], accepted [1 + T])``, decided on the device."""
        outcomes = [self.outcome(row) for row in range(self.tree.num_nodes + 1)]
        return torch.stack([t for t, _ in outcomes]), torch.stack([a for _, a in outcomes])

    def along_walk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the walk reaches, decided one by one (a host read each); the
        other rows are left at token 0, not accepted, and never read."""
        rows = self.tree.num_nodes + 1
        tokens = torch.zeros(rows, dtype=torch.long)
        accepted = torch.zeros(rows, dtype=torch.bool)
        node = ROOT
        while True:
            token, hit = self.outcome(node + 1, read=True)
            tokens[node + 1], accepted[node + 1] = token, hit
            if not bool(hit):
                return tokens.to(self.target_probs.device), accepted.to(self.target_probs.device)
            node = self.tree.child(node, int(token))


def walk_stochastic(tree: TokenTree, tokens: Sequence[int], accepted: Sequence[bool]) -> VerifyResult:
    """The path that the row outcomes of ``stochastic_row_tokens`` (read back) give,
    with a trial recorded for every proposal tested on it."""
    if len(tokens) != tree.num_nodes + 1 or len(accepted) != len(tokens):
        raise ValueError(f"{len(tokens)} row outcomes for a tree of {tree.num_nodes} nodes")
    draws = _draws_by_parent(tree)
    result = VerifyResult([], -1)
    node = ROOT
    while True:
        want, hit_row = int(tokens[node + 1]), bool(accepted[node + 1])
        nxt = None
        rank = 0
        for draw in draws.get(node, []):
            for x in draw.tokens:
                hit = hit_row and x == want
                result.trials.append((len(result.accepted_nodes) + 1, rank, hit))
                if hit:
                    nxt = tree.child(node, x)
                    break
                rank += 1
            if nxt is not None:
                break
        if nxt is None:
            result.bonus_token = want
            return result
        result.accepted_nodes.append(nxt)
        node = nxt


def verify_stochastic(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """Distribution-preserving verification; ``target_probs [1 + T, V]`` are the
    target's (processed) next-token distributions at every verify row. The rows the
    walk reaches are decided as it reaches them (``RowTests.along_walk``)."""
    tokens, accepted = RowTests(tree, target_probs, generator).along_walk()
    return walk_stochastic(tree, tokens.tolist(), accepted.tolist())
