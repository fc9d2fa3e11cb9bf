"""One streamed request per protocol, timed chunk by chunk: OpenAI completions and TGI.

A request function takes an ``aiohttp.ClientSession``, the server's base URL and a
``RequestInput`` and returns a ``RequestRecord``. It never raises for a failed
request (HTTP error, error event, broken or truncated stream, timeout, refused
connection): the record says ``success=False`` and why, so one bad request never
ends a run. Only cancellation propagates.

Chunk arrival times are ``time.perf_counter()`` at the network read that completed
the event, so events that arrive together share one time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from pagedtree.loadgen.serving_metrics import RequestRecord

_ERROR_TEXT_LIMIT = 300


@dataclass(frozen=True)
class RequestInput:
    """What to send: the prompt, the tokens to ask for, and the sampling options."""

    prompt: str
    output_len: int
    prompt_len: int | None = None  # the client's count; a server count replaces it
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout: float | None = None  # seconds for the whole request; None: no limit


RequestFunc = Callable[[aiohttp.ClientSession, str, RequestInput], Awaitable[RequestRecord]]


class SSEParser:
    """Incremental server-sent-events parser: bytes in, the events' ``data`` payloads out.

    Follows the SSE rules that matter here: lines end with LF or CRLF, an empty line
    ends an event, ``data`` lines of one event are joined with LF, ``:`` lines are
    comments, one space after the colon is dropped (TGI writes ``data:{...}``,
    OpenAI servers ``data: {...}``).
    """

    def __init__(self) -> None:
        self._partial = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The payloads of the events that ``chunk`` completes."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # the unfinished last line (b"" after a full line)
        events = []
        for raw in lines:
            event = self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """The payload of a last event the stream did not end with an empty line."""
        events = []
        if self._partial:
            self._line(self._partial.rstrip(b"\r").decode("utf-8", errors="replace"))
            self._partial = b""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


class _StreamError(Exception):
    """The server reported an error inside the stream, or sent something unreadable."""


class _Handler(Protocol):
    def on_event(self, data: str, now: float) -> None: ...

    def finish(self) -> None: ...


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message", error))
    return str(error)


def _load(data: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise _StreamError(f"unreadable event {data[:80]!r}: {exc}") from exc
    if not isinstance(obj, dict):
        raise _StreamError(f"unexpected event {data[:80]!r}")
    return obj


class _OpenAIHandler:
    """``/v1/completions`` chunks: content chunks have ``choices``; the usage chunk comes last."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.text: list[str] = []
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        obj = _load(data)
        if obj.get("error") is not None:
            raise _StreamError(_error_message(obj["error"]))
        choices = obj.get("choices")
        if choices:
            # As vLLM: any chunk with a choice is a content chunk, even with empty
            # text (a last token that decodes to nothing still ends the output).
            self.record.chunk_times.append(now)
            self.text.append(choices[0].get("text") or "")
        usage = obj.get("usage")
        if usage:
            if isinstance(usage.get("completion_tokens"), int):
                self.record.output_tokens = usage["completion_tokens"]
                self.record.output_tokens_source = "usage"
            if isinstance(usage.get("prompt_tokens"), int):
                self.record.prompt_tokens = usage["prompt_tokens"]

    def finish(self) -> None:
        if not self.done:
            raise _StreamError("the stream ended before [DONE]")


