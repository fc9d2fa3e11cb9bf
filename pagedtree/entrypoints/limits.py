"""What one HTTP request may ask of the server, and reading its JSON body within it.

Every bound here is a flag of ``pagedtree serve`` (see ``cli.py``); the defaults
follow TGI's (2 MB payloads, a few stop sequences) and uvicorn's (a short keep-alive).
A request over a bound is answered with a 4xx JSON error naming the bound before
any work is done, so no client can make the event loop or the engine thread spend
more than the bounds allow.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pagedtree.entrypoints.fields import BadRequest, kind_of
from pagedtree.text_checks import has_surrogate

# Bodies up to this size are parsed on the event loop; larger ones in a thread.
_PARSE_INLINE_BYTES = 64 * 1024


@dataclass(slots=True)
class ServerLimits:
    """Bounds on one request (flags of ``pagedtree serve`` in brackets).

    - ``max_request_bytes`` [--max-request-bytes]: body size (413 beyond it);
    - ``max_json_depth`` [--max-json-depth]: nesting of arrays and objects;
    - ``max_prompts_per_request`` [--max-prompts-per-request]: items of a prompt list;
    - ``max_sequences_per_request`` [--max-sequences-per-request]: prompts times
      ``n``, the sequences one request makes the engine run;
    - ``max_stop_sequences``, ``max_stop_length`` [--max-stop-sequences,
      --max-stop-length]: stop strings per request and characters per stop string;
    - ``body_timeout`` [--body-timeout]: seconds to receive a body (408 beyond it);
    - ``keepalive_timeout`` [--keepalive-timeout]: seconds a connection may stay
      without a complete request, which also bounds how slowly a client may send
      its request line and headers (slowloris).
    """

    max_request_bytes: int = 2_000_000
    max_json_depth: int = 32
    max_prompts_per_request: int = 256
    max_sequences_per_request: int = 256
    max_stop_sequences: int = 16
    max_stop_length: int = 512
    body_timeout: float = 30.0
    keepalive_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_json_depth", "max_prompts_per_request", "max_sequences_per_request",
                     "max_stop_sequences", "max_stop_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("body_timeout", "keepalive_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")


async def read_json_object(request: web.Request, limits: ServerLimits) -> dict[str, Any]:
    """The request body as a JSON object within ``limits``, or ``BadRequest`` saying why not.

    415 unless the body is declared ``application/json`` (a browser page can send
    ``text/plain`` across sites without a preflight; JSON it cannot), 413 beyond
    ``max_request_bytes``, 408 when the body takes longer than ``body_timeout``, 400
    for invalid JSON, nesting deeper than ``max_json_depth``, or a non-object.
    """
    if request.content_type != "application/json":
        raise BadRequest(
            f"the request body must be JSON sent with 'Content-Type: application/json', got "
            f"{request.headers.get('Content-Type', 'no Content-Type')!r}",
            status=415, code="unsupported_media_type",
        )
    limit = limits.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        async with asyncio.timeout(limits.body_timeout):
            chunks: list[bytes] = []
            size = 0
            while size <= limit:
                chunk = await request.content.read(limit + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            raw = b"".join(chunks)
    except TimeoutError as exc:
        raise BadRequest(f"the request body did not arrive within {limits.body_timeout:g} s",
                         status=408, code="request_timeout") from exc
    except RequestPayloadError as exc:  # a Content-Encoding (gzip, deflate) whose bytes do not decode
        raise BadRequest(f"the request body could not be read: {exc}") from None
    if len(raw) > limit:
        raise _too_large(len(raw), limit)
    if not raw:
        raise BadRequest("the request body is empty; expected a JSON object")
    if len(raw) > _PARSE_INLINE_BYTES:
        body = await asyncio.to_thread(_parse, raw, limits.max_json_depth)
    else:
        body = _parse(raw, limits.max_json_depth)
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {kind_of(body)}")
    return body


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"the request body is {size} bytes, more than the {limit} allowed (--max-request-bytes)",
                      status=413, code="request_too_large")


def _parse(raw: bytes, max_depth: int) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError as exc:
        raise BadRequest(f"the request body nests JSON more than {max_depth} levels deep") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from exc
    except ValueError:  # Python's bound on integer digits (sys.get_int_max_str_digits)
        raise BadRequest(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                         "digits") from None
    if json_depth(body, max_depth) > max_depth:
        raise BadRequest(f"the request body nests JSON more than {max_depth} levels deep (--max-json-depth)")
    where = invalid_text_path(body)
    if where is not None:
        raise BadRequest(f"{where or 'the request body'} is not valid Unicode text: it contains a lone UTF-16 "
                         "surrogate (a \\ud800-\\udfff escape that is not half of a pair)", where or None)
    return body


def invalid_text_path(value: Any) -> str | None:
    """The field path (``messages[0].content``) of a string, or object key, in a parsed
    JSON value that holds a lone surrogate; ``None`` when all text is valid.

    A pair of surrogate escapes is decoded by ``json`` into one character, so whatever
    is left is unencodable. Iterative, so depth costs no recursion.
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if has_surrogate(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                key_name = key if len(key) <= 64 else key[:61] + "..."  # paths go into messages
                name = f"{path}.{key_name}" if path else key_name
                if has_surrogate(key):
                    return f"{path}.<key>" if path else "<key>"
                stack.append((child, name))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def json_depth(value: Any, stop_above: int) -> int:
    """Nesting depth of arrays and objects (a scalar is 0), without recursion; stops
    counting once past ``stop_above``."""
    deepest = 0
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > stop_above:
            break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest
