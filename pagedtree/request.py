"""A request as the engine tracks it between arrival and completion."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedtree.sampling_params import SamplingParams
from pagedtree.structured.matcher import RequestGrammar


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        """Whether the request has ended, for whatever reason."""
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM ``finish_reason`` string, or None while unfinished."""
        return self.value if self.finished else None


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose KV is
    in the cache. A step computes the next ones; when it computes the last token it
    also samples a new one. Preemption (by recompute) resets it to 0.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    status: RequestStatus = RequestStatus.WAITING
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    output_text: str = ""
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # The grammar its output must follow (``SamplingParams.structured_outputs``).
    grammar: RequestGrammar | None = None
    # Tree speculation, per request.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end-1`` of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
