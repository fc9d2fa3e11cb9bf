"""The format a model runs in when the caller does not say (GGUF: its own blocks)."""

import asyncio

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.config import EngineConfig
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.model_format import block_quant_available
from pagedtree.loading.resolve import resolve_config, with_default_quantization


def default_quantization(config: EngineConfig) -> str:
    """The format the one resolve step gives ``config``'s target."""
    return with_default_quantization(config).quantization

needs_gguf = pytest.mark.skipif(not pm.is_installed(pm.SMOLLM2_135M), reason="smollm2 not installed")


@needs_gguf
def test_a_gguf_runs_in_its_own_blocks_unless_told_otherwise():
    from pagedtree.worker.models.ggml_matmul import ggml_available

    name = pm.SMOLLM2_135M.name
    expected = "ggml" if ggml_available() else "q4" if block_quant_available() else "none"
    assert default_quantization(EngineConfig(model=name, device="cpu")) == expected
    assert default_quantization(EngineConfig(model=str(pm.gguf_path(pm.SMOLLM2_135M)), device="cpu")) == expected
    # an explicit dtype, "none", another format or several ranks: as asked
    assert default_quantization(EngineConfig(model=name, device="cpu", dtype="float32")) == "none"
    assert default_quantization(EngineConfig(model=name, device="cpu", quantization="none")) == "none"
    assert default_quantization(EngineConfig(model=name, device="cpu", quantization="int4")) == "int4"
    assert default_quantization(EngineConfig(model=name, device="cpu", tensor_parallel_size=2)) == "none"


@needs_gguf
def test_a_stream_runs_a_gguf_in_ggml_and_in_q4_without_it(monkeypatch):
    """One stream: ggml where it is installed, whatever the memory (it holds about the
    file's size); without ggml, q4 (a load short of memory says what it needs), dense
    without ONNX Runtime either."""
    from pagedtree.loading import model_format
    from pagedtree.worker.models import ggml_matmul

    name = pm.SMOLLM2_135M.name
    size = pm.gguf_path(pm.SMOLLM2_135M).stat().st_size
    plenty = int(model_format.Q4_BYTES_PER_FILE_BYTE * size) + 1
    for memory in (plenty, 2 * size):
        monkeypatch.setattr(model_format, "available_memory", lambda: memory)
        monkeypatch.setattr(ggml_matmul, "ggml_available", lambda: True)
        assert default_quantization(EngineConfig(model=name, device="cpu")) == "ggml"
        assert default_quantization(EngineConfig(model=name, device="cpu", workload="stream")) == "ggml"
        monkeypatch.setattr(ggml_matmul, "ggml_available", lambda: False)
        want = "q4" if block_quant_available() else "none"
        assert default_quantization(EngineConfig(model=name, device="cpu")) == want
    # asked for explicitly, q4 is q4 whatever the memory
    assert default_quantization(EngineConfig(model=name, device="cpu", quantization="q4")) == "q4"


def test_a_safetensors_model_keeps_its_dtype(tiny_text_model):
    assert default_quantization(EngineConfig(model=str(tiny_text_model.path), device="cpu")) == "none"


@needs_gguf
def test_the_default_engine_on_a_gguf_is_quantized_and_resolves_once():
    from pagedtree.worker.models.ggml_matmul import ggml_available

    if not ggml_available():
        pytest.importorskip("onnxruntime")
    want = "ggml" if ggml_available() else "q4"
    llm = LLM(pm.SMOLLM2_135M.name, max_model_len=128, kv_cache_memory=2**25)
    assert llm.engine.config.quantization == want
    head = llm.engine.runner.model.lm_head
    if want == "ggml":
        assert head.block_matmul.types == ["Q8_0"]  # the file's Q8_0 head, as it is
    else:
        assert head.quantization == "q8"  # the file's Q8_0 head, exactly
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    # a resolved config stays resolved (the engine may be rebuilt from it)
    assert default_quantization(llm.engine.config) == want == llm.engine.resolved.target.quantization
    assert resolve_config(llm.engine.config).target.quantization == want


