"""benchmarks/roofline.py: the on-paper estimate of one attention launch models what
the engine sends (a tree of T nodes is T + 1 queries), takes its tiles from the
launch code, and has memory, tensor-core, exp2 and launch roofs."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_roofline():
    spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["roofline"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


R = _load_roofline()
H100 = R.GPUS["H100"]
LLAMA = R.MODELS["llama3-8b"]


@pytest.fixture(scope="module")
def compiled():
    return json.loads(R.DEFAULT_COMPILED.read_text())


def _spy(monkeypatch, tile=None):
    """Record choose_tile_shape's calls (and optionally answer with ``tile``)."""
    calls = []
    real = R.choose_tile_shape

    def spy(max_query_len, *args, **kwargs):
        shape = tile if tile is not None else real(max_query_len, *args, **kwargs)
        calls.append((max_query_len, args, kwargs, shape))
        return shape

    monkeypatch.setattr(R, "choose_tile_shape", spy)
    return calls


def _tile(block_q, block_m, root_m=0, splits=1, warps=16):
    """A stand-in tile shape with what the estimate reads of one."""
    return SimpleNamespace(block_q=block_q, block_m=block_m, group_p=4, tile_n=16, num_splits=splits,
                           num_warps=warps, root_side=bool(root_m), root_m=root_m,
                           first_query=lambda: 1 if root_m else 0)


@pytest.mark.parametrize("nodes", [0, 16, 32, 64])
def test_a_tree_of_t_nodes_is_t_plus_1_queries_and_the_launch_code_picks_its_tile(compiled, monkeypatch, nodes):
    calls = _spy(monkeypatch)
    r = R.estimate(H100, LLAMA, compiled, 8, 4096, nodes)
    assert r["queries"] == nodes + 1 and r["keys"] == 4096 + nodes
    (max_query_len, args, kwargs, _), = calls
    assert max_query_len == nodes + 1  # the root and the nodes
    assert args[:4] == (LLAMA.group, 8, LLAMA.kv_heads, 4096 + nodes) and kwargs["capability"] == 90


def test_the_estimate_follows_whatever_tile_the_launch_code_returns(compiled, monkeypatch):
    # 65 queries in 16-token tiles of 64 rows: five programs per request and KV head,
    # each reading the prefix again.
    _spy(monkeypatch, _tile(block_q=16, block_m=64, warps=4))
    r = R.estimate(H100, LLAMA, compiled, 32, 8192, 64)
    assert (r["tiles"], r["rows"], r["programs"]) == (5, 64, 5 * 32 * 8)
    assert 4.9 < r["kv_reads"] < 5.0


def test_hand_check_64_node_tree_batch_32_8k_llama(compiled, monkeypatch):
    """The worked cell of the script's docstring: 64 nodes + root in one program of
    256 + 16 rows per request and KV head, 8192 + 64 keys in 16-key tiles."""
    _spy(monkeypatch, _tile(block_q=64, block_m=256, root_m=16))
    r = R.estimate(H100, LLAMA, compiled, 32, 8192, 64)
    keys, rows, heads_b = 8256, 272, 8 * 32
    assert r["flops"] == 4 * rows * keys * 128 * heads_b
    assert r["flops"] / 1e9 == pytest.approx(294.3, abs=0.05)
    assert r["flops_real_rows"] / 1e9 == pytest.approx(281.35, abs=0.01)
    assert r["exp2"] == rows * (keys + keys // 16) * heads_b
    assert r["exp2"] / 1e6 == pytest.approx(610.8, abs=0.05)
    assert (r["programs"], r["resident_per_sm"], r["waves"]) == (256, 1, 2)
    assert r["busy_share"] == pytest.approx(256 / 264)
    assert r["compute_peak_us"] == pytest.approx(294.34e9 / 989.4e12 / (256 / 264) * 1e6, rel=1e-3)  # ~306 us
    assert r["compute_us"] == pytest.approx(294.34e9 / 400e12 / (256 / 264) * 1e6, rel=1e-3)  # ~759 us
    assert r["bound"] == "compute" and r["bound_peak"] == "memory"


def test_compute_binds_for_a_64_node_tree_at_batch_32_8k_with_16_key_tiles(compiled, monkeypatch):
    calls = _spy(monkeypatch)
    r = R.estimate(H100, LLAMA, compiled, 32, 8192, 64)
    (queries, _, _, tile), = calls
    assert queries == 65 and tile.tile_n == 16
    assert r["bound"] == "compute", r
    assert r["compute_us"] > r["memory_us"] > r["exp_us"]


@pytest.mark.parametrize("model", sorted(R.MODELS))
@pytest.mark.parametrize("batch,context", [(32, 8192), (128, 4096), (8, 32768)])
def test_decode_is_memory_bound(compiled, model, batch, context):
    r = R.estimate(H100, R.MODELS[model], compiled, batch, context, 0)
    assert r["bound"] == "memory" and r["memory_us"] > 5 * max(r["compute_us"], r["exp_us"])
    assert r["hbm_fraction"] > 0.8


def test_occupancy_and_waves_set_the_busy_share(compiled):
    # A lone decode: 8 KV heads x splits programs on 132 SMs, one wave.
    r = R.estimate(H100, LLAMA, compiled, 1, 4096, 0)
    assert r["waves"] == 1 and r["busy_share"] == pytest.approx(r["programs"] / 132)
    assert R.programs_per_sm(H100, 128, 16, 131072) == 1
    assert R.programs_per_sm(H100, 96, 4, 12804) == 5  # registers: 96 x 128 threads x 5 <= 65536
    # Full waves keep every SM busy.
    r = R.estimate(H100, LLAMA, compiled, 128, 4096, 0)
    assert r["busy_share"] == 1.0


def test_the_ratio_table_has_every_cell(compiled):
    batches, contexts, trees = [1, 8, 32, 128], [1024, 4096, 32768], [16, 32, 64]
    for gpu in R.GPUS.values():
        for model in R.MODELS.values():
            cells = R.ratio_table(gpu, model, compiled, batches, contexts, trees)
            assert {(c["context"], c["batch"]) for c in cells} == {(L, B) for L in contexts for B in batches}
            for c in cells:
                assert [t["nodes"] for t in c["trees"]] == trees
                assert [t["queries"] for t in c["trees"]] == [t + 1 for t in trees]
                for t in c["trees"]:
                    assert math.isfinite(t["ratio"]) and t["ratio"] > 0.9
                    assert t["bound"] in R.ROOFS and t["bound_peak"] in R.ROOFS


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert R.main(["--gpu", "H100", "--batch-sizes", "32", "--context-lens", "8192", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "T=64 (65 q)" in text and "| 8k | 32 |" in text
    report = json.loads(out.read_text())
    assert [t["model"] for t in report["tables"]] == ["Llama-3-8B", "Qwen2.5-7B"]
    cell = report["tables"][0]["cells"][0]
    assert cell["trees"][-1]["queries"] == 65 and cell["trees"][-1]["bound"] == "compute"
