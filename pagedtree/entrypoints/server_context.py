"""What every HTTP route shares: the engine, auth, request ids, error shapes, SSE, disconnects.

Routes are wrapped by ``ServerContext.endpoint`` instead of aiohttp middlewares so
that mounting pagedtree's routes into a user's own application never changes how the
user's other routes behave (no API-key check or error rewriting leaks onto them).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from pagedtree.engine.async_engine import AsyncEngine, new_request_id
from pagedtree.engine.async_stream import RequestStream, StreamOutput
from pagedtree.engine.errors import EngineOverloadedError, EngineStoppedError, InvalidRequestError
from pagedtree.engine.input_processor import PromptType
from pagedtree.entrypoints.error_log import RateLimitedErrorLog
from pagedtree.entrypoints.fields import BadRequest
from pagedtree.entrypoints.limits import ServerLimits, read_json_object
from pagedtree.entrypoints.prometheus_metrics import ServerMetrics
from pagedtree.entrypoints.structured_fields import field_message
from pagedtree.sampling_params import SamplingParams
from pagedtree.structured.compile_service import CompileQueueFull

logger = logging.getLogger("pagedtree.server")

ErrorStyle = Literal["openai", "tgi"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"
# Typed request storage where aiohttp has it (3.14+); a plain key before.
_REQUEST_ID_KEY: Any = web.RequestKey("pagedtree_request_id", str) if hasattr(web, "RequestKey") else "pagedtree_request_id"
_MAX_REQUEST_ID = 128

# OpenAI's error "type" and TGI's "error_type" for each status we answer with.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
                 429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}
_TGI_TYPES = {400: "validation", 401: "authentication", 404: "validation", 408: "validation", 413: "validation",
              415: "validation", 429: "overloaded", 500: "generation", 503: "unavailable"}


class GenerationFailed(Exception):
    """A request ended with ``finish_reason="error"`` (answered with a 500); the
    engine's own message is logged, never sent."""


@dataclass(slots=True)
class ServerConfig:
    """Options of the HTTP layer (the engine's are in ``EngineConfig``)."""

    model_name: str
    api_key: str | None = None
    grace_period: float = 10.0  # seconds in-flight requests may finish during shutdown
    manage_engine: bool = True  # shut the engine down when the app shuts down
    disconnect_poll_interval: float = 0.5  # how often a quiet request checks its client
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics_require_key: bool | None = None  # None: when an API key is set
    chat_template: str | None = None  # a server-side template replacing the tokenizer's

    def __post_init__(self) -> None:
        if self.metrics_require_key is None:
            self.metrics_require_key = bool(self.api_key)


