"""``AsyncEngine``: the engine for asyncio programs (web servers, bots, pipelines).

A single dedicated thread owns the ``LLMEngine`` (see ``engine_thread.py``), so model
steps never block the event loop and every request in flight shares each step.
``generate`` streams incremental outputs; cancelling the consuming task, or leaving
the ``async for`` early, aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from pagedtree.config import EngineConfig
from pagedtree.engine.async_stream import RequestMetrics, RequestStream, StreamOutput
from pagedtree.engine.engine_thread import AbortCommand, AddCommand, CallCommand, EngineThread, StopCommand
from pagedtree.engine.errors import EngineOverloadedError, EngineStoppedError
from pagedtree.engine.llm_engine import LLMEngine, PromptType
from pagedtree.sampling_params import SamplingParams

logger = logging.getLogger("pagedtree.async")

T = TypeVar("T")
MetricsListener = Callable[[RequestMetrics], None]

# A random per-process prefix plus a counter: unique ids without a urandom call per
# request (uuid4 reads the OS entropy pool, which costs ~1 ms on some VMs).
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A fresh request id, unique within this process and very likely across processes."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


class AsyncEngine:
    """Serve many concurrent requests from asyncio code.

    ``AsyncEngine(model, **kwargs)`` takes the same arguments as ``LLM`` (those of
    ``EngineConfig``) plus:

    * ``max_waiting_requests``: how many requests may wait for their first token
      before ``generate`` raises ``EngineOverloadedError`` (None: no bound);
    * ``freeze_gc`` (True): once the model is loaded, ``gc.collect()`` then
      ``gc.freeze()``, so later full garbage collections skip the hundreds of
      thousands of long-lived torch/transformers objects. Without it a full
      collection stops every thread (the event loop too) for 100+ ms now and then.

    The constructor blocks while the model loads; from a running event loop use
    ``await asyncio.to_thread(AsyncEngine, ...)`` to keep the loop responsive.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_waiting_requests: int | None = None,
        freeze_gc: bool = True,
        **kwargs: Any,
    ):
        self._start(EngineConfig(model=model, **kwargs), max_waiting_requests, freeze_gc)

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, max_waiting_requests: int | None = None, freeze_gc: bool = True
    ) -> AsyncEngine:
        """An engine for an already-built ``EngineConfig``."""
        self = cls.__new__(cls)
        self._start(config, max_waiting_requests, freeze_gc)
        return self

    def _start(self, config: EngineConfig, max_waiting_requests: int | None, freeze_gc: bool) -> None:
        if max_waiting_requests is not None and (
            not isinstance(max_waiting_requests, int) or max_waiting_requests < 1
        ):
            raise ValueError(f"max_waiting_requests must be an integer >= 1 or None, got {max_waiting_requests!r}")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()  # streams may live on several event loops
        self._streams: dict[str, RequestStream] = {}
        self._waiting: set[str] = set()  # accepted, no generated token yet
        self._listeners: list[MetricsListener] = []
        self._stopping = False
        self._thread = EngineThread(config)
        engine = self._thread.start_and_wait()
        # Read-only facts about the model, safe to read from any thread.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model_config
        self.model_path = engine.model_path
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        if freeze_gc:
            gc.collect()
            gc.freeze()

    # ------------------------------------------------------------ requests
    async def add_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        check_context: bool = False,
    ) -> RequestStream:
        """Validate and queue a request; returns its stream once the engine has accepted it.

        Raises ``ValueError`` (bad prompt or params, naming the problem),
        ``EngineOverloadedError`` (too many waiting) or ``EngineStoppedError``
        (shutting down) before anything is streamed. With ``check_context``, a
        ``max_tokens`` that does not fit in the context after the prompt is an error
        instead of being cut at the context limit (what HTTP APIs expect).
        """
        if self._stopping or self._thread.closed:
            raise EngineStoppedError("the engine is shutting down" if self._stopping else "the engine is shut down")
        if request_id is None:
            request_id = new_request_id()
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        loop = asyncio.get_running_loop()
        params = sampling_params if sampling_params is not None else SamplingParams()
        stream = RequestStream(
            request_id,
            params,
            loop,
            time.monotonic(),
            on_first_token=self._on_first_token,
            on_finished=self._on_finished,
            abort=self.abort_nowait,
        )
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if self.max_waiting_requests is not None and len(self._waiting) >= self.max_waiting_requests:
                raise EngineOverloadedError(len(self._waiting), self.max_waiting_requests)
            # Counted before the engine thread sees the request, so a burst of
            # concurrent callers cannot all slip under the bound.
            self._waiting.add(request_id)
            self._streams[request_id] = stream
        command = AddCommand(request_id, prompt, sampling_params, stream, check_context)
        try:
            num_prompt_tokens = await asyncio.wrap_future(self._thread.submit(command))
        except BaseException:
            self._forget(request_id)
            if not command.future.done() or command.future.cancelled():
                self.abort_nowait(request_id)  # it may have been queued all the same
            raise
        stream.metrics.num_prompt_tokens = num_prompt_tokens
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        check_context: bool = False,
    ) -> AsyncIterator[StreamOutput]:
        """Stream a request's outputs: ``async for out in engine.generate(prompt, params, id)``.

        Each ``StreamOutput`` carries, per continuation, the new text and token ids since
        the previous one and the cumulative text; the last has ``finished=True`` and the
        ``finish_reason`` ("stop", "length", "abort" or "error", with ``error`` set).
        Errors of ``add_request`` surface at the first iteration, before any output.
        """
        stream = await self.add_request(prompt, sampling_params, request_id, check_context=check_context)
        try:
            async for output in stream:
                yield output
        finally:
            # Cancelled consumer, ``break`` or ``aclose()``: stop the work, free the blocks.
            if not stream.finished:
                self.abort_nowait(stream.request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request and wait until its blocks are freed; False if it was not running."""
        try:
            return await asyncio.wrap_future(self._thread.submit(AbortCommand(request_id)))
        except EngineStoppedError:
            return False

    def abort_nowait(self, request_id: str) -> None:
        """Ask the engine thread to abort a request without waiting (safe from any thread)."""
        try:
            self._thread.submit(AbortCommand(request_id))
        except EngineStoppedError:
            pass  # nothing runs any more

    # ------------------------------------------------------------- helpers
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(llm_engine)`` on the engine thread, between steps, and return its result."""
        return await asyncio.wrap_future(self._thread.submit(CallCommand(fn)))

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of the end of its last loop turn (see ``LLMEngine.stats``)."""
        return dict(self._thread.stats_snapshot)

    async def get_stats(self) -> dict[str, Any]:
        """Fresh engine counters, read on the engine thread."""
        return await self.call(lambda engine: engine.stats())

    def add_metrics_listener(self, listener: MetricsListener) -> None:
        """Call ``listener(RequestMetrics)`` on the event loop whenever a request ends."""
        self._listeners.append(listener)

    def is_active(self, request_id: str) -> bool:
        """Whether a request with this id is accepted and not yet ended."""
        return request_id in self._streams

    @property
    def num_active_requests(self) -> int:
        """Requests accepted and not yet ended."""
        return len(self._streams)

    @property
    def num_waiting_requests(self) -> int:
        """Requests accepted that have no generated token yet (the bounded queue)."""
        return len(self._waiting)

    @property
    def is_running(self) -> bool:
        """Whether new requests are accepted."""
        return not self._stopping and not self._thread.closed

    @property
    def is_healthy(self) -> bool:
        """Whether the engine thread is alive (false after a fatal engine error)."""
        return self._thread.is_alive() and self._thread.error is None

    # ------------------------------------------------------------ shutdown
    async def shutdown(self, grace_period: float = 0.0) -> None:
        """Stop accepting requests, let running ones finish for up to ``grace_period``
        seconds, abort the rest (their streams end with ``finish_reason="abort"``),
        and stop the engine thread. Idempotent."""
        self._stopping = True
        deadline = time.monotonic() + grace_period
        while self._streams and time.monotonic() < deadline and not self._thread.closed:
            await asyncio.sleep(0.01)
        if not self._thread.closed:
            try:
                await asyncio.wrap_future(self._thread.submit(StopCommand()))
            except EngineStoppedError:
                pass
        await asyncio.to_thread(self._thread.join, 30.0)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ------------------------------------------------- stream bookkeeping
    def _on_first_token(self, stream: RequestStream) -> None:
        with self._lock:
            self._waiting.discard(stream.request_id)

    def _on_finished(self, stream: RequestStream) -> None:
        self._forget(stream.request_id, stream)
        for listener in self._listeners:
            try:
                listener(stream.metrics)
            except Exception:  # noqa: BLE001 - a metrics bug must not break serving
                logger.exception("metrics listener failed")

    def _forget(self, request_id: str, stream: RequestStream | None = None) -> None:
        with self._lock:
            if stream is None or self._streams.get(request_id) is stream:
                self._streams.pop(request_id, None)
                self._waiting.discard(request_id)
