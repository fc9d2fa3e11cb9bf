"""Request fields that constrain a request's output, read into ``StructuredOutputsParams``.

OpenAI's ``response_format``, vLLM's ``structured_outputs`` object and its older
``guided_*`` fields, and TGI's ``parameters.grammar``. A request has at most one
constraint, whichever field it comes from; each is checked against the engine's
``StructuredOutputLimits`` here, before the request reaches the engine, and every
error is a ``BadRequest`` naming the field as the client wrote it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedtree.entrypoints.fields import BadRequest, Fields, kind_of
from pagedtree.structured_params import KINDS, StructuredOutputLimits, StructuredOutputsParams

# vLLM's older top-level fields, each one constraint kind.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# Options that shape a constraint given by any field (they are not one themselves).
OPTION_KEYS = ("disable_any_whitespace", "disable_additional_properties")
STRUCTURED_KEYS = (*KINDS, *OPTION_KEYS)
GUIDED_BACKENDS = ("xgrammar", "auto")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "json", "regex")
TGI_GRAMMAR_TYPES = ("json", "regex")

# Which flag raises the bound an over-limit message is about.
_LIMIT_FLAGS = (("strings; at most", "--max-grammar-choices"), ("bytes; at most", "--max-grammar-bytes"),
                ("levels deep", "--max-schema-depth"))


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint and the field it came from (named in errors)."""

    params: StructuredOutputsParams
    field: str


@dataclass(frozen=True, slots=True)
class _Source:
    """One field that asks for a constraint, before it is built."""

    field: str
    kind: str
    value: Any
    options: dict[str, bool]


def build_constraint(field: str, kind: str, value: Any, options: dict[str, bool],
                     limits: StructuredOutputLimits) -> Constraint:
    """``StructuredOutputsParams(kind=value, **options)`` checked against ``limits``;
    its ``ValueError`` becomes a 400 about ``field``."""
    try:
        params = StructuredOutputsParams(**{kind: value}, **options)
        params.check(limits)
    except RecursionError:  # Python's own words would name its stack
        raise BadRequest(f"{field} nests too deeply to be read", field) from None
    except (ValueError, TypeError) as exc:
        raise BadRequest(field_message(str(exc), field), field) from None
    return Constraint(params, field)


def field_message(message: str, field: str) -> str:
    """A ``StructuredOutputsParams`` error in the client's field name (and the flag of a limit)."""
    renamed, count = re.subn(r"^StructuredOutputsParams\.\w+", field, message)
    if not count:
        renamed = f"{field}: {message.removeprefix('StructuredOutputsParams ')}"
    for wording, flag in _LIMIT_FLAGS:
        if wording in message:
            return f"{renamed} (the server's {flag})"
    return renamed


def parse_openai_constraint(body: Fields, limits: StructuredOutputLimits,
                            tool_constraint: tuple[str, dict[str, Any], bool] | None = None) -> Constraint | None:
    """The constraint of an OpenAI (or vLLM) request body, or None.

    ``tool_constraint`` is ``(field, schema, strict)`` when the request's
    ``tool_choice`` constrains the output (a named function or "required"); it
    conflicts with every other constraint like they do with each other.
    """
    options, sources = _structured_outputs(body)
    response_format = _response_format(body)
    if response_format is not None:
        sources.append(response_format)
    sources += _guided(body)
    if tool_constraint is not None:
        field, schema, strict = tool_constraint
        sources.append(_Source(field, "json", schema, {"disable_additional_properties": True} if strict else {}))
    if not sources:
        return None
    if len(sources) > 1:
        first, second = sources[0].field, sources[1].field
        raise BadRequest(f"{first} and {second} both constrain the output; a request may have only one of "
                         "response_format, structured_outputs, guided_json/regex/choice/grammar and a tool_choice "
                         "that calls a function", second)
    source = sources[0]
    merged = dict(options)
    for key, value in source.options.items():
        merged[key] = merged.get(key, False) or value
    return build_constraint(source.field, source.kind, source.value, merged, limits)