class ServerContext:
    """The engine plus the HTTP conventions shared by the OpenAI and TGI routes."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine, config.model_name)
        engine.add_metrics_listener(self.metrics.observe)
        tokenizer = engine.tokenizer
        self.special_ids: frozenset[int] = frozenset(getattr(tokenizer, "all_special_ids", []) or [])
        # One entry per vocabulary id at most: bounded by the vocabulary.
        self._token_texts: dict[int, str] = {}
        self.error_log = RateLimitedErrorLog(logger)

    # ----------------------------------------------------------- wrapping
    def endpoint(self, handler: Handler, style: ErrorStyle, auth: bool = True) -> Handler:
        """Wrap a route: request id, API key, error mapping to JSON, access log."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            request_id = self._request_id(request)
            request[_REQUEST_ID_KEY] = request_id
            started = time.monotonic()
            try:
                if auth:
                    self._check_api_key(request)
                response = await handler(request)
            except BadRequest as exc:
                response = self.error(style, exc.status, exc.message, request_id, exc.param, exc.code)
            except EngineOverloadedError as exc:
                response = self.error(style, 429, str(exc), request_id, code="overloaded")
            except CompileQueueFull as exc:
                response = self.error(style, 429, str(exc), request_id, code="grammar_queue_full")
                response.headers["Retry-After"] = str(int(math.ceil(exc.retry_after_s)))
            except EngineStoppedError as exc:
                response = self.error(style, 503, str(exc), request_id)
            except GenerationFailed as exc:
                response = self.error(style, 500, self.generation_failed(request_id, str(exc)), request_id)
            except ValueError as exc:  # the engine's validation (prompt too long, ...)
                response = self.error(style, 400, str(exc), request_id, _param_of(str(exc)))
            except (asyncio.CancelledError, ConnectionError):
                logger.info("request %s: client went away", request_id)
                raise
            except web.HTTPException:
                raise
            except Exception as exc:  # noqa: BLE001 - answer with JSON, keep serving
                # The exception's text may quote internals (or the request): log only.
                self.error_log.exception(exc, "request %s: %s %s failed", request_id, request.method, request.path)
                response = self.error(style, 500, internal_error_message(request_id), request_id)
            if not response.prepared:
                response.headers[REQUEST_ID_HEADER] = request_id
            # Probes and scrapers would drown the log at INFO.
            logger.log(
                logging.INFO if auth else logging.DEBUG,
                "request %s: %s %s -> %d in %.3fs",
                request_id, request.method, request.path, response.status, time.monotonic() - started,
            )
            return response

        return wrapped

    def _request_id(self, request: web.Request) -> str:
        given = request.headers.get(REQUEST_ID_HEADER, "").strip()
        if given and len(given) <= _MAX_REQUEST_ID and given.isprintable():
            return given
        return new_request_id()

    def _check_api_key(self, request: web.Request) -> None:
        expected = self.config.api_key
        if not expected:
            return
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise BadRequest(
                "missing or invalid API key: send 'Authorization: Bearer <key>'", status=401, code="invalid_api_key"
            )

    def error(
        self,
        style: ErrorStyle,
        status: int,
        message: str,
        request_id: str,
        param: str | None = None,
        code: str | None = None,
    ) -> web.Response:
        """A JSON error in the protocol's shape (OpenAI's ``{"error": {...}}`` or TGI's)."""
        self.metrics.count_error(status)
        return web.json_response(self.error_body(style, status, message, param, code), status=status,
                                 headers={REQUEST_ID_HEADER: request_id})

    @staticmethod
    def error_body(style: ErrorStyle, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> dict[str, Any]:
        """The JSON body of an error (also sent as an SSE event when a stream fails)."""
        if style == "tgi":
            return {"error": message, "error_type": _TGI_TYPES.get(status, "generation")}
        return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "internal_server_error"),
                          "param": param, "code": code or status}}

    def generation_failed(self, request_id: str, engine_error: str) -> str:
        """Log why the engine failed a request; the message for its client (generic)."""
        logger.warning("request %s: generation failed: %s", request_id, engine_error)
        return f"generation failed: {internal_error_message(request_id)}"

    def check_finished(self, out: StreamOutput) -> None:
        """Raise when a final output ended in an error or an abort (shutdown)."""
        if not out.finished:
            return
        if out.error:
            raise GenerationFailed(out.error)
        if aborted(out):
            raise EngineStoppedError(ABORTED_MESSAGE)

    def stream_error(self, style: ErrorStyle, request: web.Request, out: StreamOutput) -> dict[str, Any] | None:
        """The error event that ends a stream whose final output failed or was
        aborted, or None when ``out`` is not such an output."""
        if not out.finished:
            return None
        if out.error:
            message = self.generation_failed(request_id_of(request), out.error)
            self.metrics.count_error(500)
            return self.error_body(style, 500, message)
        if aborted(out):
            return self.error_body(style, 503, ABORTED_MESSAGE)
        return None

    async def read_body(self, request: web.Request) -> dict[str, Any]:
        """The request's JSON object body, within the server's limits."""
        return await read_json_object(request, self.config.limits)

    # -------------------------------------------------------- generation
    async def start(
        self,
        request: web.Request,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        names: Mapping[str, str] | None = None,
        structured_field: str | None = None,
    ) -> list[RequestStream]:
        """Queue one engine request per prompt, all in one engine command.

        Every engine request gets an id of the server's own: a client's
        ``X-Request-Id`` is only echoed and logged, so no client can name (or
        collide with) another client's request. If any prompt is rejected nothing
        is queued. ``names`` renames the engine's fields in error messages to the
        protocol's (``max_tokens`` is TGI's ``parameters.max_new_tokens``);
        ``structured_field`` is the field the output constraint came from, named when
        the engine refuses the constraint (it does not compile, or not in time).
        """
        limits = self.config.limits
        if len(prompts) > limits.max_prompts_per_request:
            raise BadRequest(f"prompt has {len(prompts)} items, at most {limits.max_prompts_per_request} per request "
                             "(--max-prompts-per-request)", (names or {}).get("prompt", "prompt"))
        if len(prompts) * params.n > limits.max_sequences_per_request:
            raise BadRequest(f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n} sequences, at most "
                             f"{limits.max_sequences_per_request} per request (--max-sequences-per-request)",
                             (names or {}).get("n", "n"))
        engine_ids = [new_request_id() for _ in prompts]
        logger.debug("request %s: engine ids %s", request_id_of(request), engine_ids)
        try:
            return await self.engine.add_requests(prompts, params, engine_ids, check_context=True,
                                                  label=request_id_of(request), client=client_of(request))
        except ValueError as exc:  # an InvalidRequestError says which prompt
            where = f"prompt {exc.index}: " if isinstance(exc, InvalidRequestError) and len(prompts) > 1 else ""
            if structured_field is not None and _about_constraint(str(exc)):
                # The engine refused the constraint (it does not compile, or not in time).
                raise BadRequest(field_message(str(exc), structured_field), structured_field) from exc
            message, param = _rename(str(exc), _param_of(str(exc)), names or {})
            raise BadRequest(f"{where}{message}", param) from exc

    @contextlib.asynccontextmanager
    async def generation(
        self,
        request: web.Request,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        names: Mapping[str, str] | None = None,
        structured_field: str | None = None,
    ) -> AsyncIterator[list[RequestStream]]:
        """Queue the prompts (see ``start``) and yield their streams; on exit abort what still runs.

        aiohttp does not cancel a handler when its client goes away (unless the
        runner asks it to), and a request still queued writes nothing that could
        fail, so a watcher polls the connection and cancels the handler itself;
        the cancellation aborts the requests and frees their blocks.
        """
        streams: list[RequestStream] = []
        handler = asyncio.current_task()
        watcher = asyncio.create_task(self._watch(request, handler))
        try:
            streams += await self.start(request, prompts, params, names, structured_field)
            yield streams
        finally:
            watcher.cancel()
            for stream in streams:
                await stream.aclose()

    async def _watch(self, request: web.Request, handler: asyncio.Task | None) -> None:
        while True:
            await asyncio.sleep(self.config.disconnect_poll_interval)
            transport = request.transport
            if transport is None or transport.is_closing():
                logger.info("request %s: client disconnected; aborting", request_id_of(request))
                if handler is not None:
                    handler.cancel()
                return

    # --------------------------------------------------------------- SSE
    async def open_sse(self, request: web.Request) -> web.StreamResponse:
        """Send the headers of a server-sent-events response."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
                REQUEST_ID_HEADER: request_id_of(request),
            }
        )
        await response.prepare(request)
        return response

    # ------------------------------------------------------------ tokens
    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs and TGI token events)."""
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else ""
            self._token_texts[token_id] = text
        return text


