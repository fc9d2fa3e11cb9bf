"""Text Generation Inference (TGI) routes: ``/generate``, ``/generate_stream``, ``/`` and ``/info``.

Shapes follow TGI's router so its clients (``text_generation.Client``, which posts
to the base URL, i.e. ``/``) work unchanged: token events carry
``{id, text, logprob, special}``; the last one also ``generated_text`` and
``details``; errors are ``{error, error_type}``. ``parameters.grammar`` constrains
the output (a JSON schema or a regex; read by ``structured_fields``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pagedtree import __version__
from pagedtree.engine.async_stream import CompletionDelta, StreamOutput
from pagedtree.entrypoints.fields import BadRequest, Fields
from pagedtree.entrypoints.limits import ServerLimits
from pagedtree.entrypoints.server_context import ServerContext, sse_event
from pagedtree.entrypoints.structured_fields import parse_tgi_grammar
from pagedtree.sampling_params import MAX_SEED, SamplingParams
from pagedtree.structured_params import StructuredOutputLimits

MAX_TOP_N_TOKENS = 10
DEFAULT_MAX_NEW_TOKENS = 100
# The engine's field names as TGI clients know them, for error messages.
_NAMES = {"max_tokens": "parameters.max_new_tokens", "prompt": "inputs"}


@dataclass(slots=True)
class _TGIRequest:
    inputs: str
    params: SamplingParams
    seed: int | None  # reported in details when sampling
    details: bool
    return_full_text: bool
    top_n_tokens: int
    grammar_field: str | None = None  # where the output constraint came from (named in errors)


@dataclass(slots=True)
class _Tokens:
    """Per-token records built from a request's deltas (TGI reports every token)."""

    tokens: list[dict[str, Any]] = field(default_factory=list)
    top_tokens: list[list[dict[str, Any]]] = field(default_factory=list)
    pending_text: str = ""  # text that arrived without a token of its own (kept for the next)


class TGIRoutes:
    """Handlers of TGI's protocol on one ``ServerContext``."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    @property
    def _structured_limits(self) -> StructuredOutputLimits:
        """The engine's bounds on output constraints, checked here before it sees them."""
        return getattr(self.ctx.engine.config, "structured_output_limits", None) or StructuredOutputLimits()

    def add_to(self, app: web.Application, prefix: str) -> None:
        """Register the routes under ``prefix`` (the compat route is ``prefix`` itself)."""
        ep = self.ctx.endpoint
        app.router.add_post(prefix + "/generate", ep(self.generate, "tgi"))
        app.router.add_post(prefix + "/generate_stream", ep(self.generate_stream, "tgi"))
        app.router.add_get(prefix + "/info", ep(self.info, "tgi"))
        compat = ep(self.compat_generate, "tgi")
        app.router.add_post(prefix + "/", compat)
        if prefix:
            app.router.add_post(prefix, compat)

    # ------------------------------------------------------------ routes
    async def info(self, request: web.Request) -> web.Response:
        """``GET /info``: the model and the server's limits, in TGI's field names."""
        engine = self.ctx.engine
        target = engine.resolved.target
        return web.json_response({
            "model_id": self.ctx.config.model_name,
            "model_sha": None,
            "model_dtype": str(target.dtype).removeprefix("torch."),
            "model_device_type": target.device.type,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": engine.max_waiting_requests,
            "max_best_of": 1,
            "max_stop_sequences": self.ctx.config.limits.max_stop_sequences,
            "max_input_tokens": engine.max_model_len - 1,
            "max_total_tokens": engine.max_model_len,
            "max_batch_size": engine.config.max_num_seqs,
            "max_batch_total_tokens": engine.config.max_num_batched_tokens,
            "max_client_batch_size": 1,
            "validation_workers": 1,
            "router": "pagedtree",
            "version": __version__,
            "sha": None,
            "docker_label": None,
        })

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``: ``{generated_text, details?}``."""
        parsed = _parse(await self.ctx.read_body(request), self.ctx.config.limits, self._structured_limits)
        return web.json_response(await self._generate(request, parsed))

    async def compat_generate(self, request: web.Request) -> web.StreamResponse:
        """``POST /``: TGI's compat route, ``/generate`` as a one-item list, or a stream."""
        body = await self.ctx.read_body(request)
        stream = Fields(body).get_bool("stream", False)
        parsed = _parse(body, self.ctx.config.limits, self._structured_limits)
        if stream:
            return await self._stream(request, parsed)
        return web.json_response([await self._generate(request, parsed)])

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """``POST /generate_stream``: one SSE event per token."""
        parsed = _parse(await self.ctx.read_body(request), self.ctx.config.limits, self._structured_limits)
        return await self._stream(request, parsed)

    # ------------------------------------------------------- generation
    async def _generate(self, request: web.Request, parsed: _TGIRequest) -> dict[str, Any]:
        records = _Tokens()
        final: StreamOutput | None = None
        async with self.ctx.generation(request, [parsed.inputs], parsed.params, _NAMES,
                                       parsed.grammar_field) as streams:
            async for out in streams[0]:
                c = out.outputs[0]
                if out.finished:
                    self.ctx.check_finished(out)
                    final = out
                self._add_tokens(records, c, parsed.top_n_tokens)
        assert final is not None
        c = final.outputs[0]
        result: dict[str, Any] = {"generated_text": self._full_text(parsed, c)}
        if parsed.details:
            result["details"] = {
                "finish_reason": _finish_reason(c),
                "generated_tokens": len(c.token_ids),
                "seed": parsed.seed,
                "prefill": [],
                "tokens": records.tokens,
                "top_tokens": records.top_tokens if parsed.top_n_tokens else None,
            }
        return result

    async def _stream(self, request: web.Request, parsed: _TGIRequest) -> web.StreamResponse:
        async with self.ctx.generation(request, [parsed.inputs], parsed.params, _NAMES,
                                       parsed.grammar_field) as streams:
            response = await self.ctx.open_sse(request)
            records = _Tokens()
            try:
                async for out in streams[0]:
                    error = self.ctx.stream_error("tgi", request, out)
                    if error is not None:
                        await response.write(_event(error))
                        break
                    c = out.outputs[0]
                    first_new = len(records.tokens)
                    self._add_tokens(records, c, parsed.top_n_tokens)
                    new = range(first_new, len(records.tokens))
                    events = []  # one write per engine step: a write is a syscall
                    for position in new:
                        event: dict[str, Any] = {
                            "index": position,
                            "token": records.tokens[position],
                            "top_tokens": records.top_tokens[position] if parsed.top_n_tokens else None,
                            "generated_text": None,
                            "details": None,
                        }
                        if out.finished and position == new[-1]:
                            event["generated_text"] = self._full_text(parsed, c)
                            event["details"] = {
                                "finish_reason": _finish_reason(c),
                                "generated_tokens": len(c.token_ids),
                                "seed": parsed.seed,
                                "input_length": len(out.prompt_token_ids),
                            }
                        events.append(_event(event))
                    if events:
                        await response.write(b"".join(events))
            except ConnectionError:
                pass  # the client left; generation() aborts the request
        return response

    def _add_tokens(self, records: _Tokens, c: CompletionDelta, top_n: int) -> None:
        """One record per new token; a step's text goes to its last token."""
        records.pending_text += c.delta_text
        logprobs = c.delta_logprobs or []
        for j, token_id in enumerate(c.delta_token_ids):
            last = j == len(c.delta_token_ids) - 1
            candidates = logprobs[j] if j < len(logprobs) else {}
            records.tokens.append({
                "id": token_id,
                "text": records.pending_text if last else "",
                "logprob": candidates.get(token_id),
                "special": token_id in self.ctx.special_ids,
            })
            if last:
                records.pending_text = ""
            if top_n:
                best = sorted(candidates.items(), key=lambda kv: -kv[1])[:top_n]
                records.top_tokens.append([
                    {"id": t, "text": self.ctx.token_text(t), "logprob": lp, "special": t in self.ctx.special_ids}
                    for t, lp in best
                ])

    def _full_text(self, parsed: _TGIRequest, c: CompletionDelta) -> str:
        return parsed.inputs + c.text if parsed.return_full_text else c.text


