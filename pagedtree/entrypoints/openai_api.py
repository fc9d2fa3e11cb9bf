"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Bodies are read by ``openai_params`` (output constraints by ``structured_fields``,
tools by ``tool_calls``); this module runs the requests and shapes the responses:
JSON, or SSE chunks ending with ``data: [DONE]``, with usage counts and tool calls.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pagedtree import __version__
from pagedtree.engine.async_stream import CompletionDelta, RequestStream
from pagedtree.entrypoints.fields import BadRequest, Fields
from pagedtree.entrypoints.openai_params import (
    parse_messages,
    parse_prompts,
    parse_sampling_params,
    parse_stream_options,
    parse_template_kwargs,
)
from pagedtree.entrypoints.server_context import ServerContext, merge_streams, request_id_of, sse_event
from pagedtree.entrypoints.structured_fields import Constraint, parse_openai_constraint
from pagedtree.entrypoints.tool_calls import ToolCallParser, ToolRequest, parse_tool_request, parse_whole
from pagedtree.structured_params import StructuredOutputLimits, StructuredOutputsParams

_DONE = sse_event("[DONE]")


@dataclass(slots=True)
class _Choice:
    """What a non-streamed choice accumulates."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIRoutes:
    """Handlers of the OpenAI protocol on one ``ServerContext``."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        tokenizer = ctx.engine.tokenizer
        # Names a client must not pass to apply_chat_template: its own parameters
        # (the template, tokenize, tools, ...) beside the template variables.
        reserved = {"chat_template", "tokenize", "tools", "documents", "add_generation_prompt",
                    "continue_final_message", "return_dict", "return_tensors", "tokenizer_kwargs"}
        if tokenizer is not None:
            reserved |= set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
        self._reserved_template_args = frozenset(reserved)
        self._warm_chat_template()

    def _warm_chat_template(self) -> None:
        """Compile the chat template now (transformers caches it), not on the first chat."""
        try:
            self._render_chat([{"role": "user", "content": "Hello"}], True, {})
        except Exception:  # noqa: BLE001 - no template, or one that wants other messages: chats will say
            pass

    def add_to(self, app: web.Application, prefix: str) -> None:
        """Register the routes under ``prefix``."""
        ep = self.ctx.endpoint
        app.router.add_post(prefix + "/v1/completions", ep(self.completions, "openai"))
        app.router.add_post(prefix + "/v1/chat/completions", ep(self.chat_completions, "openai"))
        app.router.add_get(prefix + "/v1/models", ep(self.models, "openai"))

    # ------------------------------------------------------------ models
    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the one served model."""
        return web.json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.ctx.config.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "pagedtree", "max_model_len": self.ctx.engine.max_model_len}

    def _check_model(self, body: Fields) -> str:
        name = body.get_str("model")
        served = self.ctx.config.model_name
        if name is not None and name != served:
            raise BadRequest(f"the model {name!r} does not exist; this server serves {served!r}",
                             "model", status=404, code="model_not_found")
        return served

    # ------------------------------------------------------- completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (streaming with ``"stream": true``)."""
        body = Fields(await self.ctx.read_body(request))
        model = self._check_model(body)
        prompts = parse_prompts(body)
        body.unsupported("suffix")
        for key in ("tools", "tool_choice", "functions", "function_call"):
            # Tool calls need the chat template's messages: never silently dropped.
            if body.data.get(key) is not None:
                raise BadRequest(f"{key} is a field of /v1/chat/completions, not of /v1/completions", key)
        echo = body.get_bool("echo", False)
        num_logprobs = body.get_int("logprobs", None, 0, self._max_logprobs)
        if echo and num_logprobs is not None:
            raise BadRequest("echo together with logprobs is not supported", "echo")
        constraint = parse_openai_constraint(body, self._structured_limits)
        params = parse_sampling_params(body, 16, num_logprobs, self.ctx.config.limits,
                                       structured=_params_of(constraint))
        stream, include_usage = parse_stream_options(body)
        meta = _Meta(f"cmpl-{request_id_of(request)}", "text_completion", int(time.time()), model)
        async with self.ctx.generation(request, prompts, params, structured_field=_field_of(constraint)) as streams:
            if stream:
                return await self._stream_completions(request, streams, meta, params.n, include_usage, echo)
            return await self._complete(streams, meta, params.n, echo)

    async def _complete(self, streams: list[RequestStream], meta: _Meta, n: int, echo: bool) -> web.Response:
        choices: dict[int, _Choice] = {}
        prompt_tokens = 0
        async for i, out in merge_streams(streams):
            self.ctx.check_finished(out)
            for c in out.outputs:
                choice = choices.setdefault(i * n + c.index, _Choice())
                _accumulate(choice, c)
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                if echo:
                    prefix = self._prompt_text(out.prompt, out.prompt_token_ids)
                    for c in out.outputs:
                        choices[i * n + c.index].text = prefix + choices[i * n + c.index].text
        body = meta.head() | {
            "choices": [
                {"index": k, "text": c.text, "finish_reason": c.finish_reason,
                 "logprobs": self._completion_logprobs(c.logprobs, 0) if c.logprobs else None}
                for k, c in sorted(choices.items())
            ],
            "usage": _usage(prompt_tokens, sum(c.num_tokens for c in choices.values())),
        }
        return web.json_response(body)

    async def _stream_completions(self, request: web.Request, streams: list[RequestStream], meta: _Meta, n: int,
                                  include_usage: bool, echo: bool) -> web.StreamResponse:
        response = await self.ctx.open_sse(request)
        offsets: dict[int, int] = {}
        echoed: set[int] = set()
        prompt_tokens = completion_tokens = 0
        try:
            async for i, out in merge_streams(streams):
                error = self.ctx.stream_error("openai", request, out)
                if error is not None:
                    await response.write(sse_event(error))
                    break
                events = []  # one write per engine step: a write is a syscall
                for c in out.outputs:
                    k = i * n + c.index
                    completion_tokens += len(c.delta_token_ids)
                    text = c.delta_text
                    if echo and k not in echoed:
                        echoed.add(k)
                        text = self._prompt_text(out.prompt, out.prompt_token_ids) + text
                    # A step's new tokens make a chunk even when their text is held
                    # back (a character split across tokens, a possible stop string):
                    # one chunk per token step, as vLLM streams, so that clients see
                    # every step and inter-token latencies count tokens, not characters.
                    if not (text or c.delta_token_ids or c.just_finished):
                        continue
                    logprobs = None
                    if c.delta_logprobs is not None:
                        pairs = list(zip(c.delta_token_ids, c.delta_logprobs))
                        logprobs = self._completion_logprobs(pairs, offsets.get(k, 0))
                        offsets[k] = offsets.get(k, 0) + sum(len(t) for t in logprobs["tokens"])
                    choice = {"index": k, "text": text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason if c.just_finished else None}
                    events.append(sse_event(meta.head(include_usage) | {"choices": [choice]}))
                if events:
                    await response.write(b"".join(events))
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
            else:
                await response.write(self._stream_end(meta, include_usage, prompt_tokens, completion_tokens))
                return response
            await response.write(_DONE)
        except ConnectionError:
            pass  # the client left; generation() aborts what still runs
        return response

    # -------------------------------------------------------------- chat
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: the tokenizer's chat template, then generation."""
        body = Fields(await self.ctx.read_body(request))
        model = self._check_model(body)
        messages = parse_messages(body)
        for key in ("functions", "function_call"):  # the deprecated forms of tools
            body.unsupported(key)
        tools = parse_tool_request(body, self._structured_limits.max_bytes)
        constraint = parse_openai_constraint(body, self._structured_limits,
                                             tools.constraint() if tools is not None else None)
        want_logprobs = body.get_bool("logprobs", False)
        top = body.get_int("top_logprobs", None, 0, self._max_logprobs)
        if top is not None and not want_logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")
        max_key = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
        params = parse_sampling_params(body, None, (top or 0) if want_logprobs else None, self.ctx.config.limits,
                                       max_key, _params_of(constraint))
        stream, include_usage = parse_stream_options(body)
        body.unsupported("echo", False)  # (on /v1/completions it is)
        continue_final = body.get_bool("continue_final_message", False)
        add_generation_prompt = body.get_bool("add_generation_prompt", not continue_final)
        if continue_final and (add_generation_prompt or messages[-1].get("role") != "assistant"):
            raise BadRequest("continue_final_message continues a final assistant message: the last message must "
                             "be the assistant's, and add_generation_prompt false", "continue_final_message")
        kwargs = parse_template_kwargs(body, self._reserved_template_args)
        if continue_final:
            kwargs["continue_final_message"] = True  # (a reserved name: clients cannot pass it in kwargs)
        # Rendering and tokenizing run in the engine's tokenizer pool, off the loop.
        prompt = await self.ctx.engine.run_in_tokenizer_pool(
            self._render_chat, messages, add_generation_prompt, kwargs, tools.template_tools() if tools else None)
        meta = _Meta(f"chatcmpl-{request_id_of(request)}", "chat.completion", int(time.time()), model)
        names = {"prompt": "messages", "max_tokens": max_key}
        async with self.ctx.generation(request, [prompt], params, names, _field_of(constraint)) as streams:
            if stream:
                return await self._stream_chat(request, streams[0], meta, include_usage, top or 0, tools)
            return await self._chat(streams[0], meta, top or 0, tools)

    @property
    def _max_logprobs(self) -> int:
        return self.ctx.engine.config.max_logprobs

    @property
    def _structured_limits(self) -> StructuredOutputLimits:
        """The engine's bounds on output constraints, checked here before it sees them."""
        return getattr(self.ctx.engine.config, "structured_output_limits", None) or StructuredOutputLimits()

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        tokenizer = self.ctx.engine.tokenizer
        template = self.ctx.config.chat_template
        if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
            raise BadRequest("messages: this model's tokenizer has no chat template; use /v1/completions "
                             "(or start the server with --chat-template)", "messages")
        try:
            text = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=tools, **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's (roles, ...)
            raise BadRequest(f"messages: the chat template rejected them: {exc}", "messages") from exc
        limit = self.ctx.engine.max_prompt_chars
        if len(text) > limit:
            raise BadRequest(f"messages: the rendered chat is {len(text)} characters, more than the context of "
                             f"{self.ctx.engine.max_model_len} tokens can hold", "messages")
        # The template already wrote any BOS; encoding with special tokens would double it.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    async def _chat(self, stream: RequestStream, meta: _Meta, top: int, tools: ToolRequest | None) -> web.Response:
        choices: dict[int, _Choice] = {}
        prompt_tokens = 0
        async for out in stream:
            self.ctx.check_finished(out)
            for c in out.outputs:
                _accumulate(choices.setdefault(c.index, _Choice()), c)
            prompt_tokens = len(out.prompt_token_ids)
        body = meta.head() | {
            "choices": [
                {"index": k, "message": message,
                 "logprobs": self._chat_logprobs(c.logprobs, top) if stream.params.logprobs is not None else None,
                 "finish_reason": finish_reason}
                for k, c in sorted(choices.items())
                for message, finish_reason in [_chat_message(c, tools)]
            ],
            "usage": _usage(prompt_tokens, sum(c.num_tokens for c in choices.values())),
        }
        return web.json_response(body)

    async def _stream_chat(self, request: web.Request, stream: RequestStream, meta: _Meta, include_usage: bool,
                           top: int, tools: ToolRequest | None) -> web.StreamResponse:
        response = await self.ctx.open_sse(request)
        want_logprobs = stream.params.logprobs is not None
        meta.object = "chat.completion.chunk"
        parsers: dict[int, ToolCallParser | None] = {}  # per choice, when tool calls are read
        started: set[int] = set()
        completion_tokens = 0
        prompt_tokens = 0
        try:
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                error = self.ctx.stream_error("openai", request, out)
                if error is not None:
                    await response.write(sse_event(error))
                    break
                chunks = []
                for c in out.outputs:
                    completion_tokens += len(c.delta_token_ids)
                    if c.index not in started:
                        started.add(c.index)
                        parsers[c.index] = tools.parser() if tools is not None else None
                        chunks.append({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None})
                    parser = parsers[c.index]
                    content, calls = c.delta_text, []
                    if parser is not None:
                        delta = parser.feed(c.delta_text)
                        if c.just_finished:
                            delta.extend(parser.finish())
                        content, calls = delta.content, delta.calls
                    # New tokens make a chunk even with no text yet (see the completions
                    # stream), unless a tool-call parser holds them back.
                    if content or calls or (c.delta_token_ids and (parser is None or want_logprobs)):
                        logprobs = None
                        if want_logprobs:
                            logprobs = self._chat_logprobs(list(zip(c.delta_token_ids, c.delta_logprobs or [])), top)
                        chunks.append({"index": c.index, "delta": _chunk_delta(content, calls),
                                       "logprobs": logprobs, "finish_reason": None})
                    if c.just_finished:
                        chunks.append({"index": c.index, "delta": {}, "logprobs": None,
                                       "finish_reason": _finish_reason(c.finish_reason, parser)})
                if chunks:
                    await response.write(b"".join(
                        sse_event(meta.head(include_usage) | {"choices": [choice]}) for choice in chunks
                    ))
            else:
                await response.write(self._stream_end(meta, include_usage, prompt_tokens, completion_tokens))
                return response
            await response.write(_DONE)
        except ConnectionError:
            pass
        return response

    # ---------------------------------------------------------- helpers
    @staticmethod
    def _stream_end(meta: _Meta, include_usage: bool, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage chunk (when asked for) and ``[DONE]``."""
        if not include_usage:
            return _DONE
        usage = _usage(prompt_tokens, completion_tokens)
        return sse_event(meta.head() | {"choices": [], "usage": usage}) + _DONE

    def _prompt_text(self, prompt: str | None, prompt_token_ids: list[int]) -> str:
        if prompt is not None:
            return prompt
        tokenizer = self.ctx.engine.tokenizer
        return tokenizer.decode(prompt_token_ids) if tokenizer is not None else ""

    def _completion_logprobs(self, pairs: list[tuple[int, dict[int, float]]], offset: int) -> dict[str, Any]:
        text = self.ctx.token_text
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, candidates in pairs:
            tokens.append(text(token_id))
            token_logprobs.append(candidates.get(token_id))
            top.append({text(t): lp for t, lp in candidates.items()})
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, pairs: list[tuple[int, dict[int, float]]], top: int) -> dict[str, Any]:
        text = self.ctx.token_text

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        content = []
        for token_id, candidates in pairs:
            best = sorted(candidates.items(), key=lambda kv: -kv[1])[:top]
            content.append(entry(token_id, candidates.get(token_id, 0.0))
                           | {"top_logprobs": [entry(t, lp) for t, lp in best]})
        return {"content": content}


@dataclass(slots=True)
class _Meta:
    """The fields every response or chunk of one request repeats."""

    id: str
    object: str
    created: int
    model: str

    def head(self, include_usage: bool = False) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": f"pagedtree-{__version__}"}
        if include_usage:
            head["usage"] = None  # OpenAI: null on every chunk but the last
        return head


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _params_of(constraint: Constraint | None) -> StructuredOutputsParams | None:
    return constraint.params if constraint is not None else None


def _field_of(constraint: Constraint | None) -> str | None:
    return constraint.field if constraint is not None else None


def _finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    """OpenAI's "tool_calls" for an output that ended with calls (a cut one stays "length")."""
    return "tool_calls" if parser is not None and parser.called and reason == "stop" else reason


def _chunk_delta(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content or not calls:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


def _chat_message(choice: _Choice, tools: ToolRequest | None) -> tuple[dict[str, Any], str | None]:
    """A non-streamed choice's message (content, tool calls) and finish reason."""
    parser = tools.parser() if tools is not None else None
    if parser is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    content, calls = parse_whole(parser, choice.text)
    if not calls:
        return {"role": "assistant", "content": content}, choice.finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
    return message, _finish_reason(choice.finish_reason, parser)


def _accumulate(choice: _Choice, c: CompletionDelta) -> None:
    choice.text = c.text
    choice.num_tokens = len(c.token_ids)
    if c.delta_logprobs is not None:
        choice.logprobs.extend(zip(c.delta_token_ids, c.delta_logprobs))
    choice.finish_reason = c.finish_reason
