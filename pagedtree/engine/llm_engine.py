"""The engine: requests in, outputs out, one step at a time.

A step is three calls, each with one owner:

- ``Scheduler.schedule()`` -> ``StepPlan``: which requests compute which tokens,
  the KV slots they write (and, with speculation, the slots reserved for each
  request's token tree, sized by the budget policy);
- ``StepRunner.execute(plan)`` -> ``StepResult``: drafting, one forward of the
  target, one device readback, verification; plain data;
- ``LLMEngine.update(plan, result)``: append the committed tokens (exact stops),
  fail and finish requests, the scheduler's KV bookkeeping (``Scheduler.update``),
  and the measurements speculation learns from.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

from pagedtree.config import EngineConfig, ResolvedConfig
from pagedtree.engine.async_steps import AsyncSteps
from pagedtree.engine.errors import EngineStoppedError
from pagedtree.engine.output_processor import OutputProcessor
from pagedtree.outputs import RequestOutput
from pagedtree.request import Request, RequestStatus
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.executor.launcher import TensorParallelGroupHandle
from pagedtree.executor.shards import load_draft_weights, load_target
from pagedtree.loading.loader import load_tokenizer, resolve_model_path
from pagedtree.loading.resolve import resolve_config, with_default_quantization
from pagedtree.scheduler.scheduler import Scheduler
from pagedtree.engine.speculation_setup import calibrate_speculation, load_speculator
from pagedtree.speculative.step_runner import StepRunner
from pagedtree.structured.grammars import Grammars
from pagedtree.step_data import StepPlan, StepResult
from pagedtree.text_checks import check_text
from pagedtree.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedtree")

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


class LLMEngine:
    """Owns the model, the KV cache, the scheduler; ``step()`` advances every request."""

    def __init__(self, config: EngineConfig):
        # The one resolve step: device, dtypes, formats (unset quantization -> the
        # model's own format: a GGUF file's blocks, exactly), split by consumer.
        config = with_default_quantization(config)
        self.config = config  # as given, flat (what the server and stats report)
        resolved = resolve_config(config)
        started = time.monotonic()
        # Tensor parallelism: ranks 1..N-1 start (or join) first and load their
        # shards while this process loads rank 0's.
        self.tensor_parallel = TensorParallelGroupHandle.start(config) if config.tensor_parallel_size > 1 else None
        if self.tensor_parallel is not None:  # rank 0's device of the group
            device = self.tensor_parallel.device
            resolved = replace(resolved, target=replace(resolved.target, device=device),
                               drafts=tuple(replace(d, device=device) for d in resolved.drafts))
        self.resolved = resolved
        self.device = resolved.target.device
        self.dtype = resolved.target.dtype
        self._finalizer = (weakref.finalize(self, self.tensor_parallel.shutdown)
                           if self.tensor_parallel is not None else None)
        self._shut_down = False
        try:
            self._load(resolved)
        except BaseException:
            if self.tensor_parallel is not None:
                self.tensor_parallel.group.mark_broken("rank 0 failed to start")
                self.shutdown()
            raise
        self.load_seconds = time.monotonic() - started
        logger.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens, max_model_len %d, attention %s%s",
            self.model_path, self.load_seconds, self.block_manager.num_blocks, resolved.cache.block_size,
            self.max_model_len, self.attention_backend,
            f", tensor parallel over {config.tensor_parallel_size} ranks" if self.tensor_parallel else "",
        )

    def _load(self, config: ResolvedConfig) -> None:
        channel = self.tensor_parallel.channel if self.tensor_parallel is not None else None
        # The drafts' weights first: a cache sized from the device's memory leaves
        # room for theirs.
        sharded = self.tensor_parallel is not None and config.parallel.draft_tensor_parallel_size > 1
        draft_channel = self.tensor_parallel.channel if sharded else None
        drafts = ([load_draft_weights(draft, draft_channel) for draft in config.drafts]
                  if config.speculative is not None else [])
        target = load_target(config.target, config.cache, config.scheduler, config.max_model_len, config.speculative,
                             channel, drafts)
        loaded = target.loaded
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer)) if config.tokenizer else loaded.tokenizer
        self.vocab_size = int(loaded.config.vocab_size)
        self.eos_token_ids = _eos_token_ids(loaded.config, loaded.path, self.tokenizer)
        self.max_model_len = target.max_model_len
        self.attention_backend = target.backend
        self.runner = target.runner
        num_blocks = target.num_blocks
        self.block_manager = BlockManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        max_batched = config.scheduler.max_num_batched_tokens
        if not config.scheduler.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)
        self.speculator = None
        if config.speculative is not None:
            self.speculator = load_speculator(config, self.vocab_size, self.max_model_len, num_blocks, drafts,
                                              draft_channel)
        self.scheduler = Scheduler(
            replace(config.scheduler, max_num_batched_tokens=max_batched, max_model_len=self.max_model_len),
            self.block_manager,
            tree_budget=self.speculator.budget if self.speculator is not None else None,
        )
        self.step_runner = StepRunner(self.runner, self.speculator)
        if self.tensor_parallel is not None:
            sharded_drafts = self.speculator.drafts if config.parallel.draft_tensor_parallel_size > 1 else []
            self.tensor_parallel.runners = [self.runner] + [draft.runner for draft in sharded_drafts]
        if self.speculator is not None and config.speculative.adaptive:
            calibrate_speculation(self.speculator, config, self.runner, loaded.path)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        asynchronous = self.config.async_scheduling
        if asynchronous is None:
            asynchronous = self.device.type == "cuda" and self.tensor_parallel is None
        self.async_steps = AsyncSteps(self) if asynchronous else None
        # Compiled on first use (a worker process, started then).
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                 self.config.structured_output_limits, compile_config=self.config.grammar_compile)
        self._rng = random.Random(config.seed)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, ParentRequest] = {}
        self._request_counter = 0
        self.num_prompt_tokens = 0
        self.num_failed_requests = 0

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks and the grammar compiler's process, and let
        go of the models, KV caches and CUDA graphs (on CUDA their memory goes back to
        the device at once, for the next engine of this process to size its cache
        from). The engine cannot step afterwards. Idempotent; the ranks are also
        stopped when the engine is garbage-collected or the interpreter exits, and
        the compiler when its input closes."""
        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        if self._finalizer is not None:
            self._finalizer()
        self._shut_down = True
        if getattr(self, "async_steps", None) is not None:
            self.async_steps.pending = None  # its tensors go with the runners
        for runner in self._runners():
            runner.close()
        if self.device.type == "cuda":
            gc.collect()  # whatever still refers to them in cycles
            torch.cuda.empty_cache()

    def _runners(self) -> list[ModelRunner]:
        """The target's runner and the drafts' (those loaded so far)."""
        runners = [self.runner] if getattr(self, "runner", None) is not None else []
        speculator = getattr(self, "speculator", None)
        if speculator is not None:
            runners += [draft.runner for draft in speculator.drafts]
        return runners

    def tensor_parallel_report(self) -> list[dict[str, object]]:
        """Every rank's counters (``TensorParallelGroupHandle.report``); ``[]`` on one process."""
        return self.tensor_parallel.report() if self.tensor_parallel is not None else []

    # ------------------------------------------------------------ requests
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

    def make_requests(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None
    ) -> ParentRequest:
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
            if rid in self._parents or rid in self._child_to_parent:
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

    def add_request(
        self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None
    ) -> str:
        """Validate and queue a request; returns its id."""
        if request_id is None:
            request_id = self.next_request_id()
        return self.add_parent(self.make_requests(request_id, prompt, params))

    def add_parent(self, parent: ParentRequest) -> str:
        """Queue requests built by ``make_requests``."""
        for rid in {parent.request_id, *(c.request_id for c in parent.children)}:
            if rid in self._parents or rid in self._child_to_parent:
                raise ValueError(f"request_id {parent.request_id!r} is already in use")
        self._parents[parent.request_id] = parent
        for child in parent.children:
            self._child_to_parent[child.request_id] = parent
            self.scheduler.add_request(child)
            self.num_prompt_tokens += child.num_prompt_tokens
        return parent.request_id

    def next_request_id(self) -> str:
        """A fresh request id."""
        self._request_counter += 1
        return str(self._request_counter)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            if not child.status.finished:
                self._finish(child, RequestStatus.FINISHED_ABORTED)
        return self._output(parent)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running, or a launched step is not read back."""
        return self.scheduler.has_unfinished() or (self.async_steps is not None and self.async_steps.pending is not None)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one step: schedule -> execute -> update (see module docstring); return
        the outputs of the requests it touched."""
        if self._shut_down:
            if self.tensor_parallel is not None:  # the group's own error says so too
                raise self.tensor_parallel.group.mark_broken("the engine was shut down")
            raise EngineStoppedError("the engine was shut down")
        if self.async_steps is not None:
            if self.async_steps.applies():
                return self.async_steps.step()
            if self.async_steps.pending is not None:  # speculation was switched on
                return self.async_steps.flush()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        result = self.step_runner.execute(plan)
        return self.update(plan, result, started)

    def update(self, plan: StepPlan, result: StepResult, started: float) -> list[RequestOutput]:
        """Append each request's committed tokens one by one (exact stops), fail and
        finish requests, then the scheduler's KV bookkeeping and speculation's
        measurements."""
        if plan.is_empty():
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen while max_model_len fits the cache; fail loudly rather
                # than let generate() spin forever.
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                    f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free"
                )
            return []
        # A request that ended before this update (a step planned ahead of the readback
        # that showed its stop, or an abort meanwhile) has nothing more to report.
        ended = {id(chunk.request) for chunk in plan.chunks if chunk.request.status.finished}
        for request, exc in result.failed:
            if id(request) not in ended:
                self._fail(request, exc)
        touched: dict[str, ParentRequest] = {}
        for chunk in plan.chunks:
            request = chunk.request
            if id(request) in ended:
                continue
            rid = request.request_id
            tokens = result.committed.get(rid)
            if not request.status.finished and tokens is not None:
                for token_id, logprob, top in tokens:
                    status = self.output_processor.append_token(request, token_id, logprob, top)
                    if status is None and request.grammar is not None:
                        status = self._advance_grammar(request, token_id)
                    if status is not None:
                        if status == RequestStatus.FINISHED_ERROR:
                            break  # failed (and finished) by _advance_grammar
                        self._finish(request, status)
                        break
            elif not request.status.finished:
                continue  # a prefill chunk that does not reach the end of its prompt
            touched[rid] = self._child_to_parent[rid]
        self.scheduler.update(plan, result)
        if self.speculator is not None:
            self.speculator.observe(plan, result, time.perf_counter() - started,
                                    queue_empty=not self.scheduler.waiting)
        return [self._output(parent) for parent in {id(p): p for p in touched.values()}.values()]

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Move the request's grammar past a committed token: ``FINISHED_STOPPED`` once
        the grammar has ended, ``FINISHED_ERROR`` (the request failed) if it does not
        allow the token, which masked sampling and verification never commit."""
        if not request.grammar.accept(token_id):
            self._fail(request, RuntimeError(f"token {token_id} does not follow the request's structured_outputs "
                                             "grammar"))
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if request.grammar.terminated else None

    def set_speculation(self, enabled: bool) -> None:
        """Turn tree speculation on or off for the following steps (benchmarks use it
        to measure plain decoding with the same engine in the same run)."""
        if enabled and self.speculator is None:
            raise ValueError("this engine has no draft model or drafter")
        self.scheduler.tree_budget = self.speculator.budget if enabled else None

    def set_async_scheduling(self, enabled: bool) -> None:
        """Launch plain steps ahead of their readback, or not, from the next step on
        (a launched step is read back first); benchmarks use it to compare both in one
        run. Refused under tensor parallelism."""
        if enabled and self.tensor_parallel is not None:
            raise ValueError("async scheduling needs one process")
        if self.async_steps is None:
            if not enabled:
                return
            self.async_steps = AsyncSteps(self)
        self.async_steps.enabled = enabled

    @contextlib.contextmanager
    def speculation_paused(self) -> Iterator[None]:
        """Steps inside run as if the engine had no speculator: nothing is drafted,
        measured or remembered (the warm-up's random prompts must not teach the
        budget or the suffix drafter anything)."""
        saved = self.speculator, self.step_runner, self.scheduler.tree_budget
        self.speculator, self.step_runner, self.scheduler.tree_budget = None, StepRunner(self.runner), None
        try:
            yield
        finally:
            self.speculator, self.step_runner, self.scheduler.tree_budget = saved

    @property
    def speculation_enabled(self) -> bool:
        """Whether the scheduler gives requests token trees."""
        return self.scheduler.tree_budget is not None

    def _fail(self, request: Request, exc: Exception) -> None:
        logger.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self.num_failed_requests += 1
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish(request, status)
        request.finish_time = time.monotonic()
        self.runner.release([request.request_id])
        self.output_processor.release(request.request_id)
        if self.speculator is not None:
            self.speculator.finish(request)

    def _output(self, parent: ParentRequest) -> RequestOutput:
        finished = parent.finished
        if finished:
            self._parents.pop(parent.request_id, None)
            for child in parent.children:
                self._child_to_parent.pop(child.request_id, None)
        errors = [c.error for c in parent.children if c.error]
        first = parent.children[0]
        metrics = {"arrival_time": first.arrival_time, "num_cached_tokens": float(first.num_cached_tokens)}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        if finished:
            metrics["finish_time"] = max(c.finish_time or 0.0 for c in parent.children)
        if self.speculator is not None:
            drafts = sum(c.spec_num_drafts for c in parent.children)
            accepted = sum(c.spec_num_accepted_tokens for c in parent.children)
            metrics["spec_num_drafts"] = float(drafts)
            metrics["spec_num_draft_tokens"] = float(sum(c.spec_num_draft_tokens for c in parent.children))
            metrics["spec_num_accepted_tokens"] = float(accepted)
            metrics["spec_mean_acceptance_length"] = 1.0 + accepted / drafts if drafts else 0.0
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[OutputProcessor.completion(c, i) for i, c in enumerate(parent.children)],
            finished=finished,
            error="; ".join(errors) if errors else None,
            metrics=metrics,
        )

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, object]:
        """Counters of the cache, the scheduler and the work done so far."""
        bm = self.block_manager
        stats: dict[str, object] = {
            "num_total_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.num_cached_blocks,
            "num_used_blocks": bm.num_blocks - bm.num_free_blocks,
            "kv_cache_usage": (bm.num_blocks - bm.num_free_blocks) / bm.num_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.output_processor.num_generated_tokens,
            "num_forward_passes": self.runner.num_forward_passes,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_failed_requests": self.num_failed_requests,
            "max_model_len": self.max_model_len,
            "num_target_forward_passes": self.runner.num_forward_passes,
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }
        if self.speculator is not None:
            stats.update(self.speculator.stats())
            stats["num_forced_tokens"] = self.speculator.proposer.num_forced_tokens
        stats.update(self.grammars.stats())
        return stats


def _eos_token_ids(config, folder, tokenizer) -> tuple[int, ...]:
    """EOS ids from the config, generation_config.json and the tokenizer, merged."""
    ids: list[int] = []

    def add(value) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(config, "eos_token_id", None))
    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(str(folder)).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


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
