"""Shutting an engine down lets go of its device memory, even while the engine is
still referenced (``llm = LLM(...)`` rebinds ``llm`` only after the new engine has
sized its KV cache from the memory that is free then)."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.engine.errors import EngineStoppedError


@pytest.mark.triton_interpreter
def test_shutdown_drops_the_models_caches_and_graphs_of_target_and_drafts(tiny_llama):
    """The target's and the draft's runner: model, KV cache, attention backend and
    step graphs (the Triton backend's padded steps, as on CUDA; not captured on CPU)."""
    llm = LLM(str(tiny_llama.path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
              attention_backend="triton", draft_model=str(tiny_llama.path),
              speculative={"tree": "static", "expansion": [2, 1], "max_nodes": 4, "adaptive": False})
    engine = llm.engine
    runners = [engine.runner] + [draft.runner for draft in engine.speculation.drafts]
    for runner in runners:
        runner.enable_cuda_graphs(2, engine.max_model_len, 5, capture=False)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    held = [weakref.ref(obj) for runner in runners
            for obj in (runner.model, runner.kv_caches[0][0], runner.attention, runner.graphs)]
    llm.shutdown()
    gc.collect()
    assert [ref() for ref in held] == [None] * len(held)
    assert llm.stats()["num_forward_passes"] > 0  # the counters stay
    with pytest.raises(EngineStoppedError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()  # idempotent
