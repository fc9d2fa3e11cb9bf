"""The weight format a server's batches run fastest in: measured once per CPU, cached."""

from __future__ import annotations

import json

import pytest
import torch

from pagedtree.loading import batch_format
from pagedtree.loading import packaged_models as pm
from pagedtree.loading.batch_format import FormatTiming, ModelShape

pytest.importorskip("onnxruntime")


def test_the_probe_times_both_formats_at_the_batchs_rows():
    timing = batch_format.measure_formats(hidden=64, intermediate=96, rows=8, dtype=torch.float32, repeats=2)
    assert timing.rows == 8 and timing.dense_dtype == "float32"
    assert timing.q4_seconds > 0 and timing.dense_seconds > 0
    assert timing.dense_wins == (timing.dense_seconds <= batch_format.DENSE_MARGIN * timing.q4_seconds)


def test_dense_must_win_by_the_margin():
    margin = batch_format.DENSE_MARGIN
    assert FormatTiming(16, 1.0, margin, "bfloat16").dense_wins
    assert not FormatTiming(16, 1.0, margin + 0.01, "bfloat16").dense_wins
    assert not FormatTiming(16, 1.0, 1.0, "bfloat16").dense_wins  # a tie keeps q4 (less memory)


def test_a_probe_is_measured_once_per_key_and_read_back(tmp_path, monkeypatch):
    shape = ModelShape(hidden=64, intermediate=96)
    calls = []

    def fake(hidden, intermediate, rows, dtype):
        calls.append(rows)
        return FormatTiming(rows, 2e-3, 1e-3, str(dtype).removeprefix("torch."))

    monkeypatch.setattr(batch_format, "measure_formats", fake)
    first = batch_format.batch_format_timing(shape, 16, torch.bfloat16, folder=tmp_path)
    again = batch_format.batch_format_timing(shape, 16, torch.bfloat16, folder=tmp_path)
    assert first == again and calls == [16]
    batch_format.batch_format_timing(shape, 8, torch.bfloat16, folder=tmp_path)  # another key: measured
    assert calls == [16, 8]
    # a damaged file is measured again, not trusted
    batch_format._cache_file(tmp_path, batch_format.probe_key(shape, 16, torch.bfloat16)).write_text("{not json")
    batch_format.batch_format_timing(shape, 16, torch.bfloat16, folder=tmp_path)
    assert calls == [16, 8, 16]
    stored = [json.loads(p.read_text()) for p in tmp_path.glob("format_*.json")]
    assert {s["key"]["rows"] for s in stored} == {8, 16}


def test_a_cache_that_cannot_be_written_still_gives_the_measurement(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setattr(batch_format, "measure_formats",
                        lambda h, i, rows, dtype: FormatTiming(rows, 1e-3, 2e-3, "float32"))
    timing = batch_format.batch_format_timing(ModelShape(8, 8), 4, torch.float32, folder=blocked / "sub")
    assert timing.rows == 4 and not timing.dense_wins


def test_dense_weights_need_their_bytes_with_room_to_spare():
    needed = batch_format.DENSE_MEMORY_FACTOR * 2_000_000
    assert batch_format.dense_fits(2_000_000, int(needed))
    assert not batch_format.dense_fits(2_000_000, int(needed) - 1)
    assert batch_format.dense_fits(2_000_000, None)  # unknown: assumed enough


def test_the_shape_and_the_dense_bytes_come_from_the_models_config():
    """No parse of the GGUF file (it takes seconds for a 1.5B's): the config folder the
    load reads anyway."""
    if not pm.is_installed(pm.SMOLLM2_135M):
        pytest.skip("smollm2 not installed")
    from transformers import AutoConfig

    from pagedtree.loading.loader import gguf_config_folder
    from pagedtree.loading.offload_sizing import estimate_weight_bytes

    gguf = pm.gguf_path(pm.SMOLLM2_135M)
    config = AutoConfig.from_pretrained(str(gguf_config_folder(pm.SMOLLM2_135M.name, gguf)))
    assert batch_format.ModelShape.of(config) == ModelShape(hidden=576, intermediate=1536)
    # SmolLM2-135M, its head tied to the embedding: 2 bytes a parameter in bf16, 4 in fp32
    assert 260e6 < estimate_weight_bytes(config, torch.bfloat16) < 280e6
    assert estimate_weight_bytes(config, torch.float32) == 2 * estimate_weight_bytes(config, torch.bfloat16)
