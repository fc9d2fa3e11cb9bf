"""Appending sampled tokens to requests, one at a time, with exact stop checks.

Tokens arrive one per step in plain decoding and several per step under tree
speculation; either way they pass through ``append_token`` one by one, so EOS,
stop tokens, stop strings, max_tokens and the context limit cut the output at
exactly the token where plain decoding would have stopped.
"""

from __future__ import annotations

import time

from pagedtree.engine.detokenizer import IncrementalDetokenizer
from pagedtree.outputs import CompletionOutput
from pagedtree.request import Request, RequestStatus


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

    def release(self, request_id: str) -> None:
        """Drop the detokenizer state of a finished request."""
        self._detokenizers.pop(request_id, None)

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
