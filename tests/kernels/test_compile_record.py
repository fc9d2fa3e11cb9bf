"""The pairwise compile matrix for sm_80 and sm_90, checked in the default suite.

Compiling the pairwise covering (every pair of values of dtype, head dim, GQA group
1-8, block size and step kind, on both GPUs) takes about 5 minutes with a warm
Triton cache and 15 with an empty one: too long for the default suite, which instead
checks the record of the last such compile (``benchmarks/results/kernels_sm80_sm90.json``)
against the code: it must have been compiled from these very kernels, launchers and
tile rules (a fingerprint of their sources and the Triton version), cover every case
the pairwise covering asks for today, and show 0 errors and 0 spills in every 16-bit
kernel. Changing a kernel or a tile rule without compiling again fails here, naming
the command. ``-m slow`` compiles the covering again (``test_cuda_compile.py``).

The fingerprint includes the Triton version, so it can match only under the Triton
that ``scripts/setup.sh`` pins (the record must have been compiled with that one);
under another Triton (a GPU image's own) that check is skipped, not failed.
"""

from __future__ import annotations

import json
import re

import pytest

triton = pytest.importorskip("triton")

from pagedtree.kernels.cuda_compile import RECORD, KernelBuild, case_names, problems, source_fingerprint  # noqa: E402

SETUP = RECORD.parents[2] / "scripts" / "setup.sh"

COMMAND = ("python -m pagedtree.kernels.cuda_compile --arch 90,80 --cover pairwise "
           "--json benchmarks/results/kernels_sm80_sm90.json")
KERNELS = {"_store_kv_kernel", "_unified_attention_kernel", "_reduce_splits_kernel", "_copy_rows_kernel"}


@pytest.fixture(scope="module")
def record() -> dict:
    if not RECORD.is_file():
        pytest.fail(f"no compile record at {RECORD}; make it with: {COMMAND}")
    return json.loads(RECORD.read_text())


def pinned_triton() -> str:
    """The Triton version ``scripts/setup.sh`` installs."""
    found = re.search(r'"triton==([^"]+)"', SETUP.read_text())
    assert found, f"{SETUP} pins no Triton version"
    return found.group(1)


def test_the_record_was_compiled_with_the_pinned_triton(record):
    assert record.get("triton") == pinned_triton(), f"compile the record again under the pinned Triton: {COMMAND}"


def test_the_record_was_compiled_from_these_kernels(record):
    pinned = pinned_triton()
    if triton.__version__ != pinned:
        pytest.skip(f"the record's fingerprint includes the Triton version: it holds for the pinned Triton "
                    f"{pinned}, and this is Triton {triton.__version__}")
    assert record.get("fingerprint") == source_fingerprint(), (
        f"the kernels, launchers or tile rules changed since the record was compiled; compile again: {COMMAND}")


def test_the_record_covers_every_pairwise_case_on_both_gpus(record):
    assert record["cover"] == "pairwise"
    for arch in (80, 90):
        assert record["cases"][str(arch)] == case_names(arch, cover="pairwise"), arch
    builds = record["builds"]
    for arch in (80, 90):
        mine = [b for b in builds if b["arch"] == arch]
        assert {b["kernel"] for b in mine} == KERNELS
        attention = [b for b in mine if b["kernel"] == "_unified_attention_kernel"]
        assert {b["constexprs"]["GROUP"] for b in attention} == set(range(1, 9))
        assert {b["constexprs"]["HEAD_DIM"] for b in attention} == {64, 128}
        assert {b["constexprs"]["BLOCK_SIZE"] for b in attention} == {16, 32}
        assert {b["dtype"] for b in mine} == {"fp16", "bf16", "fp32"}


def test_the_record_has_no_errors_and_no_16bit_spills(record):
    builds = [KernelBuild(**{k: v for k, v in b.items() if k != "spills"}) for b in record["builds"]]
    assert builds and all(b.registers > 0 for b in builds if not b.error)
    assert problems(builds) == []
    counts = record["variants_over_varying_steps"]
    assert counts and all(n == 1 for per_arch in counts.values() for n in per_arch.values())


def test_a_changed_tile_rule_makes_the_record_stale(tmp_path):
    import shutil

    from pagedtree.kernels import cuda_compile

    folder = RECORD.parents[2] / "pagedtree" / "kernels"
    for name in cuda_compile.SOURCES:
        shutil.copy(folder / name, tmp_path / name)
    assert source_fingerprint(tmp_path) == source_fingerprint()
    with open(tmp_path / "tiles.py", "a") as f:
        f.write("\n# a changed tile rule\n")
    assert source_fingerprint(tmp_path) != source_fingerprint()
