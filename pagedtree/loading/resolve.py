"""The engine's one resolve step: probe the machine and the model's format once, and
split the flat ``EngineConfig`` (the keyword arguments of ``LLM``, ``AsyncEngine``
and the CLI) into the configs each component takes (``ResolvedConfig``).

Everything that asks the machine a question lives here: whether CUDA is present,
whether the CPU computes bf16 natively (``/proc/cpuinfo``), whether ONNX Runtime
imports (the q4/q8 formats), and which format a model runs in when the caller does
not say (``model_format.default_quantization``).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedtree.config import (
    BF16_QUANTIZATIONS,
    CPU_STREAM_SPECULATION,
    DTYPES,
    OFFLOAD_AUTO,
    OFFLOADED_SPECULATION,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    ResolvedConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedtree.devices import cpu_flags, indexed_device
from pagedtree.loading.model_format import block_quant_available, default_quantization
from pagedtree.worker.models.ggml_graph import ROW_GROUP
from pagedtree.worker.models.ggml_matmul import ggml_available


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16), where bf16
    linear layers run about twice as fast as fp32 (``devices.cpu_flags``)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """The torch device to run on ("auto": CUDA when present, else CPU), a CUDA one
    with its index: ``cuda`` is the current CUDA device, named as its tensors name it
    (``cuda:0``), so that what holds the engine's device and what holds its tensors agree."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)  # the name was checked by EngineConfig
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is available")
    return indexed_device(resolved)


