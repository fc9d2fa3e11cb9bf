"""The benchmarks' engine adapters: load pagedtree, transformers, vLLM or llama.cpp and
run one batch of token-id prompts. ``engine_runner.py`` (and through it
``compare.py``), ``throughput.py``, ``spec_decode.py`` and ``spec_ab.py`` load and run
their engines through this module.

A loader takes ``EngineOptions``, the largest batch and the longest sequence (prompt +
output) the run needs, and returns ``(RunInfo, RunBatch)``. ``run(prompts,
temperature, output_len)`` submits the prompts together (B prompts: B sequences
decode side by side), makes every request produce exactly ``output_len`` tokens (EOS
ignored), and returns the output tokens and, for a speculating engine, its
speculation counters over that call (None otherwise). It does not time itself:
``time_batches`` does, around the calls only. An engine that cannot run a batch
raises ``NotImplementedError`` saying why (transformers' assisted generation and
llama.cpp run batch 1 only).

At the top level this module needs only the standard library: vLLM runs it in its
own environment without importing pagedtree, llama.cpp in one without torch. Each
loader imports its engine (and torch, transformers where that engine uses them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable

Counters = dict[str, Any]
RunBatch = Callable[[list[list[int]], float, int], tuple[int, Counters | None]]


@dataclass
class EngineOptions:
    """How to load an engine (each engine reads the fields that apply to it)."""

    model: str  # Hugging Face folder or packaged name (llamacpp: a .gguf file)
    label: str = ""
    draft_model: list[str] | None = None  # speculation on with these drafts
    # Speculation options, speculation on when not None: pagedtree SpeculativeConfig
    # fields (or a SpeculativeConfig); vLLM: method ("ngram"), num_speculative_tokens,
    # prompt_lookup_min/max; llamacpp: prompt_lookup_tokens, prompt_lookup_ngram.
    spec: Any = None
    dtype: str = "auto"  # transformers and vLLM: "auto" is float32
    seed: int = 0
    quantization: str | None = None  # pagedtree
    prefix_caching: bool = False  # pagedtree and vLLM
    enforce_eager: bool = False  # pagedtree
    keep_suffix_cache: bool = False  # pagedtree: see clear_suffix_cache
    threads: int | None = None  # llamacpp (None: every core)
    engine_workload: str | None = None  # pagedtree's EngineConfig.workload (None: LLM's, "stream")


@dataclass
class RunInfo:
    """What ran: the engine, its versions and the load time."""

    engine: str
    label: str
    versions: dict[str, str] = field(default_factory=dict)
    load_seconds: float = 0.0
    threads: int = 0
    peak_rss_mib: float = 0.0  # the most resident memory of this process and its children, sampled


def time_batches(run: RunBatch, batches: Iterable[list[list[int]]], temperature: float,
                 output_len: int) -> tuple[int, float, Counters | None]:
    """Run the batches one after another; returns the output tokens, the seconds spent
    inside ``run`` and the speculation counters summed over the calls."""
    tokens, seconds, totals = 0, 0.0, None
    for prompts in batches:
        started = time.perf_counter()
        n, counters = run(prompts, temperature, output_len)
        seconds += time.perf_counter() - started
        tokens += n
        totals = add_counters(totals, counters)
    return tokens, seconds, totals


def add_counters(total: Counters | None, new: Counters | None) -> Counters | None:
    """Sum speculation counters over calls (lists element-wise; None values skipped)."""
    if new is None:
        return total
    if total is None:
        return dict(new)
    out = dict(total)
    for key, value in new.items():
        if value is None:
            continue
        if isinstance(value, list):
            old = list(out.get(key) or [])
            old += [0] * (len(value) - len(old))
            out[key] = [a + b for a, b in zip(old, value + [0] * (len(old) - len(value)))]
        else:
            out[key] = (out.get(key) or 0) + value
    return out


# --------------------------------------------------------------------------------------
# pagedtree
# --------------------------------------------------------------------------------------


def clear_suffix_cache(llm) -> None:
    """Forget what the suffix drafter learnt from earlier requests' outputs (its global
    tree). Benchmarks repeat the same prompts: a tree that remembered the last timing's
    outputs would predict this one's whole output."""
    proposer = getattr(llm.engine.speculation, "proposer", None)  # plain decoding has none
    if proposer is not None and proposer.suffix is not None:
        proposer.suffix.clear_global()


