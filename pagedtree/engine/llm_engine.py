"""The step loop: schedule, execute, append tokens, emit outputs."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

from pagedtree.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedtree.engine.output_processor import OutputProcessor
from pagedtree.engine.speculator import Speculator
from pagedtree.outputs import RequestOutput
from pagedtree.request import Request, RequestStatus
from pagedtree.sampling_params import SamplingParams
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.scheduler.plan import Phase, StepPlan
from pagedtree.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedtree.spec.tree import TokenTree
from pagedtree.worker.attention import resolve_backend_name
from pagedtree.worker.draft_worker import DraftWorker
from pagedtree.worker.loader import load_model, load_tokenizer, resolve_model_path
from pagedtree.worker.model_runner import ModelRunner, StepOutput, kv_bytes_per_block

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
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype()
        started = time.monotonic()
        folder = resolve_model_path(config.model)
        loaded = load_model(folder, dtype=self.dtype, device=self.device)
        self.model_path = loaded.path
        self.model_config = loaded.config
        self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer)) if config.tokenizer else loaded.tokenizer
        self.vocab_size = int(loaded.config.vocab_size)
        self.eos_token_ids = _eos_token_ids(loaded.config, loaded.path, self.tokenizer)

        model_limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
        requested_len = config.max_model_len or model_limit
        if requested_len > model_limit:
            raise ValueError(f"max_model_len {requested_len} exceeds the model's {model_limit} positions")
        num_blocks = self._num_kv_blocks(loaded.model, requested_len)
        self.max_model_len = min(requested_len, num_blocks * config.block_size)
        backend = resolve_backend_name(config.attention_backend, self.device)
        self.runner = ModelRunner(
            loaded.model, num_blocks, config.block_size, self.device, self.dtype, backend
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_model_len=self.max_model_len,
            ),
            self.block_manager,
        )
        self.speculator = self._load_drafts(backend, num_blocks) if config.draft_model else None
        self.speculation_enabled = self.speculator is not None
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._rng = random.Random(config.seed)
        self._parents: dict[str, ParentRequest] = {}
        self._child_to_parent: dict[str, ParentRequest] = {}
        self._request_counter = 0
        self.num_prompt_tokens = 0
        self.num_failed_requests = 0
        self.load_seconds = time.monotonic() - started
        logger.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens, max_model_len %d, attention %s",
            self.model_path, self.load_seconds, num_blocks, config.block_size, self.max_model_len, backend,
        )

    # ------------------------------------------------------------- set-up
    def _num_kv_blocks(self, model, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(model, cfg.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Leave room for activations of a full token budget (a generous estimate).
            activations = 16 * cfg.max_num_batched_tokens * model.config.hidden_size * 4 + (1 << 30)
            budget = int(total * cfg.gpu_memory_utilization) - used - activations
        else:
            budget = cfg.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        blocks = budget // per_block
        # More blocks than every sequence at full length could use is waste.
        useful = cfg.max_num_seqs * -(-max_model_len // cfg.block_size) + 1
        blocks = min(blocks, useful)
        if blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {per_block} bytes"
            )
        return int(blocks)

    def _load_drafts(self, backend: str, target_blocks: int) -> Speculator:
        cfg = self.config
        spec = cfg.speculative
        drafts = []
        for index, name in enumerate(cfg.draft_model):
            loaded = load_model(resolve_model_path(name), dtype=self.dtype, device=self.device)
            vocab = int(loaded.config.vocab_size)
            if vocab != self.vocab_size:
                raise ValueError(
                    f"draft model {name!r} has a vocabulary of {vocab} tokens, the target {self.vocab_size}: "
                    "a draft must share the target's tokenizer"
                )
            limit = int(getattr(loaded.config, "max_position_embeddings", 4096))
            # Tree nodes never go past max_model_len (the scheduler caps the budget).
            if limit < self.max_model_len:
                raise ValueError(
                    f"draft model {name!r} has {limit} positions, fewer than max_model_len "
                    f"{self.max_model_len}; lower max_model_len"
                )
            # As many blocks as the target, plus every request's tree branches (each fed
            # node may take a copy-on-write copy or a fresh block).
            blocks = cfg.num_draft_kv_blocks or target_blocks + cfg.max_num_seqs * (spec.max_nodes + 2)
            runner = ModelRunner(loaded.model, blocks, cfg.block_size, self.device, self.dtype, backend)
            bm = BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)
            drafts.append(DraftWorker(runner, bm, name=f"draft{index}", index=index))
            logger.info("draft %d: %s with %d KV blocks", index, loaded.path, blocks)
        return Speculator(spec, drafts, self.vocab_size, self.device)

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
        parent = ParentRequest(request_id, text, ids)
        for i, child_id in enumerate(child_ids):
            # Seeds are hashed into streams, so seed + i needs no wrap-around.
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            parent.children.append(
                Request(child_id, text, list(ids), replace(params, n=1), sampling_seed=seed)
            )
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
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return outputs of the requests it touched.

        With speculation: choose the tree budget, schedule (decoding requests enter
        the DRAFT phase), draft their trees, run one target pass over prefill chunks
        and verify chunks together, accept a path per tree, compact its KV and free
        the rejected branches, then append the committed tokens one by one.
        """
        step_started = time.perf_counter()
        tree_budget = self._tree_budget()
        plan = self.scheduler.schedule(tree_budget)
        if self.speculator is not None:
            for request in plan.preempted:
                self.speculator.release(request.request_id)
        if plan.is_empty():
            if self.scheduler.waiting and not self.scheduler.running:
                # Cannot happen while max_model_len fits the cache; fail loudly rather
                # than let generate() spin forever.
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                    f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free"
                )
            return []
        trees = self._draft(plan)
        started = time.perf_counter()
        result = self._execute(plan)
        if self.speculator is not None:
            self.speculator.observe_target(plan.num_tokens, time.perf_counter() - started)
        committed = self._verify(plan, trees, result)
        if self.speculator is not None and committed:
            self.speculator.observe_step(
                tree_budget,
                [len(tokens) for tokens in committed.values()],
                [trees[rid].num_nodes for rid in committed],
                self.speculator.last_levels,
                self.speculator.last_fed,
            )
        touched: dict[str, ParentRequest] = {}
        for chunk in plan.chunks:
            request = chunk.request
            rid = request.request_id
            if request.status.finished:  # failed in isolation
                touched[rid] = self._child_to_parent[rid]
                continue
            if rid in committed:
                tokens = committed[rid]
            else:
                sample = result.samples.get(rid)
                if sample is None:
                    continue
                tokens = [(sample.token_id, sample.logprob, sample.top_logprobs)]
            for token_id, logprob, top in tokens:
                status = self.output_processor.append_token(request, token_id, logprob, top)
                if status is not None:
                    self._finish(request, status)
                    break
            touched[rid] = self._child_to_parent[rid]
        accepted = {rid: len(tokens) - 1 for rid, tokens in committed.items()}
        self.scheduler.update(plan, accepted)
        if self.speculator is not None:
            for chunk in plan.chunks:
                if chunk.phase == Phase.VERIFY and chunk.request.status == RequestStatus.RUNNING:
                    self.speculator.cache_blocks(chunk.request)
        if self.speculator is not None and self.speculation_enabled:
            decode_only = all(c.phase in (Phase.DECODE, Phase.VERIFY) for c in plan.chunks)
            if decode_only and not self.scheduler.waiting:
                appended = sum(len(committed.get(c.request.request_id, [None])) for c in plan.chunks)
                self.speculator.observe_step_rate(
                    len(plan.chunks), tree_budget if committed else 0, appended, time.perf_counter() - step_started
                )
        outputs = []
        for parent in {id(p): p for p in touched.values()}.values():
            outputs.append(self._output(parent))
        return outputs

    def set_speculation(self, enabled: bool) -> None:
        """Turn tree speculation on or off for the following steps (benchmarks use it
        to measure plain decoding with the same engine in the same run)."""
        if enabled and self.speculator is None:
            raise ValueError("this engine has no draft model")
        self.speculation_enabled = enabled

    def _tree_budget(self) -> int:
        """This step's per-request tree budget (0 without speculation)."""
        if self.speculator is None or not self.speculation_enabled:
            return 0
        sched = self.scheduler
        decoding = sum(1 for r in sched.running if r.num_tokens - r.num_computed_tokens == 1 and r.output_token_ids)
        pending = sum(r.num_tokens - r.num_computed_tokens for r in sched.running) - decoding
        pending += sum(r.num_tokens for r in sched.waiting)
        other = min(pending, self.config.max_num_batched_tokens)
        return self.speculator.choose_budget(decoding, other)

    def _draft(self, plan: StepPlan) -> dict[str, TokenTree]:
        """Draft trees for the plan's DRAFT chunks and turn them into VERIFY chunks."""
        drafting = [c for c in plan.chunks if c.phase == Phase.DRAFT]
        if not drafting:
            return {}
        assert self.speculator is not None
        try:
            # Failures of single requests are handled inside (they decode plainly this step).
            trees = self.speculator.propose([(c.request, c.tree_budget) for c in drafting])
        except Exception as exc:  # noqa: BLE001 - a bug in the speculator must not lose the step
            logger.exception("drafting failed (%s: %s); decoding this step without speculation",
                             type(exc).__name__, exc)
            for chunk in drafting:
                self.speculator.release(chunk.request.request_id)
            trees = {}
        for chunk in drafting:
            tree = trees.get(chunk.request.request_id)
            if tree is None:
                self.scheduler.attach_tree(chunk, chunk.token_ids[0], [], [], [])
            else:
                self.scheduler.attach_tree(chunk, tree.root_token, tree.tokens, tree.parents, tree.depths)
        return trees

    def _verify(
        self, plan: StepPlan, trees: dict[str, TokenTree], result: StepOutput
    ) -> dict[str, list[tuple[int, float, dict[int, float] | None]]]:
        """Verify every VERIFY chunk; compact accepted paths; commit the drafts.

        Returns the committed ``(token, logprob, top_logprobs)`` per request.
        """
        committed: dict[str, list[tuple[int, float, dict[int, float] | None]]] = {}
        src: list[int] = []
        dst: list[int] = []
        for chunk in plan.chunks:
            request = chunk.request
            rid = request.request_id
            if chunk.phase != Phase.VERIFY:
                continue
            logits = result.verify_logits.get(rid)
            if logits is None or request.status.finished:
                if self.speculator is not None:
                    self.speculator.release(rid)
                continue
            assert self.speculator is not None
            # Seeded requests are verified with their noise, the others with their own stream.
            uses_stream = not request.params.greedy and request.params.seed is None
            generator = self.runner.generator_for(rid, request.sampling_seed) if uses_stream else None
            try:
                verified = self.speculator.verify(request, trees[rid], logits, generator)
            except Exception as exc:  # noqa: BLE001 - fail this request, not the batch
                self._fail(request, exc)
                continue
            # Slide the accepted nodes' KV down to the slots right after the root.
            for depth, node in enumerate(verified.result.accepted_nodes, start=1):
                if chunk.slot_mapping[1 + node] != chunk.slot_mapping[depth]:
                    src.append(chunk.slot_mapping[1 + node])
                    dst.append(chunk.slot_mapping[depth])
            self.speculator.commit(request, verified.token_ids[:-1])
            committed[rid] = list(zip(verified.token_ids, verified.logprobs, verified.top_logprobs))
        self.runner.copy_slots(src, dst)
        return committed

    def _execute(self, plan: StepPlan) -> StepOutput:
        try:
            return self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - one bad request must not sink the batch
            if len(plan.chunks) == 1:
                self._fail(plan.chunks[0].request, exc)
                return StepOutput(samples={})
            logger.warning("step failed (%s); retrying its %d requests one by one", exc, len(plan.chunks))
        merged = StepOutput(samples={})
        copies_done = False
        for chunk in plan.chunks:
            single = StepPlan(chunks=[chunk], block_copies=[] if copies_done else plan.block_copies)
            copies_done = True
            try:
                out = self.runner.execute(single)
            except Exception as exc:  # noqa: BLE001
                self._fail(chunk.request, exc)
                continue
            merged.samples.update(out.samples)
            merged.verify_logits.update(out.verify_logits)
        return merged

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
            self.speculator.release(request.request_id)

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
        }
        if self.speculator is not None:
            stats.update(self.speculator.stats())
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