class _TGIHandler:
    """``/generate_stream`` events: one per token; the last carries ``generated_text`` and ``details``."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self.text: list[str] = []
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        obj = _load(data)
        token = obj.get("token")
        if token is None and obj.get("error") is not None:
            raise _StreamError(_error_message(obj["error"]))
        if token is not None:
            self.record.chunk_times.append(now)
            self.text.append(token.get("text") or "")
        if obj.get("generated_text") is not None:
            self.done = True
        details = obj.get("details")
        if isinstance(details, dict):
            if isinstance(details.get("generated_tokens"), int):
                self.record.output_tokens = details["generated_tokens"]
                self.record.output_tokens_source = "details"
            if isinstance(details.get("input_length"), int):
                self.record.prompt_tokens = details["input_length"]

    def finish(self) -> None:
        if not self.done:
            raise _StreamError("the stream ended before the final event (generated_text)")


def _headers(inp: RequestInput) -> dict[str, str]:
    return {"Authorization": f"Bearer {inp.api_key}"} if inp.api_key else {}


async def _stream(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], inp: RequestInput,
                  make_handler: Callable[[RequestRecord], _Handler]) -> RequestRecord:
    """POST ``payload``, feed the SSE events to a handler, and fill the record."""
    record = RequestRecord(prompt_tokens=inp.prompt_len, expected_output_tokens=inp.output_len)
    handler = make_handler(record)
    parser = SSEParser()
    timeout = aiohttp.ClientTimeout(total=inp.timeout)
    record.send_time = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=_headers(inp), timeout=timeout) as response:
            if response.status != 200:
                body = await response.text(errors="replace")
                raise _StreamError(f"HTTP {response.status}: {body.strip()[:_ERROR_TEXT_LIMIT]}")
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    handler.on_event(event, now)
            for event in parser.close():
                handler.on_event(event, time.perf_counter())
        handler.finish()
        if not record.chunk_times:
            raise _StreamError("the stream carried no output")
        record.success = True
    except _StreamError as exc:
        record.error = str(exc)
    except asyncio.TimeoutError:
        record.error = f"timed out after {inp.timeout} s"
    except Exception as exc:  # noqa: BLE001 - any failure is a failed request, never a crashed run
        record.error = f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_LIMIT]
    # E2EL ends at the last content chunk (vLLM's definition); a failure ends now.
    record.end_time = record.chunk_times[-1] if record.success else time.perf_counter()
    record.generated_text = "".join(getattr(handler, "text", []))
    if record.output_tokens_source == "chunks":
        record.output_tokens = len(record.chunk_times)  # no server count: one per chunk (see serving)
    return record


async def openai_request(session: aiohttp.ClientSession, base_url: str, inp: RequestInput) -> RequestRecord:
    """A streamed ``POST {base_url}/v1/completions`` asking for the usage chunk."""
    payload: dict[str, Any] = {
        "prompt": inp.prompt,
        "max_tokens": inp.output_len,
        "temperature": inp.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.model:
        payload["model"] = inp.model
    if inp.ignore_eos:
        payload["ignore_eos"] = True  # vLLM's extension (pagedtree takes it too); OpenAI has none
    return await _stream(session, base_url.rstrip("/") + "/v1/completions", payload, inp, _OpenAIHandler)


async def tgi_request(session: aiohttp.ClientSession, base_url: str, inp: RequestInput) -> RequestRecord:
    """A ``POST {base_url}/generate_stream`` with ``details`` (TGI has no ignore-EOS option)."""
    parameters: dict[str, Any] = {
        "max_new_tokens": inp.output_len,
        "details": True,
        "do_sample": inp.temperature > 0,
    }
    if inp.temperature > 0:
        parameters["temperature"] = inp.temperature  # TGI rejects 0 (greedy is do_sample false)
    payload = {"inputs": inp.prompt, "parameters": parameters}
    return await _stream(session, base_url.rstrip("/") + "/generate_stream", payload, inp, _TGIHandler)


BACKENDS: dict[str, RequestFunc] = {"openai": openai_request, "tgi": tgi_request}


async def served_model_name(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None,
                            timeout: float = 10.0) -> str | None:
    """The first model ``GET {base_url}/v1/models`` lists, or None when it cannot tell."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/models",
                               headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                               timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200:
                return None
            models = (await response.json(content_type=None)).get("data") or []
            return models[0].get("id") if models else None
    except Exception:  # noqa: BLE001 - only a convenience; the caller goes on without a name
        return None
