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

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pagedtree.structured.compile_worker import CompileTimeout, CompileWorker, release_worker, shared_worker
from pagedtree.structured.matcher import RequestGrammar
from pagedtree.structured_params import StructuredOutputLimits, StructuredOutputsParams

logger = logging.getLogger("pagedtree")

# Compiled grammars kept for reuse, by their own size (a JSON schema's is tens to
# hundreds of KiB with a 150k vocabulary).
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


class Grammars:
    """The grammar compiler and cache of one engine (see module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 limits: StructuredOutputLimits, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.limits = limits
        self.cache_bytes = cache_bytes
        self._info: Any = None
        self._worker: CompileWorker | None = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()  # the cache and the worker
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

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec``: from the cache, or checked against the
        limits and compiled in the worker process. Thread-safe; blocks the calling
        thread for at most the compile time limit."""
        spec.check(self.limits)
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
        info = self.tokenizer_info()
        request = _worker_request(spec)
        try:
            text = self._compile_worker(info).compile(request, self.limits.compile_timeout_s)
        except CompileTimeout:
            raise ValueError(f"StructuredOutputsParams.{spec.kind} took longer than "
                             f"{self.limits.compile_timeout_s:g} s to compile; simplify it") from None
        except ValueError as exc:
            raise ValueError(f"StructuredOutputsParams.{spec.kind} is not a valid {_WHAT[spec.kind]}: {exc}") from None
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(text, info)
        if not _allows_a_token(compiled, self.vocab_size):
            # A schema that only refers to itself, say: every request would fail on its
            # first token, so it is the client's error, found here once.
            raise ValueError(f"StructuredOutputsParams.{spec.kind} allows no output at all (no token can start "
                             f"a match of this {_WHAT[spec.kind]})")
        size = int(compiled.memory_size_bytes)
        with self._lock:
            self.num_compiled += 1
            if key not in self._cache:
                self._cache[key] = compiled
                self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= int(dropped.memory_size_bytes)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new matcher for one request (compiling first if needed)."""
        return RequestGrammar(self.compile(spec), self.vocab_size, self.stop_token_ids, self.tokenizer)

    def stats(self) -> dict[str, int]:
        """Cache counters."""
        with self._lock:
            return {"grammar_cache_entries": len(self._cache), "grammar_cache_bytes": self._cached_bytes,
                    "grammars_compiled": self.num_compiled, "grammar_cache_hits": self.num_cache_hits,
                    "grammar_compiles_killed": self._worker.num_killed if self._worker is not None else 0}

    def close(self) -> None:
        """Stop the worker process."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            release_worker(worker)

    def _compile_worker(self, info: Any) -> CompileWorker:
        with self._lock:
            if self._worker is None:
                self._worker = shared_worker(info.serialize_json())
            return self._worker


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
    """What the worker compiles: (kind, value, any_whitespace)."""
    value: Any = getattr(spec, spec.kind)
    if spec.kind == "json" and spec.disable_additional_properties:
        value = json.dumps(_closed_objects(json.loads(value)))
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
