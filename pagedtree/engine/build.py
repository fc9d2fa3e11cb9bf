"""Everything an engine is made of, built once from its configuration.

``build_engine(config)`` resolves the configuration (device, dtypes, formats), starts
the tensor-parallel ranks when asked, loads the drafts' weights and then the target
(a cache sized from the device's memory leaves room for the drafts), builds the
speculation, the scheduler, the step runner and the input and output processors,
and calibrates the adaptive budget's costs. It returns them as ``EngineParts``;
``LLMEngine`` only loops over them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from pagedtree.config import EngineConfig, ResolvedConfig
from pagedtree.engine.input_processor import InputProcessor, RequestTable
from pagedtree.engine.output_processor import OutputProcessor
from pagedtree.engine.speculation_setup import calibrate_speculation, load_speculator
from pagedtree.engine.step_runner import StepRunner
from pagedtree.executor.launcher import TensorParallelGroupHandle
from pagedtree.executor.shards import load_draft_weights, load_target
from pagedtree.loading.loader import load_tokenizer, resolve_model_path
from pagedtree.loading.resolve import resolve_config, with_default_quantization
from pagedtree.scheduler.block_manager import BlockManager
from pagedtree.scheduler.scheduler import Scheduler
from pagedtree.speculative.speculation import NoSpeculation, Speculation
from pagedtree.structured.grammars import Grammars
from pagedtree.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedtree")


@dataclass(slots=True)
class EngineParts:
    """What ``build_engine`` returns: the loaded models and everything around them."""

    config: EngineConfig  # as given, flat (what the server and stats report)
    resolved: ResolvedConfig
    tensor_parallel: TensorParallelGroupHandle | None
    model_path: str
    model_config: object  # the target's transformers config
    tokenizer: object | None
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    attention_backend: str
    step_runner: StepRunner
    block_manager: BlockManager
    scheduler: Scheduler
    grammars: Grammars
    requests: RequestTable
    input_processor: InputProcessor
    output_processor: OutputProcessor
    asynchronous: bool  # plain steps launched ahead of their readback by default
    load_seconds: float

    @property
    def device(self) -> torch.device:
        """The target's device."""
        return self.resolved.target.device

    @property
    def dtype(self) -> torch.dtype:
        """The target's dtype."""
        return self.resolved.target.dtype

    @property
    def runner(self) -> ModelRunner:
        """The target's model runner."""
        return self.step_runner.runner


def build_engine(config: EngineConfig) -> EngineParts:
    """The parts of an engine for ``config`` (see module docstring). If loading fails,
    the tensor-parallel ranks started for it are stopped."""
    # The one resolve step: device, dtypes, formats (unset quantization -> the
    # model's own format: a GGUF file's blocks, exactly), split by consumer.
    config = with_default_quantization(config)
    resolved = resolve_config(config)
    started = time.monotonic()
    # Tensor parallelism: ranks 1..N-1 start (or join) first and load their shards
    # while this process loads rank 0's.
    tensor_parallel = TensorParallelGroupHandle.start(config) if config.tensor_parallel_size > 1 else None
    if tensor_parallel is not None:  # rank 0's device of the group
        device = tensor_parallel.device
        resolved = replace(resolved, target=replace(resolved.target, device=device),
                           drafts=tuple(replace(d, device=device) for d in resolved.drafts))
    try:
        parts = _load(config, resolved, tensor_parallel)
    except BaseException:
        if tensor_parallel is not None:
            tensor_parallel.group.mark_broken("rank 0 failed to start")
            tensor_parallel.shutdown()
        raise
    parts.load_seconds = time.monotonic() - started
    logger.info(
        "loaded %s in %.1fs: %d KV blocks of %d tokens, max_model_len %d, attention %s%s",
        parts.model_path, parts.load_seconds, parts.block_manager.num_blocks, resolved.cache.block_size,
        parts.max_model_len, parts.attention_backend,
        f", tensor parallel over {config.tensor_parallel_size} ranks" if tensor_parallel else "",
    )
    return parts


def _load(config: EngineConfig, resolved: ResolvedConfig,
          tensor_parallel: TensorParallelGroupHandle | None) -> EngineParts:
    channel = tensor_parallel.channel if tensor_parallel is not None else None
    # The drafts' weights first: a cache sized from the device's memory leaves room
    # for theirs.
    sharded = tensor_parallel is not None and resolved.parallel.draft_tensor_parallel_size > 1
    draft_channel = channel if sharded else None
    drafts = ([load_draft_weights(draft, draft_channel) for draft in resolved.drafts]
              if resolved.speculative is not None else [])
    target = load_target(resolved.target, resolved.cache, resolved.scheduler, resolved.max_model_len,
                         resolved.speculative, channel, drafts)
    loaded = target.loaded
    tokenizer = load_tokenizer(resolve_model_path(resolved.tokenizer)) if resolved.tokenizer else loaded.tokenizer
    vocab_size = int(loaded.config.vocab_size)
    eos_token_ids = _eos_token_ids(loaded.config, loaded.path, tokenizer)
    block_manager = BlockManager(target.num_blocks, resolved.cache.block_size, resolved.cache.enable_prefix_caching)
    max_batched = resolved.scheduler.max_num_batched_tokens
    if not resolved.scheduler.enable_chunked_prefill:
        max_batched = max(max_batched, target.max_model_len)
    speculator = None
    if resolved.speculative is not None:
        speculator = load_speculator(resolved, vocab_size, target.max_model_len, target.num_blocks, drafts,
                                     draft_channel)
    speculation: Speculation = speculator if speculator is not None else NoSpeculation()
    scheduler = Scheduler(
        replace(resolved.scheduler, max_num_batched_tokens=max_batched, max_model_len=target.max_model_len),
        block_manager, budget_policy=speculation.budget,
    )
    if tensor_parallel is not None:
        sharded_drafts = speculation.drafts if sharded else []
        tensor_parallel.runners = [target.runner] + [draft.runner for draft in sharded_drafts]
    if speculator is not None and resolved.speculative.adaptive:
        calibrate_speculation(speculator, resolved, target.runner, loaded.path)
    # Compiled on first use (a worker process, started then).
    grammars = Grammars(tokenizer, vocab_size, eos_token_ids, config.structured_output_limits,
                        compile_config=config.grammar_compile)
    requests = RequestTable()
    asynchronous = config.async_scheduling
    if asynchronous is None:  # on by default where a step's host work can overlap the device's
        asynchronous = resolved.target.device.type == "cuda" and tensor_parallel is None
    return EngineParts(
        config=config, resolved=resolved, tensor_parallel=tensor_parallel, model_path=loaded.path,
        model_config=loaded.config, tokenizer=tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
        max_model_len=target.max_model_len, attention_backend=target.backend,
        step_runner=StepRunner(target.runner, speculation), block_manager=block_manager, scheduler=scheduler,
        grammars=grammars, requests=requests,
        input_processor=InputProcessor(config, tokenizer, vocab_size, target.max_model_len, eos_token_ids,
                                       grammars, requests),
        output_processor=OutputProcessor(tokenizer, target.max_model_len), asynchronous=asynchronous,
        load_seconds=0.0,
    )


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
