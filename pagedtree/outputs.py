"""Results handed back to users (vLLM-compatible shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation of a request (there are ``n`` per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        """Whether this continuation has ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Everything known about a request: its prompt and its ``n`` continuations."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None  # set when the request failed at run time
    metrics: dict[str, float] = field(default_factory=dict)
