"""Every Triton kernel compiles to cubin for sm_80 and sm_90 on this GPU-less machine,
and the 16-bit kernels do not spill registers (``pagedtree.kernels.cuda_compile``).

The compile runs in a subprocess without ``TRITON_INTERPRET`` (the test process
defines the kernels for the interpreter). The default suite compiles real model
shapes on sm_90 (Llama-3-8B's 4, Qwen2.5-1.5B's 6 and Qwen2.5-7B's 7 query heads per
KV head at head dim 128, bf16: a 16-node tree, a 64-node tree with its root, a
split-KV tree); ``-m slow`` compiles the same on
sm_80 and sm_90, a pairwise covering of the
cases per GPU (every pair of values of dtype, head dim, GQA group 1-8, block size
and step kind at least once: about 40 cases, 15 minutes for both GPUs on two cores
with an empty Triton cache) and every combination. The default suite checks the
record of the last pairwise compile against the code (``test_compile_record.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from pagedtree.kernels.cuda_compile import KernelBuild, problems  # noqa: E402
from tests.kernels.test_compile_record import pinned_triton  # noqa: E402

KERNELS = {"_store_kv_kernel", "_unified_attention_kernel", "_reduce_splits_kernel", "_copy_rows_kernel"}


def _rows(build: dict) -> int:
    """Rows of an attention program's main query tile."""
    return build["constexprs"]["BLOCK_M"]


def _compile(out_dir, cover: str, arch: str = "80,90", *extra: str):
    out = out_dir / f"kernels_sm_{cover}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pagedtree.kernels.cuda_compile", "--arch", arch,
                           "--cover", cover, "--json", str(out), "--no-progress", *extra], env=env,
                          capture_output=True, text=True, timeout=3600)
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


# Each compile costs about 2 s on two cores (and the subprocess 6 s to import): the
# default suite compiles the real models' groups on sm_90, -m slow on both GPUs.
@pytest.mark.parametrize("archs,groups", [
    pytest.param((90,), (4, 6, 7), id="sm90-G4-G6-G7"),
    pytest.param((80, 90), (4, 6, 7), id="sm80-sm90-G4-G6-G7", marks=pytest.mark.slow),
])
def test_real_model_head_groups_compile_without_spills(tmp_path, archs, groups):
    # Llama-3-8B has 4 query heads per KV head, Qwen2.5-1.5B (the default model's
    # family) 6, Qwen2.5-7B 7: 16-node trees (sm_90's 32-key tiles in small launches;
    # 64 keys spilled 89 stores at 4 heads, a triple the pairwise record may miss),
    # 64-node trees sent with their root (65 queries) and a lone tree on a long
    # context (split-KV), in bf16 at head dim 128 (decodes: -m slow).
    proc, data = _compile(tmp_path, "all", ",".join(map(str, archs)), "--dtypes", "bf16", "--head-dims", "128",
                          "--groups", ",".join(map(str, groups)), "--block-sizes", "16",
                          "--phases", "tree16,tree64,split_tree16")
    # The tile rules are chosen so that the pinned Triton spills nowhere; another
    # Triton (a GPU image's own) must compile every case, and may spill a few stores
    # (Triton 3.6.0: 7 in the 64-node trees at 4 query heads per KV head).
    pinned = triton.__version__ == pinned_triton()
    assert proc.returncode == 0 or not pinned, proc.stdout + proc.stderr
    builds = data["builds"]
    assert {b["kernel"] for b in builds} == KERNELS
    assert {b["arch"] for b in builds} == set(archs)
    assert all(b["registers"] > 0 and not b["error"] and not (pinned and b["spills"]) for b in builds)
    attention = [b for b in builds if b["kernel"] == "_unified_attention_kernel"]
    assert {b["constexprs"]["GROUP"] for b in attention} == set(groups)
    # Both phases built: the tree in one pass, the split-KV tree with its reduce.
    assert {b["constexprs"]["NUM_SPLITS"] > 1 for b in attention} == {True, False}
    # Packed rows: 65 queries of 6 or 7 heads in two programs of 33 tokens (256 rows on sm_90).
    assert any(b["arch"] == 90 and b["constexprs"]["BLOCK_Q"] == 33 and _rows(b) == 256 for b in attention)
    # The 16-node trees' small launch on sm_90: 32-key tiles, at every group.
    wide = [b for b in attention if b["arch"] == 90 and b["constexprs"]["TILE_N"] == 32]
    assert {b["constexprs"]["GROUP"] for b in wide} == set(groups)
    assert all(counts and all(n == 1 for n in counts.values()) for counts in data["variants_over_varying_steps"].values())


