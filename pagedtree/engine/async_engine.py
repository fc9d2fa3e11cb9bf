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
import concurrent.futures
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

from pagedtree.config import EngineConfig
from pagedtree.engine.async_stream import RequestMetrics, RequestStream, StreamOutput
from pagedtree.engine.engine_thread import (
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineThread,
    NewRequest,
    StopCommand,
)
from pagedtree.engine.errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError
from pagedtree.engine.input_processor import PromptType
from pagedtree.engine.llm_engine import LLMEngine
from pagedtree.sampling_params import SamplingParams
from pagedtree.text_checks import check_text

logger = logging.getLogger("pagedtree.async")

T = TypeVar("T")
MetricsListener = Callable[[RequestMetrics], None]

# A random per-process prefix plus a counter: unique ids without a urandom call per
# request (uuid4 reads the OS entropy pool, which costs ~1 ms on some VMs).
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters beyond which a text prompt cannot fit in ``max_model_len`` tokens.

    No token covers more characters than its vocabulary entry has (byte-level
    entries count bytes, and a character is at least one byte); the factor 4 leaves
    room for normalizers that merge characters (NFC) before tokenizing.
    """
    longest = 1
    if tokenizer is not None:
        try:
            longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: a generous bound
            longest = 64
    return 4 * max_model_len * max(longest, 1)


def new_request_id() -> str:
    """A fresh request id, unique within this process and very likely across processes."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):x}"