def resolve_dtype(dtype: str | torch.dtype, quantization: str | None, device: torch.device) -> torch.dtype:
    """A model's activation (and dense weight) dtype. "auto": bf16 on CUDA, for weights
    whose kernels take bf16 (int8, int4) and on CPUs with native bf16 arithmetic (as
    vLLM's CPU build); fp32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if quantization in BF16_QUANTIZATIONS or device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return DTYPES[dtype]


def with_default_quantization(config: EngineConfig) -> EngineConfig:
    """``config`` with an unset ``quantization`` replaced by the format its model runs
    in by default for its ``workload`` (unset: a single stream)."""
    if config.quantization is not None:
        return config
    if config.offload_weights_gb not in (None, 0.0):  # streamed layers are dense (or int8/int4) tensors
        return dataclasses.replace(config, quantization="none")
    device = resolve_device(config.device)
    return dataclasses.replace(config, quantization=default_quantization(
        config.model, config.dtype, device, config.tensor_parallel_size, workload=config.workload or "stream",
        max_num_seqs=config.max_num_seqs, dense_dtype=resolve_dtype(config.dtype, None, device)))


def _target_offload(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    quantization: str | None) -> float | str | None:
    """The target's ``offload_weights_gb`` resolved: what was asked, or None when it
    stays resident (see ``executor/offload.py``). Raises for a format whose weights a
    CPU library holds."""
    requested = config.offload_weights_gb
    if requested is None:  # automatic: only a GPU short of room for the weights streams
        if device.type != "cuda":
            return None
        from transformers import AutoConfig

        from pagedtree.loading.loader import resolve_model_path
        from pagedtree.loading.offload_sizing import exceeds_device

        try:
            hf_config = AutoConfig.from_pretrained(str(resolve_model_path(config.model)))
        except (OSError, ValueError):  # the load reports a model it cannot find
            return None
        if not exceeds_device(device, hf_config, dtype, config.gpu_memory_utilization,
                              config.max_num_batched_tokens, config.max_model_len):
            return None
        return OFFLOAD_AUTO
    if requested == 0:
        return None
    if quantization in ("q4", "q8", "q4-rounded", "ggml"):
        raise ValueError(f"offload_weights_gb streams dense, int8 or int4 weights to the device; {quantization!r} "
                         "weights are held by a CPU library (choose quantization='none', 'int8' or 'int4')")
    return requested


def default_draft_quantization(target_quantization: str | None) -> str | None:
    """A draft's format when none is asked for: the target's, except beside a q4
    target, where the draft rounds its wider blocks to 4 bits too ("q4-rounded"). A
    draft only proposes tokens, so it need not reproduce its file: the 0.5B Qwen2.5
    draft, mostly 5- and 8-bit blocks, then holds about 200 MiB less, and its forwards
    read fewer bytes (the same acceptance and 1.03x the tokens a second in alternating
    processes, benchmarks/RESULTS.md)."""
    return "q4-rounded" if target_quantization == "q4" else target_quantization


def default_speculation(device: torch.device, workload: str | None, offloaded: bool) -> SpeculativeConfig:
    """The trees of an engine with draft models whose caller gave none: wide dynamic
    trees for an offloaded target (a pass streams the weights whatever it verifies),
    the draft's chain beside the suffix drafter for a single stream on a CPU, the
    draft's adaptive chain of 5 otherwise (a server, where every request would keep a
    suffix tree of its prompt, and GPU engines)."""
    if offloaded:
        return SpeculativeConfig(**OFFLOADED_SPECULATION)
    if device.type == "cpu" and (workload or "stream") == "stream":
        return SpeculativeConfig(**CPU_STREAM_SPECULATION)
    return SpeculativeConfig()


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Resolve ``config`` (device, dtypes, formats) and split it by consumer.

    Raises ``ValueError`` naming the setting this machine cannot honour (CUDA absent,
    q4/q8 off CPU or without ONNX Runtime)."""
    config = with_default_quantization(config)
    device = resolve_device(config.device)
    target_quantization = _quantization(config.quantization)
    draft_quantization = default_draft_quantization(target_quantization) if config.draft_quantization is None \
        else _quantization(config.draft_quantization)
    formats = {target_quantization, draft_quantization}
    for name in formats & {"q4", "q8", "q4-rounded"}:
        if device.type != "cpu":
            raise ValueError(f"quantization {name!r} runs on CPU only (ONNX Runtime's MLAS kernels)")
        if not block_quant_available():
            raise ValueError(f"quantization {name!r} needs onnxruntime and onnx: pip install onnxruntime onnx")
    if "ggml" in formats:
        if device.type != "cpu":
            raise ValueError("quantization 'ggml' runs on CPU only (ggml's CPU kernels)")
        if not ggml_available():
            raise ValueError("quantization 'ggml' needs ggml's library: pip install ggml-python "
                             "(builds ggml for this CPU; scripts/setup.sh does it)")
    target_dtype = resolve_dtype(config.dtype, target_quantization, device)
    offload = _target_offload(config, device, target_dtype, target_quantization)
    target = ModelConfig(
        model=config.model, dtype=target_dtype,
        quantization=target_quantization, device=device, attention_backend=config.attention_backend,
        enforce_eager=config.enforce_eager, load_format=config.load_format, offload_weights_gb=offload,
    )
    speculative = None
    if config.speculation_enabled:
        speculative = config.speculative or default_speculation(device, config.workload, offload is not None)
        if config.draft_settings:
            speculative = dataclasses.replace(speculative, **config.draft_settings)
    draft_dtype = resolve_dtype(config.draft_dtype if config.draft_dtype is not None else config.dtype,
                                draft_quantization, device)
    drafts = tuple(
        dataclasses.replace(target, model=name, dtype=draft_dtype, quantization=draft_quantization,
                            offload_weights_gb=None,  # drafts stay resident
                            head_vocab=speculative.draft_vocab_size if speculative is not None else None)
        for name in config.draft_model or ()
    )
    return ResolvedConfig(
        target=target,
        drafts=drafts,
        speculative=speculative,
        cache=CacheConfig(
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            kv_cache_memory=config.kv_cache_memory, gpu_memory_utilization=config.gpu_memory_utilization,
            num_kv_blocks=config.num_kv_blocks, num_draft_kv_blocks=config.num_draft_kv_blocks,
        ),
        # max_model_len as asked (None: the model's); the engine sets the final one
        # once the model and its cache are loaded.
        scheduler=SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill, max_model_len=None,
            prompt_chunk_multiple=ROW_GROUP if config.quantization == "ggml" else 1,
        ),
        max_model_len=config.max_model_len,
        parallel=ParallelConfig(
            tensor_parallel_size=config.tensor_parallel_size,
            draft_tensor_parallel_size=config.draft_tensor_parallel_size or 1,
            distributed_timeout=config.distributed_timeout,
        ),
        tokenizer=config.tokenizer,
        seed=config.seed,
        max_logprobs=config.max_logprobs,
    )


def _quantization(name: str | None) -> str | None:
    """None for dense weights ("none" and unset alike)."""
    return None if name in (None, "none") else name
