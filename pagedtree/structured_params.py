"""What a request's output must match: a JSON schema, any JSON object, a regex, one of
a list of strings, or a grammar (vLLM-compatible ``StructuredOutputsParams``).

Plain data, checked when built: exactly one constraint, each of a bounded size, so
that nothing a client sends reaches the grammar compiler unchecked. The compile-time
limits (size, nesting, time) are the engine's (``StructuredOutputLimits``); the
grammar itself is compiled by ``pagedtree.structured``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from pagedtree.text_checks import has_surrogate

# The constraint kinds, in the order vLLM lists them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _require_counts(config: object, names: tuple[str, ...]) -> None:
    """``ValueError`` naming the first of ``config``'s fields ``names`` that is not an
    integer >= 1."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class StructuredOutputLimits:
    """Bounds on one request's constraint, enforced before it is compiled.

    The defaults admit every schema of the OpenAI function-calling guides and
    vLLM's examples with a wide margin; a server sets them with
    ``--max-grammar-bytes``, ``--max-schema-depth``, ``--max-grammar-choices`` and
    ``--grammar-compile-timeout``.
    """

    max_bytes: int = 64 * 1024  # a schema, regex, grammar, or all choices together (UTF-8)
    max_schema_depth: int = 32  # nested objects/arrays in a JSON schema
    max_choices: int = 1024
    compile_timeout_s: float = 10.0  # a compile that takes longer is killed and the request refused

    def __post_init__(self) -> None:
        _require_counts(self, ("max_bytes", "max_schema_depth", "max_choices"))
        t = self.compile_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"StructuredOutputLimits.compile_timeout_s must be a finite number > 0, got {t!r}")


def default_compile_workers() -> int:
    """Grammar compile workers by default: about half the cores, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass(frozen=True, slots=True)
class GrammarCompileConfig:
    """How a server's grammar compiles are served (``structured/compile_service.py``):
    ``workers`` processes compile at once, each bounded to ``worker_memory_bytes`` of
    data beyond what its loaded compiler holds (None: unbounded); at most
    ``max_queued`` compiles wait for a worker, and a client has at most
    ``max_per_client`` compiles queued or running (beyond either, HTTP 429 with
    ``Retry-After``). Server flags: ``--grammar-compile-workers``,
    ``--max-queued-grammar-compiles``, ``--max-grammar-compiles-per-client``,
    ``--grammar-worker-memory``."""

    workers: int = field(default_factory=default_compile_workers)
    max_queued: int = 32
    max_per_client: int = 4
    worker_memory_bytes: int | None = 2 * 1024**3

    def __post_init__(self) -> None:
        _require_counts(self, ("workers", "max_queued", "max_per_client"))
        memory = self.worker_memory_bytes
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 2**28):
            raise ValueError(f"GrammarCompileConfig.worker_memory_bytes must be None or >= 256 MiB, got {memory!r}")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one constraint on a request's output.

    - ``json``: a JSON schema (a dict, or its JSON text);
    - ``json_object``: any JSON object (``response_format={"type": "json_object"}``);
    - ``regex``: the output matches this regular expression whole;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (GBNF, with a ``root`` rule) or a Lark grammar;
    - ``disable_any_whitespace``: JSON without free whitespace (compact, ``", "`` and
      ``": "`` separators), which costs fewer tokens;
    - ``disable_additional_properties``: objects of a schema take only the properties
      it lists, whatever its ``additionalProperties`` says.

    Checked when built (``ValueError`` naming the field); a schema given as a dict is
    kept as its JSON text, so equal constraints share one compiled grammar.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams needs exactly one of json, regex, choice, grammar or "
                             f"json_object, got {', '.join(given) if given else 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams.{name} must be a boolean, got {getattr(self, name)!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be true or None, got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")
                if has_surrogate(value) or "\x00" in value:
                    raise ValueError(f"StructuredOutputsParams.{name} must be valid text (no NUL, no lone surrogates)")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must hold non-empty strings only")
            if any(has_surrogate(c) or "\x00" in c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be valid text (no NUL, no lone surrogates)")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key)."""
        value = getattr(self, self.kind)
        return (self.kind, value, self.disable_any_whitespace, self.disable_additional_properties)

    def check(self, limits: StructuredOutputLimits) -> None:
        """Raise ``ValueError`` naming the field if the constraint is over ``limits``."""
        kind = self.kind
        if kind == "choice":
            if len(self.choice) > limits.max_choices:
                raise ValueError(f"StructuredOutputsParams.choice has {len(self.choice)} strings; "
                                 f"at most {limits.max_choices} are accepted")
            size = sum(len(c.encode()) for c in self.choice)
        elif kind == "json_object":
            size = 0
        else:
            size = len(getattr(self, kind).encode())
        if size > limits.max_bytes:
            raise ValueError(f"StructuredOutputsParams.{kind} is {size} bytes; at most {limits.max_bytes} "
                             "are accepted")
        if kind == "json":
            depth = _depth(json.loads(self.json))
            # A schema's nesting: every level of data takes about two of JSON (a
            # "properties" or "items" and the schema below it).
            if depth > 2 * limits.max_schema_depth:
                raise ValueError(f"StructuredOutputsParams.json nests {depth} levels deep; at most "
                                 f"{2 * limits.max_schema_depth} are accepted")


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text, checked to be a JSON object (or ``true``)."""
    if isinstance(schema, str):
        if has_surrogate(schema):
            raise ValueError("StructuredOutputsParams.json must be valid text (no lone surrogates)")
        try:
            parsed = json.loads(schema)
        except RecursionError:
            raise ValueError("StructuredOutputsParams.json nests JSON too deeply to be read") from None
        except ValueError as exc:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {exc}") from None
    else:
        parsed = schema
    if parsed is True:
        parsed = {}
    if not isinstance(parsed, dict):
        raise ValueError("StructuredOutputsParams.json must be a JSON schema object (a dict or its JSON text), "
                         f"got {type(parsed).__name__}")
    try:
        return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise ValueError("StructuredOutputsParams.json nests too deeply to be written as JSON") from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"StructuredOutputsParams.json cannot be written as JSON: {exc}") from None


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a hostile schema may be deep)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest
