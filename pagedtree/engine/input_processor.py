"""Prompts and sampling parameters in, validated requests out.

``InputProcessor`` checks everything a client sends before the engine sees it
(prompt text or ids, stop settings, logprobs, the request id, a structured-output
constraint) and builds the ``Request`` of every sequence of a user request
(``ParentRequest``: ``n > 1`` fans out into ``n`` children, vLLM v1's way).
``RequestTable`` keeps which user request each running sequence belongs to, so that
no id is handed out twice.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

from pagedtree.config import EngineConfig
from pagedtree.request import Request
from pagedtree.sampling_params import SamplingParams
from pagedtree.structured.grammars import Grammars
from pagedtree.text_checks import check_text

PromptType = Union[str, Mapping[str, Any]]


@dataclass(slots=True)
class ParentRequest:
    """A user request; with ``n > 1`` it fans out into ``n`` child sequences.

    Like vLLM v1, the children are independent requests; they share the prompt's
    KV through the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """Whether every child has ended."""
        return all(c.status.finished for c in self.children)


class RequestTable:
    """The user requests in the engine, by their id and by their sequences' ids."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.parent_of: dict[str, ParentRequest] = {}  # sequence id -> its user request
        self._counter = 0

    def in_use(self, request_id: str) -> bool:
        """Whether a request or a sequence has this id."""
        return request_id in self.parents or request_id in self.parent_of

    def add(self, parent: ParentRequest) -> None:
        """Register a user request and its sequences (their ids must be free)."""
        for rid in {parent.request_id, *(c.request_id for c in parent.children)}:
            if self.in_use(rid):
                raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.parent_of[child.request_id] = parent

    def drop_if_finished(self, parent: ParentRequest) -> bool:
        """Forget a user request whose sequences have all ended; whether it had."""
        if not parent.finished:
            return False
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.parent_of.pop(child.request_id, None)
        return True

    def next_id(self) -> str:
        """A fresh request id."""
        self._counter += 1
        return str(self._counter)


class InputProcessor:
    """Validates prompts and parameters and builds requests (see module docstring)."""

    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...], grammars: Grammars, table: RequestTable):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.table = table
        self._rng = random.Random(config.seed)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(text, token ids)`` of a prompt, validated; raises ``ValueError`` naming the problem."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(
                    "prompt is text but the model has no tokenizer; pass {'prompt_token_ids': [...]}"
                )
            check_text(prompt, "prompt")
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids
                ):
                    raise ValueError("prompt_token_ids must be a list of integers")
                ids = list(ids)
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise ValueError("prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        else:
            raise ValueError(
                f"prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, but the context (max_model_len) is {self.max_model_len}: "
                "it must leave room for at least one generated token"
            )
        return text, ids

    def make_requests(self, request_id: str, prompt: PromptType, params: SamplingParams | None) -> ParentRequest:
        """Validate and build the request(s) for one prompt without queuing them."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        bad_stop_ids = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop_ids:
            raise ValueError(f"stop_token_ids has ids outside the vocabulary: {bad_stop_ids}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"SamplingParams.logprobs must be <= {self.config.max_logprobs} (max_logprobs), got {params.logprobs}"
            )
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        # Every sequence id this request creates (its children's with n > 1) must be
        # free: a clash would hand one request's KV blocks to another.
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for rid in {request_id, *child_ids}:
            if self.table.in_use(rid):
                raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        params = replace(params, eos_token_ids=self.eos_token_ids)
        constraint = params.structured_outputs
        if constraint is not None and params.max_tokens is None and self.config.max_constrained_tokens is not None:
            # A grammar may never end (whitespace, an unbounded array): a default bound.
            params = replace(params, max_tokens=self.config.max_constrained_tokens)
        if constraint is not None:
            self.grammars.compile(constraint)  # ValueError naming the field; cached for the children
        parent = ParentRequest(request_id, text, ids)
        for i, child_id in enumerate(child_ids):
            # Seeds are hashed into streams, so seed + i needs no wrap-around.
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            child = Request(child_id, text, list(ids), replace(params, n=1), sampling_seed=seed)
            if constraint is not None:
                child.grammar = self.grammars.matcher(constraint)
            parent.children.append(child)
        return parent


def prompts_and_params(
    prompts: PromptType | Sequence[PromptType],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> list[tuple[PromptType, SamplingParams | None]]:
    """Pair each prompt with its params (one for all, or one each); a ``ValueError``
    names the argument that has the wrong type."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)):
        raise ValueError(
            "prompts must be a string, a dict with 'prompt_token_ids', or a list of those, "
            f"got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [(p, sampling_params) for p in prompts]
    if not isinstance(sampling_params, (list, tuple)) or not all(
        isinstance(sp, SamplingParams) for sp in sampling_params
    ):
        raise ValueError(
            "sampling_params must be a SamplingParams, a list of them, or None, "
            f"got {type(sampling_params).__name__}"
        )
    params = list(sampling_params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
    return list(zip(prompts, params))
