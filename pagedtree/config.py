"""Settings, plain data validated on construction.

``EngineConfig`` is the flat form users write (the keyword arguments of ``LLM`` and
``AsyncEngine``, the CLI's flags, what tensor-parallel ranks receive as JSON). At
engine start, one resolve step (``loading/resolve.py``) probes the machine and
splits it by consumer, as vLLM does: ``ModelConfig`` per model (target and drafts),
``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig`` and ``SpeculativeConfig``,
held together in ``ResolvedConfig``. Each component takes only its own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedtree.structured_params import GrammarCompileConfig, StructuredOutputLimits


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

DEFAULT_CPU_KV_CACHE_MEMORY = 2 * 1024**3
# The loads an engine can be built for (``EngineConfig.workload``).
WORKLOADS = ("stream", "batch")
QUANTIZATIONS = ("int8", "int4", "q4", "q8", "q4-rounded", "ggml")  # see pagedtree.worker.models.linear
LOAD_FORMATS = ("auto", "dummy")  # read the checkpoint, or random weights (benchmarks)
OFFLOAD_ALL = "all"  # offload_weights_gb: stream every decoder layer from host memory
# A target's resolved offload_weights_gb when it was not given and its GPU cannot hold
# the weights: stream the fewest layers that leave the rest room.
OFFLOAD_AUTO = "auto"
# The speculation an offloaded target runs when the caller gave none:
# SpecInfer's regime, where a pass streams the weights whatever it verifies, so wide,
# deep dynamic trees pay; the adaptive budget still sizes each step from the measured
# (nearly flat) cost curve.
OFFLOADED_SPECULATION = {"tree": "dynamic", "top_k": 8, "depth": 8, "max_nodes": 64, "adaptive": True}
# The speculation a single stream on a CPU runs when the caller gave none
# (``loading.resolve.default_speculation``): the draft model's adaptive chain of 5 beside the model-free suffix
# drafter, whose trees cost no forward: where the request copies (edits, rewrites of
# a long prompt) they are verified alone, up to 12 nodes, and the draft model sits the
# step out, its catch-up of a long prompt never paid. Only suffixes of 3 tokens or
# more propose, and the draft's chain stays whole in a merged tree. Not a server's
# default: every request then keeps a suffix tree of its prompt (about 16 MB and
# 0.14 s of Python for 4,096 tokens).
CPU_STREAM_SPECULATION = {"drafter": "model+suffix", "tree": "chain", "depth": 5, "max_nodes": 12,
                          "adaptive": True, "suffix_min_match": 3}
# ``SpeculativeConfig`` fields that say how the draft models draft, not what trees
# to grow: ``EngineConfig.draft_settings`` takes them over whatever speculation runs.
DRAFT_SETTINGS = ("draft_vocab_size", "draft_min_prob")
# Formats whose kernels take bf16 activations (the others take fp32).
BF16_QUANTIZATIONS = ("int8", "int4")
MAX_TENSOR_PARALLEL = 64

TREE_KINDS = ("static", "chain", "dynamic", "sequoia")
DRAFT_SAMPLING_RULES = ("without_replacement", "iid", "topk")
# Where draft trees come from: draft models, the model-free suffix drafter, or both.
DRAFTERS = ("model", "suffix", "model+suffix")


@dataclass(slots=True)
class SpeculativeConfig:
    """How the draft model(s) propose token trees and how large they may grow.

    ``tree`` picks the shape:

    - ``"static"``: SpecInfer expansion ``expansion = [k1, ..., kd]`` — every node at
      depth ``i-1`` gets its top ``k_i`` draft tokens as children;
    - ``"chain"``: one branch of ``depth`` tokens (classic speculative decoding);
    - ``"dynamic"``: EAGLE-2 style — at each of ``depth`` levels the ``top_k`` frontier
      nodes with the highest cumulative draft probability are expanded into their
      ``top_k`` children, then the best ``max_nodes`` nodes are kept;
    - ``"sequoia"``: the static shape of ``max_nodes`` nodes (at most ``depth`` deep)
      that maximises the expected accepted length for per-rank acceptance rates
      ``acceptance_rates`` (measured online when None).

    Several draft models (``draft_model=[...]`` on ``LLM``) each build a tree of this
    kind and the trees are merged. ``max_nodes`` caps the draft tokens per request and
    step. ``adaptive`` shrinks that budget as the batch grows and turns speculation off
    for a step when the measured draft and target costs say it would not pay.

    ``drafter`` says where trees come from: ``"model"`` (the draft models),
    ``"suffix"`` (the model-free suffix-tree drafter of SuffixDecoding: the most
    frequent continuations of the longest suffix of the request's tokens seen in its
    own tokens or in recent outputs; no draft model needed) or ``"model+suffix"``
    (both trees, merged). The suffix drafter proposes ``suffix_alpha`` nodes per
    matched token (at most ``max_nodes``), matches suffixes of ``suffix_min_match``
    to ``suffix_max_match`` tokens, leaves out continuations rarer than
    ``suffix_min_prob`` and remembers the last ``suffix_global_tokens`` output tokens.

    ``draft_vocab_size`` cuts the draft models' LM heads to that many of the
    tokenizer's most frequent ids plus its special tokens (FR-Spec's frequency-ranked
    draft vocabulary, ``loading/draft_vocab.py``): each draft forward reads fewer head
    weights, the target still scores every token, so outputs are unchanged; only
    tokens outside the set cannot be drafted. None keeps the whole vocabulary.

    ``draft_min_prob`` (llama.cpp's ``--draft-p-min``; 0 = off) ends a branch of the
    draft models' trees below a token the draft proposed with less than this
    probability: the token is still verified, nothing is drafted below it, so an
    unsure draft stops early and costs fewer draft forwards and verify rows.

    ``draft_sampling`` is how children are drawn for requests that sample
    (temperature > 0) in static/chain/sequoia trees: ``"without_replacement"``,
    ``"iid"`` or ``"topk"`` (deterministic); verification uses the matching rule.
    Greedy requests always take the draft's top tokens; dynamic trees always use top-k.
    """

    # Defaults measured on the Qwen2.5-Coder 1.5B/0.5B pair on the 2-core CPU
    # (benchmarks/RESULTS.md): there every draft level costs a full draft forward
    # while extra verify rows are cheap only up to a few, so a 5-token chain beat
    # wider trees (1.55x against 1.31x for a 16-node dynamic tree at batch 1).
    tree: str = "chain"
    expansion: tuple[int, ...] = (2, 2, 1, 1, 1, 1)
    depth: int = 5
    top_k: int = 4
    max_nodes: int = 5
    acceptance_rates: tuple[float, ...] | None = None
    draft_sampling: str = "without_replacement"
    adaptive: bool = True
    drafter: str = "model"
    suffix_max_match: int = 8
    suffix_min_match: int = 1
    suffix_alpha: float = 2.0
    suffix_min_prob: float = 0.1
    suffix_global_tokens: int = 16384
    draft_vocab_size: int | None = None
    draft_min_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and (
                not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool)
                or not 1 <= self.draft_vocab_size <= 1 << 22):
            raise ValueError(f"draft_vocab_size must be None or an integer in [1, 2**22], "
                             f"got {self.draft_vocab_size!r}")
        if self.tree not in TREE_KINDS:
            raise ValueError(f"speculative tree must be one of {TREE_KINDS}, got {self.tree!r}")
        if self.draft_sampling not in DRAFT_SAMPLING_RULES:
            raise ValueError(
                f"draft_sampling must be one of {DRAFT_SAMPLING_RULES}, got {self.draft_sampling!r}"
            )
        if self.drafter not in DRAFTERS:
            raise ValueError(f"speculative drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if not isinstance(self.suffix_max_match, int) or not 1 <= self.suffix_max_match <= 32:
            raise ValueError(f"suffix_max_match must be an integer in [1, 32], got {self.suffix_max_match!r}")
        if not isinstance(self.suffix_min_match, int) or isinstance(self.suffix_min_match, bool) \
                or not 1 <= self.suffix_min_match <= self.suffix_max_match:
            raise ValueError(f"suffix_min_match must be an integer in [1, suffix_max_match "
                             f"({self.suffix_max_match})], got {self.suffix_min_match!r}")
        if not isinstance(self.suffix_global_tokens, int) or not 0 <= self.suffix_global_tokens <= 1 << 20:
            raise ValueError(f"suffix_global_tokens must be an integer in [0, 2**20], got {self.suffix_global_tokens!r}")
        if not isinstance(self.suffix_alpha, (int, float)) or not 0 < self.suffix_alpha <= 64:
            raise ValueError(f"suffix_alpha must be in (0, 64], got {self.suffix_alpha!r}")
        if not isinstance(self.suffix_min_prob, (int, float)) or not 0 <= self.suffix_min_prob <= 1:
            raise ValueError(f"suffix_min_prob must be in [0, 1], got {self.suffix_min_prob!r}")
        if isinstance(self.draft_min_prob, bool) or not isinstance(self.draft_min_prob, (int, float)) \
                or not 0 <= self.draft_min_prob < 1:
            raise ValueError(f"draft_min_prob must be in [0, 1), got {self.draft_min_prob!r}")
        self.expansion = tuple(self.expansion)
        if not self.expansion or any(not isinstance(k, int) or k < 1 for k in self.expansion):
            raise ValueError(f"expansion must be a non-empty list of positive integers, got {self.expansion}")
        for name in ("depth", "top_k", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.max_nodes > 256:
            raise ValueError(f"max_nodes must be <= 256 (one verify pass per tree), got {self.max_nodes}")
        if self.acceptance_rates is not None:
            self.acceptance_rates = tuple(float(a) for a in self.acceptance_rates)
            if not self.acceptance_rates or any(not 0.0 <= a <= 1.0 for a in self.acceptance_rates):
                raise ValueError(f"acceptance_rates must be probabilities, got {self.acceptance_rates}")



def _as_config(value: Any, cls: type, name: str) -> Any:
    """``value`` as a ``cls``: itself, one built from a dict, or None; ``ValueError``
    naming ``name`` for anything else (or for a dict with unknown fields)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return cls(**value)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from exc
    raise ValueError(f"{name} must be a {cls.__name__} or a dict, got {type(value).__name__}")


@dataclass(slots=True)
class EngineConfig:
    """How to load the model and size the cache and the batch (the flat form; see the
    module docstring).

    ``model`` is a packaged model name, a Hugging Face folder, a ``.gguf`` file or a
    hub id; None means the embedded default. ``kv_cache_memory`` (bytes) sizes the
    KV cache on CPU, ``gpu_memory_utilization`` (a fraction of the device's memory)
    on CUDA; ``num_kv_blocks`` overrides both (tests use it to force preemption).

    Tree speculation is on when ``draft_model`` names one draft model or a list of
    them (their trees are merged), or when ``speculative`` picks the suffix drafter; ``speculative`` (a ``SpeculativeConfig`` or a dict
    of its fields) shapes the trees, and None leaves them to the engine: a single stream
    on a CPU runs ``CPU_STREAM_SPECULATION``, an offloaded target
    ``OFFLOADED_SPECULATION``, anything else ``SpeculativeConfig()``. Each draft keeps its own KV cache with as many
    blocks as the target's plus room for every request's tree branches
    (``num_draft_kv_blocks`` overrides it); on CUDA a cache sized from
    ``gpu_memory_utilization`` leaves room for the drafts' weights, caches and graphs.
    ``draft_settings`` (a dict of ``DRAFT_SETTINGS`` fields: ``draft_vocab_size``,
    ``draft_min_prob``) applies over the trees, given or the engine's own, when the
    config is resolved, so that a cut draft head keeps the default trees.

    ``max_logprobs`` caps ``SamplingParams.logprobs`` (vLLM's default, 20).
    ``structured_output_limits`` bounds what a request's ``structured_outputs`` may
    ask (size, schema nesting, choices, compile time; a dict of its fields works too);
    ``grammar_compile`` how compiles are served (workers, queue bounds, each worker's
    memory: ``GrammarCompileConfig``, a dict works too). A constrained request without
    ``max_tokens`` stops after ``max_constrained_tokens`` (None: at the context's
    end), so that a constraint that lets a model go on forever (whitespace inside
    JSON, an unbounded array) cannot hold a sequence to the context limit.

    ``enforce_eager=True`` runs every op eagerly in torch; by default fp32/bf16
    models on CPU fuse each layer's residual adds, RMSNorms and rotary embedding into
    numba kernels (``worker/models/cpu_fused.py``), and on CUDA with the Triton
    backend decode and verify steps are padded to a few shapes and replayed as
    CUDA graphs (``worker/cuda_graphs.py``), as vLLM's flag switches off its graphs.

    ``tensor_parallel_size`` > 1 splits the target over that many ranks (processes)
    Megatron-style on torch.distributed (gloo on CPU, NCCL on CUDA): ranks 1..N-1
    are spawned here, or join from other machines through ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` (``pagedtree worker``, or torchrun).
    The drafts stay whole on rank 0 unless ``draft_tensor_parallel_size`` equals
    ``tensor_parallel_size``. A collective that waits longer than
    ``distributed_timeout`` seconds (a rank hung) or a rank that dies stops the
    engine with ``TensorParallelError``.

    ``quantization`` stores linear weights quantized: "int8" or "int4" weight-only
    (torch's CPU kernels, bf16 activations; ``dtype="auto"`` is then bf16), "q4" or
    "q8" in blocks of 32 with int8 activations (ONNX Runtime's MLAS kernels, fp32
    activations; ``dtype="auto"`` is then fp32 on CPUs without native bf16), "ggml"
    the GGUF's own blocks through ggml's kernels (each step one ggml graph), "none"
    dense. Unset, a GGUF model on a CPU with ``dtype="auto"`` runs one stream in
    "ggml" (q4 where ggml is not installed) and a server's batches dense or in q4,
    and anything else dense (``loading/model_format.py``).
    "q4-rounded" is q4 with the file's 5- to 8-bit blocks rounded to 4 bits as well. The
    draft models take the target's dtype and quantization (beside a "q4" target:
    "q4-rounded", since a draft need not reproduce its file) unless ``draft_dtype`` /
    ``draft_quantization`` say otherwise (``draft_quantization="none"``: dense drafts;
    ``"ggml"`` for a GGUF draft holds 0.7 GB less beside a q4 target, but its
    multi-row catch-ups cost about three times q4's, so the budget drafts less).

    ``async_scheduling`` launches each plain decode step before the previous one is
    read back, so the host's work between steps overlaps the GPU's
    (``engine/async_steps.py``; the same tokens); None (the default) turns it on for
    CUDA engines on one process, where the host would otherwise leave the GPU idle
    between steps.

    ``workload`` is the load the engine is built for, where it picks the weights'
    format (a GGUF model on CPU with ``quantization`` unset): "stream" (one request or a
    few at a time: the GGUF's 4-bit blocks, whose steps read the fewest bytes) or
    "batch" (many concurrent requests: dense weights where this CPU runs a batch's
    products in them clearly faster than in 4-bit blocks and the memory is there,
    ``loading/batch_format.py``). None takes the entry point's: "stream" for ``LLM``,
    "batch" for ``AsyncEngine`` and ``pagedtree serve``.

    ``load_format="dummy"`` (vLLM's option of that name) fills every weight with
    random values instead of reading them: a folder with only a ``config.json``
    then loads, for benchmarks of real shapes where the weights cannot travel;
    "auto" reads the checkpoint.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_logprobs: int = 20
    quantization: str | None = None
    draft_model: str | list[str] | None = None
    draft_dtype: str | torch.dtype | None = None
    draft_quantization: str | None = None
    speculative: SpeculativeConfig | None = None
    draft_settings: dict[str, Any] | None = None
    num_draft_kv_blocks: int | None = None
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None
    distributed_timeout: float = 60.0
    structured_output_limits: StructuredOutputLimits | None = None
    grammar_compile: GrammarCompileConfig | None = None
    max_constrained_tokens: int | None = 2048
    load_format: str = "auto"
    async_scheduling: bool | None = None
    offload_weights_gb: float | str | None = None
    workload: str | None = None

    def __post_init__(self) -> None:
        self.offload_weights_gb = validate_offload(self.offload_weights_gb)
        if self.workload not in WORKLOADS + (None,):
            raise ValueError(f"workload must be None or one of {WORKLOADS}, got {self.workload!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_constrained_tokens is not None and (not isinstance(self.max_constrained_tokens, int)
                                                        or isinstance(self.max_constrained_tokens, bool)
                                                        or self.max_constrained_tokens < 1):
            raise ValueError(f"max_constrained_tokens must be None or an integer >= 1, got "
                             f"{self.max_constrained_tokens!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be None, True or False, got {self.async_scheduling!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs one process: a tensor-parallel step sends its input tokens "
                             "from the host")
        self.grammar_compile = _as_config(self.grammar_compile, GrammarCompileConfig, "grammar_compile")
        limits = _as_config(self.structured_output_limits, StructuredOutputLimits, "structured_output_limits")
        self.structured_output_limits = limits if limits is not None else StructuredOutputLimits()
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        for name in ("quantization", "draft_quantization"):
            value = getattr(self, name)
            allowed = QUANTIZATIONS + ("none",)
            if value is not None and value not in allowed:
                raise ValueError(f"{name} must be None or one of {allowed}, got {value!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if isinstance(self.draft_model, str):
            self.draft_model = [self.draft_model]
        elif self.draft_model is not None:
            if isinstance(self.draft_model, Mapping) or not isinstance(self.draft_model, Sequence):
                raise ValueError("draft_model must be a model name/path or a list of them")
            self.draft_model = list(self.draft_model)
            if not self.draft_model or not all(isinstance(d, str) for d in self.draft_model):
                raise ValueError("draft_model must be a model name/path or a non-empty list of them")
        self.speculative = _as_config(self.speculative, SpeculativeConfig, "speculative")
        if self.draft_settings is not None:
            if not isinstance(self.draft_settings, Mapping) or not set(self.draft_settings) <= set(DRAFT_SETTINGS):
                raise ValueError(f"draft_settings must be a dict of {DRAFT_SETTINGS}, got {self.draft_settings!r}")
            if self.draft_model is None:
                raise ValueError(f"draft_settings ({', '.join(self.draft_settings)}) are set but no draft_model "
                                 "was given")
            self.draft_settings = dict(self.draft_settings)
            _as_config(self.draft_settings, SpeculativeConfig, "draft_settings")  # the values' checks
        if self.speculative is not None and self.draft_model is None and self.speculative.drafter != "suffix":
            raise ValueError("speculative is set but no draft_model was given "
                             "(drafter='suffix' speculates without one)")
        if self.speculative is not None and self.draft_model is not None and self.speculative.drafter == "suffix":
            raise ValueError("drafter='suffix' uses no draft model; pass drafter='model+suffix' to use both")
        if self.num_draft_kv_blocks is not None and self.num_draft_kv_blocks < 1:
            raise ValueError(f"num_draft_kv_blocks must be >= 1, got {self.num_draft_kv_blocks}")
        if (not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool)
                or not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL):
            raise ValueError(
                f"tensor_parallel_size must be an integer in [1, {MAX_TENSOR_PARALLEL}], got {self.tensor_parallel_size!r}"
            )
        if self.draft_tensor_parallel_size is None:
            self.draft_tensor_parallel_size = 1
        if self.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(
                "draft_tensor_parallel_size must be 1 (drafts whole on rank 0) or tensor_parallel_size "
                f"({self.tensor_parallel_size}), got {self.draft_tensor_parallel_size!r}"
            )
        if not isinstance(self.distributed_timeout, (int, float)) or not 1 <= self.distributed_timeout <= 86400:
            raise ValueError(f"distributed_timeout must be in [1, 86400] seconds, got {self.distributed_timeout!r}")
        check_device_name(self.device)
        for name in ("dtype", "draft_dtype"):
            value = getattr(self, name)
            if not (value is None and name == "draft_dtype") and not isinstance(value, torch.dtype) \
                    and value != "auto" and value not in DTYPES:
                raise ValueError(f"{name} must be 'auto' or one of {sorted(DTYPES)}, got {value!r}")

    def to_json(self) -> str:
        """This config as JSON (how rank 0 hands it to the other tensor-parallel ranks)."""
        fields = asdict(self)
        for name in ("dtype", "draft_dtype"):
            if isinstance(fields[name], torch.dtype):
                fields[name] = str(fields[name]).removeprefix("torch.")
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """The config ``to_json`` wrote."""
        return cls(**json.loads(text))

    @property
    def speculation_enabled(self) -> bool:
        """Whether the engine speculates (a draft model, or the suffix drafter)."""
        return bool(self.draft_model) or (self.speculative is not None and self.speculative.drafter != "model")


def check_device_name(device: str) -> None:
    """``ValueError`` unless ``device`` is "auto", "cpu", "cuda" or "cuda:N" (whether
    such a device is present is the resolve step's question)."""
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device") from exc
    if parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")


def validate_offload(value: object) -> float | str | None:
    """``offload_weights_gb`` checked: None, ``"all"`` or GiB in [0, 2**20]."""
    if value is None or value == OFFLOAD_ALL:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1 << 20:
        raise ValueError(f"offload_weights_gb must be None, 'all' or a number of GiB in [0, 2**20], got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model as a runner loads it (the target, or a draft), resolved: its source,
    activation dtype, weight format (None: dense), device and attention backend;
    ``head_vocab`` cuts a draft's LM head; ``enforce_eager`` switches off fused CPU
    kernels and CUDA graphs; ``load_format`` "dummy" fills the weights at random;
    ``offload_weights_gb`` (a target that streams layers from host memory, resolved:
    None means resident) as ``EngineConfig``'s."""

    model: str | None
    dtype: torch.dtype
    quantization: str | None
    device: torch.device
    attention_backend: str = "auto"
    enforce_eager: bool = False
    head_vocab: int | None = None
    load_format: str = "auto"
    offload_weights_gb: float | str | None = None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the KV caches are sized and shared: block size, the memory budget (CPU
    bytes, or a fraction of the GPU), fixed block counts, prefix caching."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    num_draft_kv_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step. ``max_model_len`` None: the model's own (set once loaded)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = 4096
    # A prompt chunk that stops mid-prompt ends at a multiple of this many positions
    # (set where the target's products group a chunk's rows: see ``Scheduler``).
    prompt_chunk_multiple: int = 1

    def __post_init__(self) -> None:
        if self.prompt_chunk_multiple < 1:
            raise ValueError(f"prompt_chunk_multiple must be >= 1, got {self.prompt_chunk_multiple}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: ranks of the target, of the drafts (1 or the same), and how
    long a collective may wait before the group is declared broken."""

    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    distributed_timeout: float = 60.0


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """An ``EngineConfig`` after the engine's one resolve step (``loading/resolve.py``),
    split by consumer: each component takes its own part."""

    target: ModelConfig
    drafts: tuple[ModelConfig, ...]
    speculative: SpeculativeConfig | None  # None: no speculation
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    max_model_len: int | None = None  # as asked; None: the model's positions
    tokenizer: str | None = None
    seed: int = 0
    max_logprobs: int = 20

    @property
    def max_tree_nodes(self) -> int:
        """Tree nodes a request may verify per step (0 without speculation)."""
        return self.speculative.max_nodes if self.speculative is not None else 0
