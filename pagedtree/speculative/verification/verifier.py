"""Verifying one request's tree against the target's logits at every tree node.

The verifier computes, at each verify row, exactly the distribution plain sampling
would draw from there (penalties and ``min_tokens`` with that node's own history, a
grammar's mask in the state after that node's path),
then gives every row the target's token by the rule that matches how the children
were proposed (``row_outcomes``, on the device), and, once the step is read back,
accepts a path (``walk``) and reports each committed token's logprob from its
parent's row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedtree.request import Request
from pagedtree.sampling import (
    VERIFY_STREAM,
    DeviceRows,
    NonFiniteDistributionError,
    SampleResult,
    SamplingRow,
    apply_penalties,
    coupled_draws,
    row_results,
    stream_seed,
    target_probs,
)
from pagedtree.speculative.noise import NoiseCache
from pagedtree.structured.matcher import apply_bitmasks, fill_bitmasks
from pagedtree.speculative.tree import TokenTree
from pagedtree.speculative.verification.rules import RowTests, VerifyResult, verify_greedy, walk_stochastic


class Verifier:
    """Verifies trees; owns the random streams of stochastic verification."""

    def __init__(self, noise: NoiseCache, device: torch.device | str = "cpu"):
        self.noise = noise
        self.device = device
        # On a GPU every stochastic row is decided at once, with no host sync; on a
        # CPU a sync is free, and deciding only the rows the walk reaches saves the
        # others' work. Both give the same tokens (``RowTests``).
        self.decide_all_rows = torch.device(device).type != "cpu"
        self._generators: dict[str, torch.Generator] = {}

    def row_outcomes(self, request: Request, tree: TokenTree, logits: torch.Tensor, rule: str,
                     bitmasks: torch.Tensor | None = None) -> DeviceRows:
        """The target's token at every verify row of ``tree``, on the logits' device
        (no host sync), from its logits ``[1 + T, V]``.

        ``rule`` is how the children were proposed (``proposer.proposal_rule``):
        greedy rows take the argmax, coupled ones the Gumbel-max draw with the
        request's noise, the others the outcome of stochastic verification at that
        row (``RowTests``). Each row also carries the raw logprob of its
        token and the top logprobs asked for: the committed token drawn at a row is
        that row's token. ``bitmasks`` are the grammar's ``[1 + T, W]`` rows when
        the caller filled them already (:func:`tree_bitmasks_of`).
        """
        params = request.params
        if logits.shape[0] != tree.num_nodes + 1:
            raise ValueError(f"{logits.shape[0]} rows of logits for a tree of {tree.num_nodes} nodes")
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
        processed = apply_penalties(logits.clone(), self._sampling_rows(request, tree))
        if request.grammar is not None:
            # Each row's distribution is the constrained one plain decoding would have
            # there: masked by the grammar's state after that row's path.
            if bitmasks is None:
                bitmasks = request.grammar.tree_bitmasks(tree.tokens, tree.parents)
            apply_bitmasks(processed, range(tree.num_nodes + 1), bitmasks)
        accepted = None
        if params.greedy:
            tokens = processed.argmax(dim=-1)
        elif rule == "coupled":
            # Row r's token is drawn at output position root + depth(r) + 1, with the
            # same noise plain decoding uses there.
            first = len(request.output_token_ids)
            noise = torch.stack([self.noise.get(request.sampling_seed, first + d) for d in [0] + tree.depths])
            tokens = coupled_draws(processed, params, noise)
            self.noise.drop(request.sampling_seed)
        else:
            tests = RowTests(tree, target_probs(processed, params), self._generator(request))
            tokens, accepted = tests.all_rows() if self.decide_all_rows else tests.along_walk()
        return row_results(tokens, raw_logprobs, [params.logprobs] * (tree.num_nodes + 1), accepted, logits)

    @staticmethod
    def walk(tree: TokenTree, rows: list[SampleResult], accepted: list[bool] | None) -> VerifyResult:
        """Accept a path from the row outcomes read back (``row_outcomes``): the
        longest path whose tokens are the rows' tokens, stochastic verification's
        trials when ``accepted`` flags are given; with the tokens it commits."""
        if not all(r.valid for r in rows):
            raise NonFiniteDistributionError()
        targets = [r.token_id for r in rows]
        result = verify_greedy(tree, targets) if accepted is None else walk_stochastic(tree, targets, accepted)
        tokens = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
        # Each token was drawn at its parent's row: that row's token, logprob and tops.
        source = [rows[0]] + [rows[1 + n] for n in result.accepted_nodes]
        result.committed = [(t, r.logprob, r.top_logprobs) for t, r in zip(tokens, source)]
        return result

    def release(self, request_id: str) -> None:
        """Forget a request's stream (it ended)."""
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(stream_seed(request.sampling_seed, VERIFY_STREAM))
            self._generators[request.request_id] = gen
        return gen

    @staticmethod
    def _sampling_rows(request: Request, tree: TokenTree) -> list[SamplingRow]:
        """One sampling row per verify row: the history and output count the target
        would have at that node in plain decoding (for penalties and min_tokens)."""
        params = request.params
        needs_history = params.repetition_penalty != 1.0
        base = request.all_token_ids if needs_history else ()
        n_out = len(request.output_token_ids)
        rows = [SamplingRow(params, base, n_out, None)]
        for node in range(tree.num_nodes):
            history = base
            if needs_history:
                history = list(base) + [tree.tokens[i] for i in tree.path_to(node)]
            rows.append(SamplingRow(params, history, n_out + tree.depths[node], None))
        return rows


def tree_bitmasks_of(requests: Sequence[Request], trees: dict[str, TokenTree]) -> dict[str, torch.Tensor]:
    """The grammar bitmasks ``[1 + T, W]`` of every constrained request's tree, by
    request id, filled in one batch (xgrammar spreads the rows over threads)."""
    spans: list[tuple[str, int, int]] = []
    matchers: list = []
    width = 0
    for request in requests:
        if request.grammar is None:
            continue
        tree = trees[request.request_id]
        rows = request.grammar.tree_matchers(tree.tokens, tree.parents)
        spans.append((request.request_id, len(matchers), len(rows)))
        matchers += rows
        width = request.grammar.width  # one vocabulary per engine: one width
    if not matchers:
        return {}
    filled = fill_bitmasks(matchers, width)
    return {rid: filled[start:start + n] for rid, start, n in spans}