class PagedtreeBatch:
    """``RunBatch`` over a pagedtree ``LLM``. The ``LLM`` stays reachable as ``llm`` for
    scripts that switch speculation between timings (``spec_decode.py``, ``spec_ab.py``)."""

    COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_forward_passes")

    def __init__(self, llm, seed: int, speculating: bool, clear_suffix: bool = True):
        from pagedtree import SamplingParams

        self.llm, self.seed, self.speculating, self.clear_suffix = llm, seed, speculating, clear_suffix
        self._params = SamplingParams

    def __call__(self, prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        llm = self.llm
        params = self._params(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=self.seed)
        if self.clear_suffix:
            clear_suffix_cache(llm)
        before = llm.stats()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if not self.speculating:
            return tokens, None
        counters: Counters = {k: int(after[k] - before[k]) for k in self.COUNTERS}
        per_pos_after = list(after["accepted_tokens_per_position"])
        per_pos_before = list(before["accepted_tokens_per_position"])
        per_pos_before += [0] * (len(per_pos_after) - len(per_pos_before))
        counters["accepted_per_position"] = [int(a - b) for a, b in zip(per_pos_after, per_pos_before)]
        return tokens, counters


def load_pagedtree(options: EngineOptions, max_batch: int | None, max_len: int) -> tuple[RunInfo, PagedtreeBatch]:
    """pagedtree's offline ``LLM``, plain or with tree speculation. ``max_batch`` is its
    ``max_num_seqs`` (None: the engine's default)."""
    import pagedtree
    from pagedtree import LLM

    kwargs: dict[str, Any] = dict(dtype=options.dtype, max_model_len=max_len, seed=options.seed,
                                  enable_prefix_caching=options.prefix_caching, quantization=options.quantization,
                                  enforce_eager=options.enforce_eager, workload=options.engine_workload)
    if max_batch is not None:
        kwargs["max_num_seqs"] = max_batch
    speculating = bool(options.draft_model) or options.spec is not None
    if options.draft_model:
        kwargs["draft_model"] = options.draft_model
    if speculating:
        kwargs["speculative"] = options.spec or None  # none given: the engine's default
    started = time.perf_counter()
    llm = LLM(options.model, **kwargs)
    load_seconds = time.perf_counter() - started
    run = PagedtreeBatch(llm, options.seed, speculating, clear_suffix=not options.keep_suffix_cache)
    return RunInfo("pagedtree", options.label, {"pagedtree": pagedtree.__version__}, load_seconds), run


# --------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------


def load_transformers(options: EngineOptions, max_batch: int | None, max_len: int) -> tuple[RunInfo, RunBatch]:
    """transformers ``generate`` (left-padded batches), or assisted generation with a
    draft (batch 1 only). Greedy at temperature 0, otherwise the plain temperature
    distribution (top-k and top-p off)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if options.dtype in ("auto", "float32") else getattr(torch, options.dtype)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=dtype).eval()
    assistant = None
    if options.draft_model:
        assistant = AutoModelForCausalLM.from_pretrained(options.draft_model[0], dtype=dtype).eval()
    load_seconds = time.perf_counter() - started
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0
    if isinstance(pad, list):
        pad = pad[0]

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        if assistant is not None and len(prompts) > 1:
            raise NotImplementedError("transformers' assisted generation runs at batch 1 only")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            # top_k=0 and top_p=1 switch off the generation config's defaults so the
            # distribution is the plain temperature one, as in the other engines.
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        extra = {"assistant_model": assistant} if assistant is not None else {}
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=pad, **sampling, **extra)
        return (out.shape[1] - width) * len(prompts), None

    info = RunInfo("transformers", options.label, {"transformers": transformers.__version__}, load_seconds)
    return info, run


def load_vllm(options: EngineOptions, max_batch: int | None, max_len: int) -> tuple[RunInfo, RunBatch]:
    """vLLM's offline ``LLM`` in this process, plain or with draft-model or n-gram
    speculation. Raises ImportError where vLLM is not installed."""
    import vllm
    from vllm import LLM, SamplingParams

    dtype = "float32" if options.dtype == "auto" else options.dtype
    kwargs: dict[str, Any] = dict(model=options.model, dtype=dtype, max_model_len=max_len, seed=options.seed,
                                  disable_log_stats=False, enable_prefix_caching=options.prefix_caching)
    if max_batch is not None:
        kwargs["max_num_seqs"] = max_batch
    spec = options.spec or {}
    speculating = bool(options.draft_model) or spec.get("method") == "ngram"
    if spec.get("method") == "ngram":
        # Model-free prompt lookup: the last n tokens (n from max down to min) are looked
        # up earlier in the request and what followed them is proposed.
        kwargs["speculative_config"] = {"method": "ngram",
                                        "num_speculative_tokens": int(spec.get("num_speculative_tokens", 4)),
                                        "prompt_lookup_min": int(spec.get("prompt_lookup_min", 2)),
                                        "prompt_lookup_max": int(spec.get("prompt_lookup_max", 4))}
    elif options.draft_model:
        kwargs["speculative_config"] = {"method": "draft_model", "model": options.draft_model[0],
                                        "num_speculative_tokens": int(spec.get("num_speculative_tokens", 4))}
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load_seconds = time.perf_counter() - started

    def counters() -> Counters:
        found: Counters = {}
        for metric in llm.get_metrics():
            name = metric.name.removeprefix("vllm:")
            if name == "spec_decode_num_accepted_tokens_per_pos":
                found["accepted_per_position"] = [int(v) for v in metric.values]
            elif name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                found[name.removeprefix("spec_decode_")] = int(metric.value)
        return found

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=options.seed)
        before = counters() if speculating else {}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if not speculating:
            return tokens, None
        after = counters()
        delta: Counters = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        pos_after = after.get("accepted_per_position", [])
        pos_before = before.get("accepted_per_position", []) + [0] * len(pos_after)
        delta["accepted_per_position"] = [a - b for a, b in zip(pos_after, pos_before)]
        # vLLM scores the draft and the bonus token in one target pass per step.
        delta["num_target_forward_passes"] = None
        return tokens, delta

    info = RunInfo("vllm", options.label, {"vllm": vllm.__version__}, load_seconds)
    return info, run


def load_llamacpp(options: EngineOptions, max_batch: int | None, max_len: int) -> tuple[RunInfo, RunBatch]:
    """llama.cpp through llama-cpp-python, one sequence at a time, on the GGUF file itself.

    ``options.model`` is the .gguf file; the weights stay in its own quantization
    (Q4_K_M, ...), so the dtype does not apply. Each request starts from an empty KV
    cache (no prefix reuse between prompts, like the other engines without prefix
    caching) and produces exactly ``output_len`` tokens: the token loop is driven here
    and stopped by count, so EOS never ends it. Greedy at temperature 0, otherwise the
    plain temperature distribution (top-k, top-p, min-p all off).
    """
    import llama_cpp

    if options.draft_model:
        raise SystemExit("the llamacpp engine drafts from the prompt only (--spec '{\"prompt_lookup_tokens\": N}'), "
                         "not with a --draft-model")
    spec = options.spec or {}
    unknown = set(spec) - {"prompt_lookup_tokens", "prompt_lookup_ngram"}
    if unknown:
        raise SystemExit(f"llamacpp --spec takes prompt_lookup_tokens and prompt_lookup_ngram, not {sorted(unknown)}")
    draft = None
    if spec:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        # llama-cpp-python's own speculation: n-grams of the context looked up in the
        # context (prompt-lookup decoding), verified by the target in one batch.
        draft = LlamaPromptLookupDecoding(max_ngram_size=int(spec.get("prompt_lookup_ngram", 2)),
                                          num_pred_tokens=int(spec.get("prompt_lookup_tokens", 10)))
    threads = options.threads or os.cpu_count() or 1
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=options.model, n_ctx=max_len, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, seed=options.seed, verbose=False, draft_model=draft)
    load_seconds = time.perf_counter() - started

    def run(prompts: list[list[int]], temperature: float, output_len: int) -> tuple[int, Counters | None]:
        if len(prompts) > 1:
            raise NotImplementedError("llama-cpp-python decodes one sequence at a time: batch 1 only")
        if temperature > 0:
            sampling = dict(temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0)
        else:
            sampling = dict(temp=0.0, top_k=1)
        llm.reset()  # a fresh KV cache for every request
        tokens = 0
        # generate() evaluates the prompt, then samples a token and evaluates it on the
        # next step; it never checks EOS itself (create_completion does), so stopping
        # by count gives exactly output_len tokens, and the last one is not evaluated.
        stream = llm.generate(prompts[0], repeat_penalty=1.0, reset=True, **sampling)
        try:
            for _ in stream:
                tokens += 1
                if tokens >= output_len:
                    break
        finally:
            stream.close()
        if tokens != output_len:
            raise RuntimeError(f"llama.cpp produced {tokens} tokens, expected {output_len}")
        return tokens, None

    info = RunInfo("llamacpp", options.label, {"llama-cpp-python": llama_cpp.__version__}, load_seconds, threads)
    return info, run


LOADERS: dict[str, Callable[[EngineOptions, int | None, int], tuple[RunInfo, RunBatch]]] = {
    "pagedtree": load_pagedtree, "transformers": load_transformers, "vllm": load_vllm, "llamacpp": load_llamacpp}


if __name__ == "__main__":  # a module, not a script; --help says what it holds
    import argparse

    argparse.ArgumentParser(prog="benchmarks/engines.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