ABORTED_MESSAGE = "the request was aborted (the server is shutting down)"


def internal_error_message(request_id: str) -> str:
    """What a client is told of an internal error: nothing but where to look."""
    return f"internal server error (request id {request_id}; the details are in the server log)"


def aborted(out: StreamOutput) -> bool:
    """Whether any continuation of a final output was aborted."""
    return any(c.finish_reason == "abort" for c in out.outputs)


def client_of(request: web.Request) -> str | None:
    """Who a request comes from, for per-client bounds (the grammar compile queue):
    the peer's address (one server API key is shared by every client, so it names
    none of them)."""
    return request.remote


def request_id_of(request: web.Request) -> str:
    """The id ``ServerContext.endpoint`` gave this request (from X-Request-Id or fresh)."""
    return request[_REQUEST_ID_KEY]


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """``(index, output)`` from several streams in arrival order (one stream: no tasks)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, StreamOutput | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse_event(data: Any, prefix: bytes = b"data: ") -> bytes:
    """One server-sent event carrying JSON (or a literal such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return prefix + payload.encode() + b"\n\n"


def _rename(message: str, param: str | None, names: Mapping[str, str]) -> tuple[str, str | None]:
    """Speak the protocol's field names in an engine error message."""
    for engine_name, protocol_name in names.items():
        message = re.sub(rf"\b{engine_name}\b", protocol_name, message)
    return message, names.get(param, param) if param else None


def _about_constraint(message: str) -> bool:
    """Whether an engine ``ValueError`` is about the request's output constraint."""
    return message.startswith("StructuredOutputsParams") or "structured_outputs" in message


def _param_of(message: str) -> str | None:
    """The field an engine ``ValueError`` is about, from its wording."""
    if message.startswith("SamplingParams."):
        return message.split(" ", 1)[0].split(".", 1)[1]
    for name in ("max_tokens", "prompt_token_ids", "prompt", "stop_token_ids", "stop"):
        if name in message:
            return name
    return None