class AsyncEngine:
    """Serve many concurrent requests from asyncio code.

    ``AsyncEngine(model, **kwargs)`` takes the same arguments as ``LLM`` (those of
    ``EngineConfig``; ``workload`` defaults to "batch" here: a GGUF model on a CPU
    that runs batches faster in dense weights gets them) plus:

    * ``max_waiting_requests``: how many requests may wait for their first token
      before ``generate`` raises ``EngineOverloadedError`` (None: no bound); a
      request of ``n`` choices counts ``n`` (each is a sequence the engine runs);
    * ``freeze_gc`` (True): once the model is loaded, ``gc.collect()`` then
      ``gc.freeze()``, so later full garbage collections skip the hundreds of
      thousands of long-lived torch/transformers objects. Without it a full
      collection stops every thread (the event loop too) for 100+ ms now and then;
    * ``warm_up`` (True): before the constructor returns, run a small batch through
      the engine (``engine/warm_up.py``) so that first-use costs (kernels loaded or
      compiled, oneDNN primitives, the long-prompt attention path) are paid before
      any client is served.

    The constructor blocks while the model loads; from a running event loop use
    ``await asyncio.to_thread(AsyncEngine, ...)`` to keep the loop responsive.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_waiting_requests: int | None = None,
        freeze_gc: bool = True,
        warm_up: bool = True,
        **kwargs: Any,
    ):
        self._start(EngineConfig(model=model, **kwargs), max_waiting_requests, freeze_gc, warm_up)

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, max_waiting_requests: int | None = None, freeze_gc: bool = True,
        warm_up: bool = True,
    ) -> AsyncEngine:
        """An engine for an already-built ``EngineConfig``."""
        self = cls.__new__(cls)
        self._start(config, max_waiting_requests, freeze_gc, warm_up)
        return self

    def _start(self, config: EngineConfig, max_waiting_requests: int | None, freeze_gc: bool,
               warm_up: bool) -> None:
        if max_waiting_requests is not None and (
            not isinstance(max_waiting_requests, int) or max_waiting_requests < 1
        ):
            raise ValueError(f"max_waiting_requests must be an integer >= 1 or None, got {max_waiting_requests!r}")
        if config.workload is None:  # a server: many concurrent requests (see EngineConfig)
            config = dataclasses.replace(config, workload="batch")
        self.config = config
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()  # streams may live on several event loops
        self._streams: dict[str, RequestStream] = {}
        self._waiting: dict[str, int] = {}  # accepted, no generated token yet: their sequences (n)
        self._waiting_sequences = 0
        self._listeners: list[MetricsListener] = []
        self._stopping = False
        self._shutdown_deadline = float("inf")
        self._thread = EngineThread(config, warm_up=warm_up)
        engine = self._thread.start_and_wait()
        # Read-only facts about the model, safe to read from any thread.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model_config
        self.model_path = engine.model_path
        self.resolved = engine.resolved  # device, dtypes, formats (frozen plain data)
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        self.grammars = engine.grammars  # thread-safe: compiled in the tokenizer pool, read by the engine
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        # Text prompts are tokenized here, never on the engine thread.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(2, os.cpu_count() or 1), thread_name_prefix="pagedtree-tokenize"
        )
        # Only submits compiles (checks, the vocabulary's view once): the compiles run
        # in the compile service's workers, and nothing waits here.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagedtree-grammar")
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
        client: str | None = None,
    ) -> RequestStream:
        """Validate and queue a request; returns its stream once the engine has accepted it.

        Raises ``ValueError`` (bad prompt or params, naming the problem),
        ``EngineOverloadedError`` (too many waiting) or ``EngineStoppedError``
        (shutting down) before anything is streamed. With ``check_context``, a
        ``max_tokens`` that does not fit in the context after the prompt is an error
        instead of being cut at the context limit (what HTTP APIs expect).
        """
        ids = None if request_id is None else [request_id]
        streams = await self.add_requests([prompt], sampling_params, ids, check_context=check_context, client=client)
        return streams[0]

    async def add_requests(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_ids: Sequence[str] | None = None,
        *,
        check_context: bool = False,
        label: str | None = None,
        client: str | None = None,
    ) -> list[RequestStream]:
        """Validate and queue several requests at once, all or none (see ``add_request``).

        They reach the engine in one command, so they join the running batch in the
        same step. Text prompts are tokenized here, in a worker pool, before anything
        is queued: the engine thread never spends a step on a long prompt, and a
        prompt too long for the context is refused from its length in characters
        alone. An invalid request raises ``InvalidRequestError`` (a ``ValueError``)
        whose ``index`` says which one. ``label`` names the requests in their
        ``RequestMetrics`` (the HTTP server passes the client's ``X-Request-Id``).
        ``client`` (an API key, a connection's address) bounds the grammar compiles
        one client can have in flight (``CompileQueueFull``, HTTP 429).
        """
        if self._stopping or self._thread.closed:
            raise EngineStoppedError("the engine is shutting down" if self._stopping else "the engine is shut down")
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params_list):
                raise ValueError("sampling_params must be a SamplingParams or one per prompt")
        if request_ids is None:
            ids = [new_request_id() for _ in prompts]
        else:
            ids = list(request_ids)
            if len(ids) != len(prompts):
                raise ValueError(f"got {len(ids)} request ids for {len(prompts)} prompts")
            for rid in ids:
                if not isinstance(rid, str) or not rid:
                    raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
            if len(set(ids)) != len(ids):
                raise ValueError("request ids must be distinct")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        streams = [
            RequestStream(rid, params, loop, now, on_first_token=self._on_first_token,
                          on_finished=self._on_finished, abort=self.abort_nowait, label=label)
            for rid, params in zip(ids, params_list)
        ]
        with self._lock:
            for rid in ids:
                if rid in self._streams:
                    raise ValueError(f"request_id {rid!r} is already in use")
            sequences = [params.n for params in params_list]
            if (self.max_waiting_requests is not None
                    and self._waiting_sequences + sum(sequences) > self.max_waiting_requests):
                raise EngineOverloadedError(self._waiting_sequences, self.max_waiting_requests)
            # Counted before the engine thread sees the requests, so a burst of
            # concurrent callers cannot all slip under the bound.
            for rid, stream, n in zip(ids, streams, sequences):
                self._waiting[rid] = n
                self._waiting_sequences += n
                self._streams[rid] = stream
        command: AddCommand | None = None
        try:
            ready = await loop.run_in_executor(self._tokenize_pool, self._prepare_prompts, prompts)
            if any(p is not None and p.structured_outputs is not None for p in params_list):
                await self._grammars_ready(params_list, client)
            command = AddCommand(
                [NewRequest(rid, prompt, params, stream) for rid, prompt, params, stream
                 in zip(ids, ready, params_list, streams)],
                check_context,
            )
            lengths = await asyncio.wrap_future(self._thread.submit(command))
        except BaseException:
            for rid in ids:
                self._forget(rid)
            if command is not None and (not command.future.done() or command.future.cancelled()):
                for rid in ids:
                    self.abort_nowait(rid)  # they may have been queued all the same
            # The exception's traceback holds this frame, and the command's future the
            # exception: a cycle that would keep the prompt until a full collection.
            command = ready = None
            raise
        for stream, num_prompt_tokens in zip(streams, lengths):
            stream.metrics.num_prompt_tokens = num_prompt_tokens
        return streams

    def _prepare_prompts(self, prompts: list[PromptType]) -> list[PromptType]:
        """Runs in the tokenizer pool: text prompts as token ids, length checks first."""
        out = []
        for index, prompt in enumerate(prompts):
            try:
                out.append(self._prepare_prompt(prompt))
            except ValueError as exc:
                raise InvalidRequestError(index, str(exc)) from exc
        return out

    async def _grammars_ready(self, params_list: list[SamplingParams | None], client: str | None) -> None:
        """Every constraint's grammar compiled before the requests are queued, so the
        engine thread only takes them from the cache. A cached one is answered here
        without waiting for anything; the others are queued with the compile service
        (``CompileQueueFull`` when its queue is full for the server or ``client``) and
        waited for without holding a thread. A caller that goes away (its task
        cancelled) leaves its compiles, which are dropped when nobody else waits."""
        missing = [(i, p.structured_outputs) for i, p in enumerate(params_list)
                   if p is not None and p.structured_outputs is not None
                   and self.grammars.lookup(p.structured_outputs) is None]
        if not missing:
            return
        loop = asyncio.get_running_loop()
        # Submitting checks the constraint and, the first time, builds the vocabulary's
        # view for xgrammar (a second): off the event loop.
        tickets = await loop.run_in_executor(self._grammar_pool, self._submit_grammars, missing, client)
        try:
            await asyncio.gather(*(_done(ticket.future, loop) for _, ticket in tickets))
            for index, ticket in tickets:
                try:
                    self.grammars.result(ticket)
                except ValueError as exc:
                    raise InvalidRequestError(index, str(exc)) from exc
        except BaseException:
            self._leave(tickets)
            raise

    def _leave(self, tickets: list[tuple[int, Any]]) -> None:
        """Give up waiting for these compiles (dropped when nobody else waits)."""
        for _, ticket in tickets:
            self.grammars.leave(ticket)

    def _submit_grammars(self, missing: list[tuple[int, Any]], client: str | None) -> list[tuple[int, Any]]:
        """Runs in the grammar pool: each constraint's ticket (all or none: a refusal
        leaves the ones already submitted)."""
        tickets = []
        try:
            for index, spec in missing:
                try:
                    tickets.append((index, self.grammars.submit(spec, client)))
                except ValueError as exc:
                    raise InvalidRequestError(index, str(exc)) from exc
        except BaseException:
            self._leave(tickets)
            raise
        return tickets

    def _prepare_prompt(self, prompt: PromptType) -> PromptType:
        text = prompt
        if isinstance(prompt, Mapping):
            ids = prompt.get("prompt_token_ids")
            if isinstance(ids, (list, tuple)) and len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt is {len(ids)} tokens, but the context (max_model_len) is {self.max_model_len}: "
                    "it must leave room for at least one generated token"
                )
            if ids is not None:
                return prompt
            text = prompt.get("prompt")
        if not isinstance(text, str) or not text or self.tokenizer is None:
            return prompt  # the engine's validation says what is wrong
        check_text(text, "prompt")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"prompt is {len(text)} characters, more than the context of {self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars} characters)"
            )
        return {"prompt": text, "prompt_token_ids": list(self.tokenizer.encode(text))}

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        check_context: bool = False,
        client: str | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Stream a request's outputs: ``async for out in engine.generate(prompt, params, id)``.

        Each ``StreamOutput`` carries, per continuation, the new text and token ids since
        the previous one and the cumulative text; the last has ``finished=True`` and the
        ``finish_reason`` ("stop", "length", "abort" or "error", with ``error`` set).
        Errors of ``add_request`` surface at the first iteration, before any output.
        """
        stream = await self.add_request(prompt, sampling_params, request_id, check_context=check_context,
                                        client=client)
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
    async def run_in_tokenizer_pool(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the tokenizer pool (bounded CPU, off the loop and the engine thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

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
        and stop the engine thread. Idempotent; ``hurry_shutdown`` ends the grace
        period early."""
        self._stopping = True
        self._shutdown_deadline = min(self._shutdown_deadline, time.monotonic() + grace_period)
        while self._streams and time.monotonic() < self._shutdown_deadline and not self._thread.closed:
            await asyncio.sleep(0.01)
        if not self._thread.closed:
            try:
                await asyncio.wrap_future(self._thread.submit(StopCommand()))
            except EngineStoppedError:
                pass
        await asyncio.to_thread(self._thread.join, 30.0)
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def hurry_shutdown(self) -> None:
        """End a running shutdown's grace period now: what still runs is aborted at
        once (e.g. on a second SIGINT/SIGTERM). Safe to call from a signal handler."""
        self._stopping = True
        self._shutdown_deadline = 0.0

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ------------------------------------------------- stream bookkeeping
    def _on_first_token(self, stream: RequestStream) -> None:
        with self._lock:
            self._stop_waiting(stream.request_id)

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
                self._stop_waiting(request_id)

    def _stop_waiting(self, request_id: str) -> None:
        """(Under ``_lock``.) The request no longer counts against ``max_waiting_requests``."""
        self._waiting_sequences -= self._waiting.pop(request_id, 0)


async def _done(future: concurrent.futures.Future, loop: asyncio.AbstractEventLoop) -> None:
    """Wait for ``future`` (shared by other requests) without cancelling it when this
    waiter is cancelled, as ``asyncio.wrap_future`` would."""
    waiter = loop.create_future()

    def wake(_: concurrent.futures.Future) -> None:
        loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))

    future.add_done_callback(wake)
    await waiter
