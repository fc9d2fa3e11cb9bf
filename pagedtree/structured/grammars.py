"""Compiled grammars for one tokenizer: checked, compiled off the engine's thread in
a worker process that can be stopped, cached by content and shared by requests.

``Grammars.compile(spec)`` is what the server (in a thread of its pool) and
``LLM.generate`` call before a request reaches the engine; the engine then builds
each request's matcher from the cache (``Grammars.matcher``), which costs nothing
more for a constraint compiled before. A constraint over the limits, one xgrammar
rejects, or one whose compile runs past the time limit is a ``ValueError`` naming
the field.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedtree.structured.compile_service import CompileJob, CompileService, release_service, shared_service
from pagedtree.structured.compile_worker import CompiledPayload, CompileTimeout
from pagedtree.structured.matcher import RequestGrammar
from pagedtree.structured.schema_check import SchemaRefused, checked_schema
from pagedtree.structured_params import GrammarCompileConfig, StructuredOutputLimits, StructuredOutputsParams

logger = logging.getLogger("pagedtree")

# Compiled grammars kept for reuse, by their own size (a JSON schema's is tens to
# hundreds of KiB with a 150k vocabulary).
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


@dataclass(eq=False)
class _Cached:
    """A compiled grammar, and whether the strings it forces are short enough to
    build each step (``forced_bound``)."""

    compiled: Any
    forces: bool


@dataclass(eq=False)
class GrammarTicket:
    """A request's wait for its compiled grammar: ``future`` (done at once for a
    cache hit) gives the ``CompiledGrammar`` or raises ``ValueError`` naming the
    field; ``Grammars.leave`` gives the wait up (the compile is dropped when nobody
    else waits for it)."""

    spec: StructuredOutputsParams
    future: concurrent.futures.Future
    job: CompileJob | None = None


class Grammars:
    """The grammar compiler and cache of one engine (see module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 limits: StructuredOutputLimits, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 compile_config: GrammarCompileConfig | None = None,
                 worker_factory: Callable[..., Any] | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self.cache_bytes = cache_bytes
        self.compile_config = compile_config or GrammarCompileConfig()
        # A worker of one's own (tests: compiles in this process) means a service of
        # one's own; by default engines of one vocabulary share a service.
        self._worker_factory = worker_factory
        self._info: Any = None
        self._service: CompileService | None = None
        self._cache: OrderedDict[tuple, _Cached] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache and the service (held briefly: lookups never wait on compiles)
        self._info_lock = threading.Lock()  # building the vocabulary's view (a second; cache hits must not wait)
        self.num_compiled = 0
        self.num_cache_hits = 0

    def tokenizer_info(self) -> Any:
        """xgrammar's view of the vocabulary (built once, on first use: about a second
        for a 150k vocabulary)."""
        with self._info_lock:
            if self._info is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
            return self._info

    def lookup(self, spec: StructuredOutputsParams) -> Any | None:
        """The compiled grammar of ``spec`` if it is cached (counted as a hit), else None;
        never waits for a compile."""
        with self._lock:
            cached = self._cache.get(spec.key)
            if cached is None:
                return None
            self._cache.move_to_end(spec.key)
            self.num_cache_hits += 1
            return cached.compiled

    def submit(self, spec: StructuredOutputsParams, client: str | None = None) -> GrammarTicket:
        """Start getting ``spec``'s grammar: from the cache at once, or checked against
        the limits and queued for a compile (joining the same constraint's compile if
        one is in flight). ``ValueError`` for a constraint over the limits,
        ``CompileQueueFull`` when the compile queue is full for the server or for
        ``client`` (an API key, a connection)."""
        spec.check(self.limits)
        compiled = self.lookup(spec)
        if compiled is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(compiled)
            return GrammarTicket(spec, done)
        info = self.tokenizer_info()
        job = self._compile_service(info).submit(spec.key, _worker_request(spec), self.limits.compile_timeout_s,
                                                 lambda payload: self._finish(spec, info, payload), client)
        return GrammarTicket(spec, job.future, job)

    def result(self, ticket: GrammarTicket, timeout: float | None = None) -> Any:
        """The ticket's compiled grammar (waiting for it), or ``ValueError`` naming the field."""
        kind = ticket.spec.kind
        try:
            return ticket.future.result(timeout)
        except CompileTimeout:
            raise ValueError(f"StructuredOutputsParams.{kind} took longer than "
                             f"{self.limits.compile_timeout_s:g} s to compile; simplify it") from None
        except ValueError as exc:
            if str(exc).startswith("StructuredOutputsParams."):
                raise
            raise ValueError(f"StructuredOutputsParams.{kind} is not a valid {_WHAT[kind]}: {exc}") from None

    def leave(self, ticket: GrammarTicket) -> None:
        """Give up waiting for ``ticket`` (its request went away)."""
        if ticket.job is not None and self._service is not None:
            self._service.leave(ticket.job)

    def compile(self, spec: StructuredOutputsParams, client: str | None = None) -> Any:
        """The compiled grammar of ``spec`` (``submit`` and wait): from the cache, or
        compiled within the time limit counted from now. Thread-safe."""
        ticket = self.submit(spec, client)
        try:
            return self.result(ticket)
        except BaseException:
            self.leave(ticket)  # interrupted: a compile nobody waits for is dropped
            raise

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new matcher for one request (compiling first if needed)."""
        compiled = self.compile(spec)
        with self._lock:
            cached = self._cache.get(spec.key)
        forces = cached is not None and cached.forces  # (evicted meanwhile: not measured, not built)
        return RequestGrammar(compiled, self.vocab_size, self.stop_token_ids, self.tokenizer, jump_forward=forces)

    def stats(self) -> dict[str, int]:
        """Cache and compile counters."""
        with self._lock:
            service = self._service
            stats = {"grammar_cache_entries": len(self._cache), "grammar_cache_bytes": self._cached_bytes,
                     "grammars_compiled": self.num_compiled, "grammar_cache_hits": self.num_cache_hits}
        stats.update({"grammar_compiles_killed": service.num_killed if service is not None else 0,
                      "grammar_compile_queue": service.queued() if service is not None else 0,
                      "grammar_compiles_running": service.running() if service is not None else 0,
                      "grammar_compiles_refused": service.num_refused if service is not None else 0,
                      "grammar_worker_rss_bytes": service.worker_rss_bytes() if service is not None else 0})
        return stats

    def close(self) -> None:
        """Stop the compile workers (the last engine of their vocabulary to close)."""
        with self._lock:
            service, self._service = self._service, None
        if service is None:
            return
        if self._worker_factory is not None:
            service.close()
        else:
            release_service(service)

    def _finish(self, spec: StructuredOutputsParams, info: Any, payload: CompiledPayload) -> Any:
        """A compile's reply to the cached ``CompiledGrammar`` (in the compile's
        dispatcher thread); ``ValueError`` naming the field for one no output can start."""
        import xgrammar as xgr

        text, forced_bound = payload
        compiled = xgr.CompiledGrammar.deserialize_json(text, info)
        if not _allows_a_token(compiled, self.vocab_size):
            # A schema that only refers to itself, say: every request would fail on its
            # first token, so it is the client's error, found here once.
            raise ValueError(f"StructuredOutputsParams.{spec.kind} allows no output at all (no token can start "
                             f"a match of this {_WHAT[spec.kind]})")
        size = int(compiled.memory_size_bytes)
        key = spec.key
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache:
                self._cache[key] = _Cached(compiled, forces=forced_bound is not None)
                self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= int(dropped.compiled.memory_size_bytes)
        return compiled

    def _compile_service(self, info: Any) -> CompileService:
        with self._lock:
            if self._service is None:
                if self._worker_factory is not None:
                    self._service = CompileService(info.serialize_json(), self.compile_config, self._worker_factory)
                else:
                    self._service = shared_service(info.serialize_json(), self.compile_config)
            return self._service


def _allows_a_token(compiled: Any, vocab_size: int) -> bool:
    """Whether the grammar allows any first token (its start state's bitmask)."""
    import torch
    import xgrammar as xgr

    mask = torch.zeros(xgr.get_bitmask_shape(1, vocab_size), dtype=torch.int32)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
    return bool(mask.any())


_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
         "choice": "choice list", "grammar": "EBNF or Lark grammar"}


def _worker_request(spec: StructuredOutputsParams) -> tuple:
    """What the worker compiles: (kind, value, any_whitespace). A JSON schema is checked
    and normalised first (``schema_check``: refused with a ``ValueError`` naming the
    field where the grammar would not enforce it whole)."""
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "json":
        schema = json.loads(value)
        if spec.disable_additional_properties:
            schema = _closed_objects(schema)
        try:
            schema = checked_schema(schema)
        except SchemaRefused as exc:
            raise ValueError(f"StructuredOutputsParams.json: {exc}") from None
        value = json.dumps(schema)
    return (spec.kind, value, not spec.disable_any_whitespace)


def _closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema in it,
    walking only the keywords that hold subschemas (iteratively: a schema's depth is
    bounded by the limits, not by Python's stack)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("type") == "object" or "properties" in node:
            node["additionalProperties"] = False
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in _SUBSCHEMAS:
            stack.append(node.get(key))
    return schema


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "contains")
