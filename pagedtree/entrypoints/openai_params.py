"""OpenAI request bodies as engine inputs: prompts, chat messages, sampling parameters.

Fields follow OpenAI's API plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``repetition_penalty``, ``stop_token_ids``, ...).
Fields the engine cannot honour are rejected with a 400 naming them, never ignored.
Output constraints are read by ``structured_fields`` and tools by ``tool_calls``.
"""

from __future__ import annotations

from typing import Any

from pagedtree.entrypoints.fields import BadRequest, Fields
from pagedtree.entrypoints.limits import ServerLimits
from pagedtree.entrypoints.tool_calls import message_tool_calls
from pagedtree.sampling_params import MAX_SEED, SamplingParams
from pagedtree.structured_params import StructuredOutputsParams

MAX_N = 64  # choices per request (OpenAI's own bound is 128; each is a sequence here)
# Chat template variables a client may set: plain values of bounded size, never
# the template itself or the tokenizer's own options.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARG_CHARS = 4096


def parse_prompts(body: Fields) -> list[Any]:
    """``prompt`` as a list of engine prompts: text, token ids, or a batch of either."""
    prompt = body.required("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
    if prompt == []:
        raise BadRequest("prompt must not be empty", "prompt")
    raise body.error("prompt", "must be a string, an array of strings, an array of token ids, or an array of those")


def parse_messages(body: Fields) -> list[dict[str, Any]]:
    messages = body.required("messages")
    if not isinstance(messages, list) or not messages:
        raise body.error("messages", "must be a non-empty array of message objects")
    result = []
    for i, message in enumerate(messages):
        m = Fields(message, f"messages[{i}].")
        role = m.required("role")
        if not isinstance(role, str):
            raise m.error("role", "must be a string")
        content = m.raw("content", "")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                p = Fields(part, f"messages[{i}].content[{j}].")
                if p.get_str("type") != "text":
                    raise BadRequest(f"{p.name('type')} {p.raw('type')!r} is not supported (only 'text')", p.name("type"))
                parts.append(p.get_str("text", ""))
            content = "".join(parts)
        elif not isinstance(content, str):
            raise m.error("content", "must be a string or an array of text parts")
        entry: dict[str, Any] = {"role": role, "content": content}
        # Tool use in the history: an assistant's calls, and a tool's answer to one.
        if m.has("tool_calls"):
            entry["tool_calls"] = message_tool_calls(m.data["tool_calls"], m.name("tool_calls"))
        for key in ("tool_call_id", "name"):
            value = m.get_str(key)
            if value is not None:
                entry[key] = value
        result.append(entry)
    return result


def parse_stream_options(body: Fields) -> tuple[bool, bool]:
    stream = body.get_bool("stream", False)
    options = body.get_object("stream_options")
    if options.data and not stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    return stream, options.get_bool("include_usage", False)


def parse_template_kwargs(body: Fields, reserved: frozenset[str]) -> dict[str, Any]:
    """``chat_template_kwargs``: variables for the model's chat template (``reserved``
    names, the template and the tokenizer's own options, are refused)."""
    kwargs = body.raw("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise body.error("chat_template_kwargs", "must be an object")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise BadRequest(f"chat_template_kwargs has {len(kwargs)} keys, at most {MAX_TEMPLATE_KWARGS}",
                         "chat_template_kwargs")
    for key, value in kwargs.items():
        name = f"chat_template_kwargs.{key}"
        if key in reserved:
            raise BadRequest(f"{name} cannot be set by a request: only the template's own variables can "
                             "(the server's chat template is fixed)", name)
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            raise BadRequest(f"{name} must be a string, number, boolean or null", name)
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            raise BadRequest(f"{name} must be at most {MAX_TEMPLATE_KWARG_CHARS} characters", name)
    return kwargs


def parse_sampling_params(body: Fields, default_max_tokens: int | None, num_logprobs: int | None,
                          limits: ServerLimits, max_key: str = "max_tokens",
                          structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """OpenAI (and vLLM-extra) sampling fields as ``SamplingParams``; errors name the field.
    ``structured`` is the output constraint (read by ``structured_fields``)."""
    body.unsupported("presence_penalty", 0, 0.0)
    body.unsupported("frequency_penalty", 0, 0.0)
    body.unsupported("logit_bias", {})
    n = body.get_int("n", 1, 1, MAX_N)
    best_of = body.get_int("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise BadRequest("best_of different from n is not supported", "best_of")
    max_tokens = body.get_int(max_key, default_max_tokens, 1)
    min_tokens = body.get_int("min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise body.error("min_tokens", f"must be <= {max_key} ({max_tokens})")
    try:
        return SamplingParams(
            n=n,
            temperature=body.get_float("temperature", 1.0, 0.0),
            top_p=body.get_float("top_p", 1.0, 0.0, 1.0, exclusive_minimum=True),
            top_k=body.get_int("top_k", -1, -1),
            min_p=body.get_float("min_p", 0.0, 0.0, 1.0),
            seed=body.get_int("seed", None, 0, MAX_SEED),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=body.str_list("stop", limits.max_stop_sequences, limits.max_stop_length),
            stop_token_ids=body.int_list("stop_token_ids"),
            ignore_eos=body.get_bool("ignore_eos", False),
            logprobs=num_logprobs,
            repetition_penalty=body.get_float("repetition_penalty", 1.0, 0.0, exclusive_minimum=True),
            include_stop_str_in_output=body.get_bool("include_stop_str_in_output", False),
            skip_special_tokens=body.get_bool("skip_special_tokens", True),
            structured_outputs=structured,
        )
    except ValueError as exc:  # a combination SamplingParams refuses
        field_name = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise BadRequest(str(exc).removeprefix("SamplingParams."), field_name) from exc
