"""Appending sampled tokens to requests, one at a time, with exact stop checks, and
the user-facing outputs.

Tokens arrive one per step in plain decoding and several per step under tree
speculation; either way they pass through ``append_token`` one by one (``commit``
also moves a request's grammar past each), so EOS, stop tokens, stop strings,
max_tokens, the grammar's end and the context limit cut the output at exactly the
token where plain decoding would have stopped. ``request_output`` turns a user
request's sequences into the ``RequestOutput`` the caller sees.
"""

from __future__ import annotations

import time

from collections.abc import Mapping, Sequence

from pagedtree.engine.detokenizer import IncrementalDetokenizer
from pagedtree.engine.input_processor import ParentRequest
from pagedtree.outputs import CompletionOutput, RequestOutput
from pagedtree.request import Request, RequestStatus
from pagedtree.step_data import Committed


class OutputProcessor:
    """Owns each request's detokenizer and decides when a request is done."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generated_tokens = 0

    def append_token(
        self, request: Request, token_id: int, logprob: float, top_logprobs: dict[int, float] | None
    ) -> RequestStatus | None:
        """Append one token; return the finished status if the request ends with it."""
        params = request.params
        request.output_token_ids.append(token_id)
        self.num_generated_tokens += 1
        request.cumulative_logprob += logprob
        if params.logprobs is not None:
            if request.logprobs is None:
                request.logprobs = []
            request.logprobs.append(top_logprobs or {token_id: logprob})
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        num_out = len(request.output_token_ids)
        may_stop = num_out >= params.min_tokens

        if self.tokenizer is not None:
            detok = self._detokenizers.get(request.request_id)
            if detok is None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
                )
                self._detokenizers[request.request_id] = detok
            before = len(detok.text)
            detok.add(token_id)
            request.output_text = detok.text
            if may_stop and params.stop:
                hit = _find_stop(detok.text, before, params.stop)
                if hit is not None:
                    index, stop = hit
                    end = index + len(stop) if params.include_stop_str_in_output else index
                    request.output_text = detok.text[:end]
                    request.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED

        if may_stop and not params.ignore_eos and token_id in params.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def commit(self, request: Request, tokens: Sequence[Committed]) -> tuple[RequestStatus | None, Exception | None]:
        """Append a step's committed tokens in order, each checked for stops and
        against the request's grammar: the status the request ends with, if it ends,
        and the error it fails with, if a token breaks its grammar (which masked
        sampling and verification never commit)."""
        for token_id, logprob, top in tokens:
            status = self.append_token(request, token_id, logprob, top)
            grammar = request.grammar
            if status is None and grammar is not None:
                if not grammar.accept(token_id):
                    return None, RuntimeError(f"token {token_id} does not follow the request's "
                                              "structured_outputs grammar")
                if grammar.terminated:
                    status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                return status, None
        return None, None

    def release(self, request_id: str) -> None:
        """Drop the detokenizer state of a finished request."""
        self._detokenizers.pop(request_id, None)

    @staticmethod
    def request_output(parent: ParentRequest, extra_metrics: Mapping[str, float]) -> RequestOutput:
        """A user request's outputs so far: its sequences' completions, errors and
        timing metrics (and ``extra_metrics``: speculation's)."""
        errors = [c.error for c in parent.children if c.error]
        first = parent.children[0]
        metrics = {"arrival_time": first.arrival_time, "num_cached_tokens": float(first.num_cached_tokens)}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        if parent.finished:
            metrics["finish_time"] = max(c.finish_time or 0.0 for c in parent.children)
        metrics.update(extra_metrics)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[OutputProcessor.completion(c, i) for i, c in enumerate(parent.children)],
            finished=parent.finished,
            error="; ".join(errors) if errors else None,
            metrics=metrics,
        )

    @staticmethod
    def completion(request: Request, index: int) -> CompletionOutput:
        """A snapshot of ``request`` as the user-facing ``CompletionOutput``."""
        return CompletionOutput(
            index=index,
            text=request.output_text,
            token_ids=list(request.output_token_ids),
            # vLLM's: reported when logprobs are asked for (otherwise none are computed).
            cumulative_logprob=request.cumulative_logprob if request.params.logprobs is not None else None,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )


def _find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends in the text added since ``new_from``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