@needs_gguf
def test_a_large_batch_to_a_stream_engine_in_ggml_hears_of_the_batch_build(caplog):
    from pagedtree.engine.llm import BATCH_HINT_PROMPTS
    from pagedtree.worker.models.ggml_matmul import ggml_available

    if not ggml_available():
        pytest.skip("ggml is not installed")
    params = SamplingParams(temperature=0, max_tokens=1)
    llm = LLM(pm.SMOLLM2_135M.name, max_model_len=64, kv_cache_memory=2**25)
    with caplog.at_level("WARNING", logger="pagedtree"):
        llm.generate(["a"] * (BATCH_HINT_PROMPTS - 1), params, use_tqdm=False)  # a few: no word
        llm.generate(["a"] * BATCH_HINT_PROMPTS, params, use_tqdm=False)
        llm.generate(["a"] * BATCH_HINT_PROMPTS, params, use_tqdm=False)  # said once
    hints = [r for r in caplog.records if "workload='batch'" in r.getMessage()]
    assert len(hints) == 1
    caplog.clear()
    chosen = LLM(pm.SMOLLM2_135M.name, quantization="ggml", max_model_len=64, kv_cache_memory=2**25)
    with caplog.at_level("WARNING", logger="pagedtree"):
        chosen.generate(["a"] * BATCH_HINT_PROMPTS, params, use_tqdm=False)  # ggml asked for: as asked
    assert not [r for r in caplog.records if "workload='batch'" in r.getMessage()]


@needs_gguf
def test_a_server_runs_a_gguf_dense_where_this_cpu_serves_batches_faster_in_it(monkeypatch):
    """``workload="batch"``: dense weights where the probe finds a batch's products
    clearly faster in them and the memory is there; q4 where they lose, where memory is
    short, and for a single stream whatever the probe would say."""
    pytest.importorskip("onnxruntime")
    from pagedtree.loading import batch_format, model_format
    from pagedtree.worker.models.ggml_matmul import ggml_available

    name = pm.SMOLLM2_135M.name
    asked = []

    def probe(shape, rows, dtype):
        asked.append((rows, dtype))
        return batch_format.FormatTiming(rows, q4_seconds=2e-3, dense_seconds=dense_seconds, dense_dtype="bfloat16")

    monkeypatch.setattr(batch_format, "batch_format_timing", probe)
    monkeypatch.setattr(model_format, "available_memory", lambda: 2**40)
    dense_seconds = 1e-3
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch")) == "none"
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch", max_num_seqs=4)) == "none"
    assert [rows for rows, _ in asked] == [batch_format.BATCH_ROWS, 4]  # a batch's rows, at most max_num_seqs
    stream = "ggml" if ggml_available() else "q4"
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="stream")) == stream
    assert default_quantization(EngineConfig(model=name, device="cpu")) == stream  # unset: one stream
    # explicit choices stand
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch", quantization="q4")) == "q4"
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch", dtype="float32")) == "none"
    dense_seconds = 1.9e-3  # faster, but not by the margin
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch")) == "q4"
    dense_seconds = 1e-3
    monkeypatch.setattr(model_format, "available_memory", lambda: 100 * 2**20)  # 100 MiB
    assert default_quantization(EngineConfig(model=name, device="cpu", workload="batch")) in ("q4", "ggml")


def test_the_workload_is_checked_and_follows_the_entry_point(tiny_text_model):
    with pytest.raises(ValueError, match="workload"):
        EngineConfig(workload="throughput")
    llm = LLM(str(tiny_text_model.path), device="cpu", max_model_len=64, kv_cache_memory=2**22)
    assert llm.engine.config.workload == "stream"
    llm = LLM(str(tiny_text_model.path), device="cpu", max_model_len=64, kv_cache_memory=2**22, workload="batch")
    assert llm.engine.config.workload == "batch"
    from pagedtree.engine.async_engine import AsyncEngine

    engine = AsyncEngine(str(tiny_text_model.path), device="cpu", max_model_len=64, kv_cache_memory=2**22,
                         warm_up=False)
    try:
        assert engine.config.workload == "batch"
    finally:
        asyncio.run(engine.shutdown())