@pytest.fixture(scope="module", params=[90, 80], ids=lambda a: f"sm{a}")
def report(request, tmp_path_factory):
    return request.param, _compile(tmp_path_factory.mktemp("cubin"), "pairwise", str(request.param))


@pytest.mark.slow
def test_every_kernel_compiles_without_16bit_spills(report):
    arch, (proc, data) = report
    assert proc.returncode == 0, proc.stdout + proc.stderr
    builds = data["builds"]
    mine = [b for b in builds if b["arch"] == arch]
    assert {b["kernel"] for b in mine} == KERNELS
    assert all(b["registers"] > 0 and not b["error"] for b in mine)
    assert {b["dtype"] for b in mine} == {"fp16", "bf16", "fp32"}
    attention = [b for b in mine if b["kernel"] == "_unified_attention_kernel"]
    # The 16-bit path uses tensor cores: no fp32 products in its specialisations.
    assert all(b["constexprs"]["DOT_FP32"] is (b["dtype"] == "fp32") for b in attention)
    assert {b["constexprs"]["HEAD_DIM"] for b in attention} == {64, 128}
    assert {b["constexprs"]["GROUP"] for b in attention} == set(range(1, 9))
    assert {b["constexprs"]["BLOCK_SIZE"] for b in attention} == {16, 32}
    assert {b["constexprs"]["NUM_SPLITS"] > 1 for b in attention} == {True, False}
    # Whole trees per program: up to 256 rows (128 on sm_80 at head dim 128: see
    # choose_tile_shape), 16 rows per warp.
    rows = {_rows(b) for b in attention}
    assert max(rows) == 256 if arch == 90 else max(rows) >= 128
    # 16 rows a warp (8 warps of 256 rows where 16 would spill: see _num_warps).
    assert all(b["num_warps"] == max(4, _rows(b) // 16) or (_rows(b) == 256 and b["num_warps"] == 8)
               for b in attention)
    if arch == 80:
        assert all(_rows(b) <= 128
                   for b in attention if b["constexprs"]["HEAD_DIM"] == 128)


@pytest.mark.slow
def test_every_combination_compiles_without_16bit_spills(tmp_path):
    proc, data = _compile(tmp_path, "all")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {b["kernel"] for b in data["builds"]} == KERNELS


def test_spills_and_errors_are_problems():
    ok = KernelBuild("k", "bf16 case", 90, "bf16", registers=128)
    spilling = KernelBuild("k", "bf16 case", 90, "bf16", registers=255, spill_stores=3, stack_bytes=24)
    fp32_spilling = KernelBuild("k", "fp32 case", 90, "fp32", registers=255, spill_stores=3, stack_bytes=24)
    broken = KernelBuild("k", "fp16 case", 80, "fp16", error="CompilationError: boom")
    assert problems([ok, fp32_spilling]) == []
    assert len(problems([spilling, broken])) == 2


@pytest.mark.slow
def test_steps_of_varying_sizes_reuse_one_compiled_kernel(report):
    """Batch size, context length and block-table width change every step; none of
    them may make a server compile a new variant."""
    _, (_, data) = report
    for arch, counts in data["variants_over_varying_steps"].items():
        assert counts and all(n == 1 for n in counts.values()), (arch, counts)
