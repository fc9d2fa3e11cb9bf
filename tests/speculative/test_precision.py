"""bf16 and weight-only int8/int4 engines: configuration, and speculation exact
relative to the same engine without it; the draft may use another precision."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.config import EngineConfig
from pagedtree.loading import packaged_models as pm
from pagedtree.loading import resolve as resolve_module
from pagedtree.loading.model_format import block_quant_available
from pagedtree.loading.resolve import resolve_config
from pagedtree.worker.models.linear import Linear
from tests.conftest import assert_no_leaks, assert_speculation_exact, random_prompts

SPEC = {"tree": "static", "expansion": (2, 1, 1), "max_nodes": 6, "adaptive": False}


def test_dtype_and_quantization_resolution(tiny_llama, monkeypatch):
    path = str(tiny_llama.path)

    def resolved(**kwargs):
        return resolve_config(EngineConfig(model=path, device="cpu", **kwargs))

    # "auto" on CPU: bf16 where the CPU has native bf16, fp32 elsewhere; "float32" forces fp32.
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(resolve_module, "cpu_has_native_bf16", lambda native=native: native)
        assert resolved().target.dtype == expected
        assert resolved(draft_model=path).drafts[0].dtype == expected
    assert resolved(dtype="float32").target.dtype == torch.float32
    assert resolved(quantization="int4").target.dtype == torch.bfloat16
    # q4/q8 take fp32 activations: bf16 only where the CPU has it natively.
    monkeypatch.setattr(resolve_module, "cpu_has_native_bf16", lambda: False)
    if block_quant_available():
        assert resolved(quantization="q4").target.dtype == torch.float32
        # A q4 target's draft rounds its wider blocks unless told otherwise; a q8
        # target's keeps q8.
        assert resolved(quantization="q4", draft_model=path).drafts[0].quantization == "q4-rounded"
        assert resolved(quantization="q4", draft_model=path, draft_quantization="q4").drafts[0].quantization == "q4"
        assert resolved(quantization="q8", draft_model=path).drafts[0].quantization == "q8"
    draft = resolved(quantization="int8", draft_model=path).drafts[0]
    assert draft.quantization == "int8" and draft.dtype == torch.bfloat16
    draft = resolved(quantization="int8", draft_model=path, draft_quantization="none", draft_dtype="float32").drafts[0]
    assert draft.quantization is None and draft.dtype == torch.float32
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model=path, quantization="int3")
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(model=path, draft_model=path, draft_dtype="int7")


# The default suite: bf16 (the dense default on CPUs with native bf16), q4 and ggml
# (a GGUF's formats); -m slow every weight format and mixed draft formats.
@pytest.mark.parametrize("target,draft", [
    (dict(dtype="bfloat16"), dict()),
    pytest.param(dict(quantization="int8"), dict(draft_quantization="none", draft_dtype="float32"),
                 marks=pytest.mark.slow),
    pytest.param(dict(quantization="int4"), dict(draft_quantization="int8"), marks=pytest.mark.slow),
    (dict(quantization="q4"), dict()),
    pytest.param(dict(quantization="q8"), dict(draft_quantization="q4"), marks=pytest.mark.slow),
    (dict(quantization="ggml"), dict()),
])
def test_speculation_is_exact_in_every_precision(tiny_llama, tiny_llama_draft, target, draft):
    if target.get("quantization") in ("q4", "q8"):
        pytest.importorskip("onnxruntime")
    if target.get("quantization") == "ggml":
        pytest.importorskip("ggml")
    prompts = random_prompts(6, 256, 2, 30, seed=9)
    llm = LLM(str(tiny_llama.path), device="cpu", block_size=4, draft_model=str(tiny_llama_draft.path),
              speculative=SPEC, **target, **draft)
    want = target.get("quantization")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.quantization == want for m in layers)
    draft_layers = [m for m in llm.engine.speculation.drafts[0].runner.model.modules() if isinstance(m, Linear)]
    # A q4 target's draft rounds its wider blocks to 4 bits: its layers hold q4 blocks.
    draft_format = {"q4-rounded": "q4"}.get(llm.engine.resolved.drafts[0].quantization,
                                            llm.engine.resolved.drafts[0].quantization)
    assert all(m.quantization == draft_format for m in draft_layers)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert_speculation_exact(llm, [{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("target", [
    dict(dtype="bfloat16"),
    dict(quantization="q4"),
    dict(quantization="ggml"),
    pytest.param(dict(quantization="q8"), marks=pytest.mark.slow),
    pytest.param(dict(quantization="int4"), marks=pytest.mark.slow),
], ids=lambda target: target.get("quantization") or target["dtype"])
def test_a_prompt_longer_than_a_step_gives_its_one_step_tokens_in_every_format(tiny_llama, tiny_llama_draft, target):
    """A prompt longer than a step's token budget is prefilled in chunks, and a chunk
    that does not end the prompt asks the LM head for no rows: every weight format
    takes an empty product (ONNX Runtime refuses to bind an empty buffer), and the
    chunked prompt, the target's and the draft's catch-up alike, decodes the tokens it
    decodes in one step, with speculation and without."""
    if target.get("quantization") in ("q4", "q8"):
        pytest.importorskip("onnxruntime")
    if target.get("quantization") == "ggml":
        pytest.importorskip("ggml")
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2, 256, 40, 48, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(budget: int, speculate: bool) -> list[list[int]]:
        llm = LLM(str(tiny_llama.path), device="cpu", block_size=4, max_num_seqs=1, max_num_batched_tokens=budget,
                  draft_model=str(tiny_llama_draft.path), speculative=SPEC, **target)
        llm.engine.set_speculation(speculate)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        assert (llm.stats().get("num_drafts", 0) > 0) == speculate
        assert_no_leaks(llm)
        return [o.outputs[0].token_ids for o in outputs]

    whole = tokens(512, speculate=False)
    assert tokens(16, speculate=False) == whole
    assert tokens(16, speculate=True) == whole


# -m slow: 10 s; the default suite holds the same layers' rows to it
# (tests/worker/test_linear.py, real shapes, 2-130 rows).
@pytest.mark.slow
def test_a_real_model_in_bf16_speculates_exactly_with_trees_of_more_than_32_rows():
    """The packaged SmolLM2 in dense bf16, verifying 40-node trees (41 rows a request,
    164 a step): oneDNN's AMX kernels block such products otherwise than a decode
    step's few rows, and the layers chunk them where it runs AMX (without the chunks,
    6 of 8 prompts left plain decoding within 30 tokens on an Intel Xeon with AMX)."""
    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip("smollm2 not installed")
    if not resolve_module.cpu_has_native_bf16():
        pytest.skip("bf16 is not this CPU's arithmetic (dtype='auto' takes fp32): the tiny models' cases cover it")
    name = pm.SMOLLM2_135M.name
    llm = LLM(name, dtype="bfloat16", quantization="none", device="cpu", max_model_len=128, draft_model=name,
              speculative={"tree": "static", "expansion": (4, 4, 2), "max_nodes": 40, "adaptive": False})
    prompts = ["Write a Python function that merges two sorted lists.", "Explain how a hash map works, briefly.",
               "def quicksort(xs):", "Write a haiku about paged memory."]
    assert_speculation_exact(llm, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
