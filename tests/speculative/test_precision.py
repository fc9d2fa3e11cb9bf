"""bf16 and weight-only int8/int4 engines: configuration, and speculation exact
relative to the same engine without it; the draft may use another precision."""

from __future__ import annotations

import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree import config as config_module
from pagedtree.config import EngineConfig
from pagedtree.worker.models.linear import Linear
from tests.conftest import assert_no_leaks, random_prompts

SPEC = {"tree": "static", "expansion": (2, 1, 1), "max_nodes": 6, "adaptive": False}


def test_dtype_and_quantization_resolution(tiny_llama, monkeypatch):
    path = str(tiny_llama.path)
    # "auto" on CPU: bf16 where the CPU has native bf16, fp32 elsewhere; "float32" forces fp32.
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda native=native: native)
        assert EngineConfig(model=path, device="cpu").resolve_dtype() == expected
        assert EngineConfig(model=path, device="cpu", draft_model=path).resolve_draft_dtype() == expected
    assert EngineConfig(model=path, device="cpu", dtype="float32").resolve_dtype() == torch.float32
    assert EngineConfig(model=path, device="cpu", quantization="int4").resolve_dtype() == torch.bfloat16
    # q4/q8 take fp32 activations: bf16 only where the CPU has it natively.
    monkeypatch.setattr(config_module, "cpu_has_native_bf16", lambda: False)
    assert EngineConfig(model=path, device="cpu", quantization="q4").resolve_dtype() == torch.float32
    cfg = EngineConfig(model=path, device="cpu", quantization="int8", draft_model=path)
    assert cfg.resolve_draft_quantization() == "int8" and cfg.resolve_draft_dtype() == torch.bfloat16
    cfg = EngineConfig(model=path, device="cpu", quantization="int8", draft_model=path,
                       draft_quantization="none", draft_dtype="float32")
    assert cfg.resolve_draft_quantization() is None and cfg.resolve_draft_dtype() == torch.float32
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(model=path, quantization="int3")
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(model=path, draft_model=path, draft_dtype="int7")


@pytest.mark.parametrize("target,draft", [
    (dict(dtype="bfloat16"), dict()),
    (dict(quantization="int8"), dict(draft_quantization="none", draft_dtype="float32")),
    (dict(quantization="int4"), dict(draft_quantization="int8")),
    (dict(quantization="q4"), dict()),
    (dict(quantization="q8"), dict(draft_quantization="q4")),
])
def test_speculation_is_exact_in_every_precision(tiny_llama, tiny_llama_draft, target, draft):
    if "q" in str(target.get("quantization")):
        pytest.importorskip("onnxruntime")
    prompts = random_prompts(6, 256, 2, 30, seed=9)
    llm = LLM(str(tiny_llama.path), device="cpu", block_size=4, draft_model=str(tiny_llama_draft.path),
              speculative=SPEC, **target, **draft)
    want = target.get("quantization")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.quantization == want for m in layers)
    draft_layers = [m for m in llm.engine.speculator.drafts[0].runner.model.modules() if isinstance(m, Linear)]
    assert all(m.quantization == llm.engine.config.resolve_draft_quantization() for m in draft_layers)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    spec = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert llm.stats()["num_accepted_tokens"] > 0
    llm.engine.set_speculation(False)
    plain = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert spec == plain
    assert_no_leaks(llm)
