"""Verifying one request's tree against the target's logits at every tree node.

The verifier computes, at each verify row, exactly the distribution plain sampling
would draw from there (penalties and ``min_tokens`` with that node's own history),
then accepts a path by the rule that matches how the children were proposed
(``verify``), and reports each committed token's logprob from its parent's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedtree.request import Request
from pagedtree.sampling import (
    VERIFY_STREAM,
    SamplingRow,
    apply_penalties,
    coupled_draws,
    stream_seed,
    target_probs,
    top_logprobs,
)
from pagedtree.speculative.noise import NoiseCache
from pagedtree.speculative.tree import TokenTree
from pagedtree.speculative.verify import VerifyResult, verify_greedy, verify_stochastic


@dataclass(slots=True)
class VerifiedTokens:
    """What one verification commits: tokens in order, with their raw logprobs."""

    result: VerifyResult
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]

    def entries(self) -> list[tuple[int, float, dict[int, float] | None]]:
        """``(token, logprob, top_logprobs)`` per committed token."""
        return list(zip(self.token_ids, self.logprobs, self.top_logprobs))


class Verifier:
    """Verifies trees; owns the random streams of stochastic verification."""

    def __init__(self, noise: NoiseCache, device: torch.device | str = "cpu"):
        self.noise = noise
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def verify(self, request: Request, tree: TokenTree, logits: torch.Tensor, rule: str) -> VerifiedTokens:
        """Accept a path of ``tree`` from the target's logits ``[1 + T, V]``.

        ``rule`` is how the children were proposed (``proposer.proposal_rule``):
        greedy requests follow the argmax, coupled ones the Gumbel-max draw with the
        request's noise, the others stochastic verification.
        """
        params = request.params
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = apply_penalties(logits.clone(), self._sampling_rows(request, tree))
        if params.greedy:
            result = verify_greedy(tree, processed.argmax(dim=-1).tolist())
        elif rule == "coupled":
            # Row r's token is drawn at output position root + depth(r) + 1, with the
            # same noise plain decoding uses there.
            first = len(request.output_token_ids)
            noise = torch.stack([self.noise.get(request.sampling_seed, first + d) for d in [0] + tree.depths])
            result = verify_greedy(tree, coupled_draws(processed, params, noise).tolist())
            self.noise.drop(request.sampling_seed)
        else:
            result = verify_stochastic(tree, target_probs(processed, params), self._generator(request))
        tokens = [tree.tokens[n] for n in result.accepted_nodes] + [result.bonus_token]
        # Each token was drawn from the distribution at its parent's row.
        source_rows = [0] + [1 + n for n in result.accepted_nodes]
        chosen = raw_logprobs[torch.as_tensor(source_rows), torch.as_tensor(tokens)].tolist()
        tops = [top_logprobs(raw_logprobs[row], token, lp, params.logprobs)
                for row, token, lp in zip(source_rows, tokens, chosen)]
        return VerifiedTokens(result, tokens, chosen, tops)

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