def _event(data: dict[str, Any]) -> bytes:
    return sse_event(data, prefix=b"data:")  # TGI writes no space after the colon


def _finish_reason(c: CompletionDelta) -> str:
    """TGI's names: "length", "eos_token" (EOS or a stop token id), "stop_sequence"."""
    if c.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(c.stop_reason, str) else "eos_token"


def _parse(body: dict[str, Any], limits: ServerLimits, structured_limits: StructuredOutputLimits) -> _TGIRequest:
    """TGI's ``{inputs, parameters}`` as engine inputs; errors name ``parameters.<field>``."""
    f = Fields(body)
    inputs = f.required("inputs")
    if not isinstance(inputs, str):
        raise f.error("inputs", "must be a string")
    if not inputs:
        raise BadRequest("inputs must not be empty", "inputs")
    p = f.get_object("parameters")
    for key, allowed in (("best_of", (1,)), ("decoder_input_details", (False,)), ("truncate", ()),
                         ("typical_p", (1.0,)), ("watermark", (False,)),
                         ("frequency_penalty", (0.0,)), ("adapter_id", ())):
        p.unsupported(key, *allowed)
    do_sample = p.get_bool("do_sample", False)
    temperature = p.get_float("temperature", None, 0.0, exclusive_minimum=True)
    top_p = p.get_float("top_p", None, 0.0, 1.0, exclusive_minimum=True)
    top_k = p.get_int("top_k", None, 1)
    # As TGI does: any sampling knob away from its neutral value turns sampling on.
    sampling = do_sample or temperature not in (None, 1.0) or top_k is not None or top_p not in (None, 1.0)
    seed = p.get_int("seed", None, 0, MAX_SEED)
    if sampling and seed is None:
        seed = random.getrandbits(63)  # chosen here so that details can report it
    top_n = p.get_int("top_n_tokens", 0, 0, MAX_TOP_N_TOKENS) or 0
    grammar = parse_tgi_grammar(p, structured_limits)
    params = SamplingParams(
        temperature=(temperature or 1.0) if sampling else 0.0,
        top_p=top_p or 1.0,
        top_k=top_k or -1,
        seed=seed,
        max_tokens=p.get_int("max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 1),
        stop=p.str_list("stop", limits.max_stop_sequences, limits.max_stop_length),
        repetition_penalty=p.get_float("repetition_penalty", 1.0, 0.0, exclusive_minimum=True),
        logprobs=top_n,  # 0 still reports each sampled token's logprob
        structured_outputs=grammar.params if grammar is not None else None,
    )
    return _TGIRequest(
        inputs=inputs,
        params=params,
        seed=seed if sampling else None,
        details=p.get_bool("details", False),
        return_full_text=p.get_bool("return_full_text", False),
        top_n_tokens=top_n,
        grammar_field=grammar.field if grammar is not None else None,
    )
