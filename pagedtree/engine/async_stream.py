"""One request's stream of outputs on the asyncio side: deltas, stop-string hold-back, timings.

The engine thread pushes cumulative ``RequestOutput`` snapshots (one per step that
touched the request) into the stream's asyncio queue; the consumer turns each into a
``StreamOutput`` carrying both the cumulative state and what is new since the last one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedtree.outputs import CompletionOutput, RequestOutput
from pagedtree.sampling_params import SamplingParams

logger = logging.getLogger("pagedtree.async")


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, stamped by the engine thread when a step's outputs are ready.

    Times are ``time.monotonic()`` seconds. ``inter_token_latencies`` has one entry per
    engine step that added tokens after the first (a speculative step that adds several
    tokens counts once, as in vLLM).
    """

    request_id: str
    arrival_time: float
    label: str | None = None  # the caller's name for the request (the HTTP server: the client's X-Request-Id)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (None if none came)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Seconds from arrival to the end (None while running)."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class CompletionDelta:
    """One of the ``n`` continuations: what is new since the previous output, and the total so far.

    ``text`` is the cumulative text that has been released; while a request with stop
    strings runs, a tail that could be the start of a stop string is held back, so the
    concatenated ``delta_text``s always equal the final text.
    """

    index: int
    text: str
    delta_text: str
    token_ids: list[int]
    delta_token_ids: list[int]
    delta_logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    just_finished: bool = False  # finish_reason appears for the first time in this output


@dataclass(slots=True)
class StreamOutput:
    """What ``AsyncEngine.generate`` yields: per-continuation deltas plus the cumulative output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionDelta]
    finished: bool
    error: str | None
    metrics: RequestMetrics
    request_output: RequestOutput

    @property
    def num_new_tokens(self) -> int:
        """Tokens added by this output across all continuations."""
        return sum(len(c.delta_token_ids) for c in self.outputs)


def held_back_length(text: str, stops: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string.

    Only the last ``len(stop) - 1`` characters matter, and only where ``stop[0]``
    occurs in them: each stop costs a few ``find`` calls over its own length, not a
    slice per character of the text (this runs on the event loop for every output).
    """
    best = 0
    for stop in stops:
        tail = text[len(text) - min(len(stop) - 1, len(text)):]
        start = tail.find(stop[0])
        # Earlier starts are longer candidates; none can beat ``best`` past this point.
        while start != -1 and len(tail) - start > best:
            if stop.startswith(tail[start:]):
                best = len(tail) - start
                break
            start = tail.find(stop[0], start + 1)
    return best


class _Tracker:
    """What has been released so far for one continuation."""

    __slots__ = ("text", "num_tokens", "num_logprobs", "finished")

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.num_logprobs = 0
        self.finished = False


class RequestStream:
    """Async iterator of ``StreamOutput`` for one request; created by ``AsyncEngine.add_request``.

    ``push`` and ``fail`` run on the event loop thread (the engine thread schedules them
    with ``call_soon_threadsafe``); iteration ends after the finished output. Leaving an
    ``async with`` block early, or ``aclose()``, aborts the request.
    """

    def __init__(
        self,
        request_id: str,
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        arrival_time: float,
        on_first_token: Callable[[RequestStream], None],
        on_finished: Callable[[RequestStream], None],
        abort: Callable[[str], None],
        label: str | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.loop = loop
        self.metrics = RequestMetrics(request_id, arrival_time, label)
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._on_first_token = on_first_token
        self._on_finished = on_finished
        self._abort = abort
        self._trackers: list[_Tracker] = []
        self._last: RequestOutput | None = None
        self._engine_finished = False  # the final output has arrived (maybe not yet consumed)
        self._consumed_final = False

    # ----------------------------------------------------------- loop side
    @property
    def finished(self) -> bool:
        """Whether the engine has ended this request (the final output has arrived)."""
        return self._engine_finished

    def push(self, output: RequestOutput, stamp: float) -> None:
        """Queue one cumulative output; ``stamp`` is when the engine step produced it."""
        if self._engine_finished:
            return  # e.g. a late abort echo after the request already finished
        m = self.metrics
        total = sum(len(c.token_ids) for c in output.outputs)
        if total > m.num_generation_tokens:
            if m.first_token_time is None:
                m.first_token_time = stamp
                self._on_first_token(self)
            elif m.last_token_time is not None:
                m.inter_token_latencies.append(stamp - m.last_token_time)
            m.last_token_time = stamp
            m.num_generation_tokens = total
        self._last = output
        self._queue.put_nowait(output)
        if output.finished:
            self._engine_finished = True
            m.finish_time = stamp
            m.finish_reason = _overall_finish_reason(output)
            self._on_finished(self)

    def fail(self, message: str, stamp: float) -> None:
        """End the stream with ``finish_reason="error"`` when the engine itself broke."""
        if self._engine_finished:
            return
        last = self._last
        if last is None:
            last = RequestOutput(self.request_id, None, [], [], finished=False)
            last.outputs = [
                CompletionOutput(i, "", [], None, None) for i in range(self.params.n)
            ]
        outputs = [
            c if c.finished() else dataclasses.replace(c, finish_reason="error") for c in last.outputs
        ]
        self.push(dataclasses.replace(last, outputs=outputs, finished=True, error=message), stamp)

    # ------------------------------------------------------- consumer side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamOutput:
        if self._consumed_final:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self._consumed_final = True
        return self._to_stream_output(output)

    async def aclose(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self._engine_finished:
            self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def _to_stream_output(self, output: RequestOutput) -> StreamOutput:
        while len(self._trackers) < len(output.outputs):
            self._trackers.append(_Tracker())
        deltas = [self._delta(c, self._trackers[c.index]) for c in output.outputs]
        return StreamOutput(
            request_id=self.request_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=deltas,
            finished=output.finished,
            error=output.error,
            metrics=self.metrics,
            request_output=output,
        )

    def _delta(self, c: CompletionOutput, tracker: _Tracker) -> CompletionDelta:
        text = c.text
        stops = self.params.stop
        if not c.finished() and stops:
            text = text[: len(text) - held_back_length(text, stops)]
        if not text.startswith(tracker.text):
            # Cannot happen with the hold-back above; keep the stream consistent anyway.
            logger.warning("request %s: released text is not a prefix of the text", self.request_id)
            text = tracker.text
        delta_text = text[len(tracker.text):]
        tracker.text = text
        delta_tokens = c.token_ids[tracker.num_tokens:]
        tracker.num_tokens = len(c.token_ids)
        delta_logprobs = None
        if c.logprobs is not None:
            delta_logprobs = c.logprobs[tracker.num_logprobs:]
            tracker.num_logprobs = len(c.logprobs)
        just_finished = c.finished() and not tracker.finished
        tracker.finished = tracker.finished or c.finished()
        return CompletionDelta(
            index=c.index,
            text=text,
            delta_text=delta_text,
            token_ids=c.token_ids,
            delta_token_ids=delta_tokens,
            delta_logprobs=delta_logprobs,
            cumulative_logprob=c.cumulative_logprob,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            just_finished=just_finished,
        )


def _overall_finish_reason(output: RequestOutput) -> str | None:
    """One reason for the whole request: "error" or "abort" win over the per-choice reasons."""
    reasons = [c.finish_reason for c in output.outputs]
    for reason in ("error", "abort"):
        if reason in reasons:
            return reason
    return reasons[0] if reasons else None