def _structured_outputs(body: Fields) -> tuple[dict[str, bool], list[_Source]]:
    """vLLM's ``structured_outputs`` object: its options and its constraint (if any).

    An object with only options shapes the constraint another field gives (so
    ``response_format`` can have JSON without free whitespace).
    """
    if not body.has("structured_outputs"):
        return {}, []
    so = body.get_object("structured_outputs")
    unknown = [k for k in so.data if k not in STRUCTURED_KEYS]
    if unknown:
        raise BadRequest(f"structured_outputs has unknown keys {', '.join(map(repr, unknown[:8]))}; accepted are "
                         f"{', '.join(STRUCTURED_KEYS)}", so.name(unknown[0]))
    options = {key: so.get_bool(key, False) for key in OPTION_KEYS}
    given = [k for k in KINDS if so.has(k) and not (k == "json_object" and so.data[k] is False)]
    if len(given) > 1:
        raise BadRequest(f"{so.name(given[0])} and {so.name(given[1])} both constrain the output; "
                         "structured_outputs takes exactly one of " + ", ".join(KINDS), so.name(given[1]))
    sources = [_Source(so.name(k), k, so.data[k], {}) for k in given]
    return options, sources


def _response_format(body: Fields) -> _Source | None:
    """OpenAI's ``response_format`` (and TGI's ``{"type": "json"|"regex", "value"}`` shape)."""
    if not body.has("response_format"):
        return None
    rf = body.get_object("response_format")
    kind = rf.required("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise BadRequest(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got "
                         f"{_short(kind)}", "response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _Source("response_format", "json_object", True, {})
    if kind in ("json", "regex"):  # TGI's chat shape
        value = rf.required("value")
        if kind == "regex" and not isinstance(value, str):
            raise rf.error("value", "must be a string (a regular expression)")
        if kind == "json" and not isinstance(value, (dict, str)):
            raise rf.error("value", "must be a JSON schema object")
        return _Source(rf.name("value"), kind, value, {})
    js = Fields(rf.required("json_schema"), "response_format.json_schema.")
    js.get_str("description")
    name = js.get_str("name")
    if name is not None and not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
        raise js.error("name", "must be 1 to 64 letters, digits, underscores or dashes")
    strict = js.get_bool("strict", False)
    schema = js.required("schema")
    if not isinstance(schema, dict):
        raise js.error("schema", "must be a JSON schema object")
    return _Source(js.name("schema"), "json", schema, {"disable_additional_properties": True} if strict else {})


def _guided(body: Fields) -> list[_Source]:
    """vLLM's ``guided_*`` fields (one constraint each), after checking the backend."""
    backend = body.data.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise BadRequest(f"guided_decoding_backend {_short(backend)} is not supported; this server uses xgrammar "
                         f"(accepted: {', '.join(GUIDED_BACKENDS)})", "guided_decoding_backend")
    if body.has("guided_whitespace_pattern"):
        raise BadRequest("guided_whitespace_pattern is not supported by this server (use "
                         "structured_outputs.disable_any_whitespace for JSON without free whitespace)",
                         "guided_whitespace_pattern")
    return [_Source(key, kind, body.data[key], {}) for key, kind in GUIDED_FIELDS.items() if body.has(key)]


def parse_tgi_grammar(parameters: Fields, limits: StructuredOutputLimits) -> Constraint | None:
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": schema}`` (an object or
    its JSON text) or ``{"type": "regex", "value": str}``."""
    if not parameters.has("grammar"):
        return None
    g = parameters.get_object("grammar")
    kind = g.required("type")
    if kind not in TGI_GRAMMAR_TYPES:
        raise BadRequest(f"{g.name('type')} must be one of {', '.join(TGI_GRAMMAR_TYPES)}, got {_short(kind)}",
                         g.name("type"))
    value = g.required("value")
    if kind == "json" and not isinstance(value, (dict, str)):
        raise g.error("value", "must be a JSON schema (an object, or its JSON text)")
    if kind == "regex" and not isinstance(value, str):
        raise g.error("value", "must be a string (a regular expression)")
    return build_constraint(g.name("value"), kind, value, {}, limits)


def _short(value: Any) -> str:
    """A client's value quoted in an error, cut short."""
    text = repr(value) if isinstance(value, str) else kind_of(value)
    return text if len(text) <= 80 else text[:77] + "..."
