"""How a draft model proposes the children of its tree nodes, on the device.

The draft worker grows trees from these draws level by level on the host, or hands
a whole draft's levels (``DraftLevel``: plain data, every slot reserved) to the
worker, which runs them without a readback between levels (``worker/draft_levels.py``);
both draw with these functions, so both propose the same children. Nothing here
reads a tensor on the host but ``read_drawn``, the one readback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.sampling import host_index, target_probs
from pagedtree.sampling_params import SamplingParams
from pagedtree.step_data import BlockCopy, ScheduledChunk


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities the draft proposes from: the raw distribution for greedy
    requests, the request's processed distribution (temperature, top-k/p, min-p)
    for sampling ones, so that it resembles what the target will sample from."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    return torch.log(target_probs(logits, params))


@dataclass(slots=True)
class ChildRule:
    """How one fed node's children are drawn: up to ``k`` tokens by ``rule``
    (``"topk"``, ``"coupled"`` with the request's ``noise`` at the children's
    position, ``"iid"`` or ``"without_replacement"`` from ``generator``), from the
    draft distribution under ``params``."""

    k: int
    rule: str
    params: SamplingParams
    generator: torch.Generator | None = None
    noise: torch.Tensor | None = None


@dataclass(slots=True)
class DrawnChildren:
    """One node's children, on the device: the tokens in drawing order, each one's
    score increment (its draft log-probability, or for coupled proposals its
    log-probability of being the noisy argmax; ``-inf`` for a token the rule could
    not have drawn), and for the random rules the distribution drawn from."""

    tokens: torch.Tensor  # [k] int64
    increments: torch.Tensor  # [k] float
    probs: torch.Tensor | None = None


@dataclass(slots=True)
class DraftLevel:
    """One level of a whole draft: a forward over ``chunks``, after ``copies``.

    ``rules[j]``: how the children below chunk ``j``'s last token are drawn (None: it
    draws none, a node fed for its KV alone). ``feeds[j]``: for a chunk scheduled
    with a pending token, ``(i, rank)``, the child of rank ``rank`` drawn below chunk
    ``i`` of the level before, which becomes its input token on the device.
    """

    chunks: list[ScheduledChunk]
    rules: list[ChildRule | None]
    feeds: list[tuple[int, int] | None]
    copies: list[BlockCopy] = field(default_factory=list)


def draw_children(logprobs: torch.Tensor, k: int, rule: str, generator: torch.Generator | None,
                  noise: torch.Tensor | None = None) -> DrawnChildren:
    """Draw up to ``k`` sibling tokens from ``logprobs [V]`` by ``rule``, on the device.

    Without replacement, the ``k`` tokens are the top ``k`` of the log-probabilities
    plus Gumbel noise (the Gumbel-top-k trick: the same distribution, drawing order
    included, as ``k`` successive draws each renormalised over what is left).
    """
    k = min(k, logprobs.shape[-1])
    if rule in ("topk", "coupled"):
        scores = logprobs if rule == "topk" else logprobs + noise
        tokens = torch.topk(scores, k).indices
        ranked = logprobs if rule == "topk" else torch.log_softmax(scores, dim=-1)
        return DrawnChildren(tokens, ranked[tokens])
    probs = logprobs.exp()
    if rule == "iid":
        tokens = _iid_draws(probs, k, generator)
    elif rule == "without_replacement":
        u = torch.rand(logprobs.shape, generator=generator, device=logprobs.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tokens = torch.topk(logprobs.double() + gumbel, k).indices
    else:
        raise ValueError(f"unknown draft sampling rule {rule!r}")
    return DrawnChildren(tokens, logprobs[tokens], probs)


def draw_by_rule(logits: torch.Tensor, how: ChildRule) -> DrawnChildren:
    """The children of a node whose draft logits are ``logits [V]``, drawn as ``how`` says."""
    return draw_children(draft_distribution(logits, how.params), how.k, how.rule, how.generator, how.noise)


def draw_groups(rules: Sequence[ChildRule | None]) -> tuple[dict[tuple, list[int]], list[int]]:
    """The rows of a level drawn together, by group key (``("topk", k)`` for greedy
    top-k rows, ``("coupled", k, temperature, top_k, top_p, min_p)`` for coupled
    sampled rows; rows ascending), and the rows drawn alone (the random rules, each
    from its own request's stream), in order. Rows whose rule is None are in neither."""
    groups: dict[tuple, list[int]] = {}
    alone: list[int] = []
    for i, rule in enumerate(rules):
        if rule is None:
            continue
        if rule.rule == "topk" and rule.params.greedy:
            groups.setdefault(("topk", rule.k), []).append(i)
        elif rule.rule == "coupled" and not rule.params.greedy:
            p = rule.params
            groups.setdefault(("coupled", rule.k, p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
        else:
            alone.append(i)
    return groups, alone


def draw_group(logits: torch.Tensor, key: tuple, params: SamplingParams,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The children ``(tokens [n, k], increments [n, k])`` of the rows ``logits [n, V]``
    of one group of ``draw_groups`` (``params``: any of its rows' parameters; ``noise
    [n, V]``: the coupled rows' noise). Device ops only, of fixed shapes: a CUDA graph
    can hold them."""
    logprobs = draft_distribution(logits, params)
    k = min(key[1], logprobs.shape[-1])
    if key[0] == "topk":
        top = torch.topk(logprobs, k, dim=-1)
        return top.indices, top.values
    scores = logprobs + noise
    tokens = torch.topk(scores, k, dim=-1).indices
    return tokens, torch.gather(torch.log_softmax(scores, dim=-1), -1, tokens)


def draw_level(logits: torch.Tensor, rules: Sequence[ChildRule | None]) -> list[DrawnChildren | None]:
    """The children below every row of a level's draft ``logits [n, V]`` (None where
    its rule is None). Rows drawn alike go together (``draw_groups``): greedy top-k
    rows of one ``k`` in one log-softmax and one top-k, coupled rows of one ``k`` and
    one set of sampling parameters in one processed distribution, one noisy top-k
    and one log-softmax (a level of a batch of chains is a few ops, not a few a
    row); random rows one by one (each draws from its own request's stream). Either
    way a row gets what ``draw_by_rule`` gives it alone: every op works row by row."""
    out: list[DrawnChildren | None] = [None] * len(rules)
    groups, alone = draw_groups(rules)
    for i in alone:
        out[i] = draw_by_rule(logits[i], rules[i])
    for key, rows in groups.items():
        # (rows ascend: as many as the level's are all of them, in order)
        picked = logits if len(rows) == logits.shape[0] else logits[host_index(rows, logits.device)]
        noise = torch.stack([rules[i].noise for i in rows]) if key[0] == "coupled" else None
        tokens, increments = draw_group(picked, key, rules[rows[0]].params, noise)
        for j, i in enumerate(rows):
            out[i] = DrawnChildren(tokens[j], increments[j])
    return out


def _iid_draws(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` independent draws from ``probs [V]`` on the device, the tokens
    ``torch.multinomial(probs, k, replacement=True)`` draws, without a host sync.

    For one sample, torch's own algorithm (argmax of ``probs / E``, ``E ~ Exp(1)``)
    without torch's checks of the distribution, which are host reads in older torch
    releases (newer ones assert on the device): the same token and the same
    generator state. Several samples with replacement are kernels only in every
    release. A distribution without mass gives a token of log-probability
    ``-inf`` (dropped on reading back), a NaN one a NaN increment (refused there).
    """
    if k == 1:
        race = torch.empty_like(probs).exponential_(1, generator=generator)
        return torch.argmax(probs / race, dim=-1, keepdim=True)
    return torch.multinomial(probs, k, replacement=True, generator=generator)


def read_drawn(drawn: Sequence[DrawnChildren]) -> list[tuple[list[int], list[float]]]:
    """Every node's children on the host, in one device-to-host copy (one sync for
    a whole draft level, or a whole draft, not two per node): per node its tokens and
    score increments, without the tokens the rule could not have drawn (``-inf``). A
    NaN increment (a draft distribution that is not a distribution) raises
    ``ValueError``: the requests then draft nothing this step."""
    if not drawn:
        return []
    flat = torch.cat([t for d in drawn for t in (d.tokens.to(torch.float64), d.increments.to(torch.float64))])
    host = flat.tolist()
    if any(value != value for value in host):
        raise ValueError("the draft's distribution has NaN entries")
    out, offset = [], 0
    for d in drawn:
        k = d.tokens.numel()
        tokens, increments = host[offset:offset + k], host[offset + k:offset + 2 * k]
        offset += 2 * k
        keep = [i for i, inc in enumerate(increments) if inc != -math.inf]
        out.append(([int(tokens[i]) for i in keep], [increments[i] for i in keep]))
    return out
