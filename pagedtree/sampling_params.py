"""Per-request generation settings, validated up front (vLLM-compatible field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedtree.structured_params import StructuredOutputsParams
from pagedtree.text_checks import has_surrogate


# Seeds are 63-bit so that every engine (and torch's generators) takes them.
MAX_SEED = 2**63 - 1
# One request may fan out into at most this many sequences.
MAX_N = 1024
# Temperatures below this are greedy (as vLLM, which also guards against the
# overflow a division by ~1e-45 causes): the distribution is a point mass anyway.
MIN_TEMPERATURE = 1e-5
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    Field names and meanings follow vLLM's ``SamplingParams`` so a vLLM user can switch
    engines by changing one import. ``temperature == 0`` means greedy decoding
    (temperatures below ``MIN_TEMPERATURE`` = 1e-5 are taken as 0). ``seed`` (0 to
    2**63 - 1) makes the request's tokens a function of the seed: the same whatever
    the batch, preemptions or speculation. ``min_tokens`` holds the stop tokens (EOS,
    ``stop_token_ids``) back until that many tokens are out, except where nothing else
    may follow (a structured output's end): the output then ends there.
    Every field is checked in ``__post_init__``: an invalid value raises a
    ``ValueError`` naming the field before any work is done.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this (a JSON schema, a regex, a choice, a grammar).
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from the tokenizer/config; users normally leave these alone.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._validate()
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not _is_real(self.temperature) or math.isnan(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if math.isinf(self.temperature):
            raise bad("temperature", "must be finite")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_real(self.top_p) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_real(self.min_p) or math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", "must be None or an integer in [0, 2**63 - 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if isinstance(self.stop, str) and has_surrogate(self.stop):
            raise bad("stop", "must be valid Unicode text (no lone UTF-16 surrogates)")
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(s, str) for s in self.stop
            ):
                raise bad("stop", "must be a string, a list of strings, or None")
            if any(s == "" for s in self.stop):
                raise bad("stop", "must not contain empty strings")
            if any(has_surrogate(s) for s in self.stop):
                raise bad("stop", "must be valid Unicode text (no lone UTF-16 surrogates)")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0 or None")
        if (
            not _is_real(self.repetition_penalty)
            or math.isnan(self.repetition_penalty)
            or math.isinf(self.repetition_penalty)
            or self.repetition_penalty <= 0
        ):
            raise bad("repetition_penalty", "must be a finite number > 0")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams or None")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature 0)."""
        return self.temperature == 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
