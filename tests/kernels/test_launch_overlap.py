"""Overlapping launches (programmatic dependent launch): when they are on, which
kernels take part, and the rule each keeps (wait before touching memory).

The launches themselves need an sm_90 GPU (the GPU-day check runs them: the same
tokens with launches overlapping as without); here, the switch, and the compiled
PTX of every overlapping kernel read for a global access before its wait.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedtree.kernels import launch_overlap
from pagedtree.kernels.cuda_compile import early_access


def test_the_switch_is_off_by_default_and_scoped():
    assert launch_overlap.enabled() is (os.environ.get(launch_overlap.ENV, "0") == "1")
    with launch_overlap.overlapping(True):
        assert launch_overlap.enabled()
        with launch_overlap.overlapping(False):
            assert not launch_overlap.enabled()
        assert launch_overlap.enabled()
    # CPU tensors (the interpreter) never launch this way, switched on or not.
    with launch_overlap.overlapping(True):
        assert not launch_overlap.supported(torch.device("cpu"))
        assert launch_overlap.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_bad_environment_value_is_refused_by_name(value):
    code = "import pagedtree.kernels.launch_overlap"
    env = dict(os.environ, **{launch_overlap.ENV: value})
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert launch_overlap.ENV in proc.stderr and "must be 0 or 1" in proc.stderr


PTX_WAITS_FIRST = """
\tld.param.u64 \t%rd1, [k_param_0];
\tprefetch.global.L2 [%rd5]; // dummy %r1
\tgriddepcontrol.wait; // dummy %r2
\tgriddepcontrol.launch_dependents; // dummy %r3
\t@%p1 ld.global.v4.b32 { %r4, %r5, %r6, %r7 }, [ %rd2 + 0 ];
"""


def test_the_wait_rule_reads_the_ptx():
    assert early_access(PTX_WAITS_FIRST) is None
    assert early_access(PTX_WAITS_FIRST.replace("griddepcontrol", "nothing")) is None  # not overlapping
    early = PTX_WAITS_FIRST.replace("\tprefetch.global.L2 [%rd5];", "\t@!%p2 ld.global.b32 %r9, [%rd5];")
    assert "ld.global.b32" in early_access(early)
    stored = PTX_WAITS_FIRST.replace("\tprefetch.global.L2 [%rd5];", "\tst.global.b16 [%rd5], %rs1;")
    assert "st.global" in early_access(stored)
    counted = PTX_WAITS_FIRST.replace("\tprefetch.global.L2 [%rd5];",
                                      "\tatom.global.gpu.acq_rel.add.u32 %r1, [%rd5], 1;")
    assert "atom." in early_access(counted)


# One subprocess (a process without the interpreter) compiles both sets.
_COMPILE_BOTH = """
import json, sys
from pagedtree.kernels import cuda_compile, dense_compile
builds = dense_compile.compile_all(90, ("bf16",), ("qwen2.5-0.5b",), overlap=True)
builds += cuda_compile.compile_all(90, ("bf16",), (128,), (6,), (16,), ("split_decode", "tree16"), overlap=True)
json.dump([dict(kernel=b.kernel, pdl=b.constexprs.get("PDL"), problems=cuda_compile.problems([b]))
           for b in builds], sys.stdout)
"""


def test_every_overlapping_kernel_waits_before_touching_memory_on_sm90():
    """The decoder's kernels as an sm_90 step launches them with launches
    overlapping: the products (a decode's split form, which prefetches its weights
    first, and a batch of trees'), norms, rotary + store, and attention (split-KV
    decode with its merge, trees): each compiles, does not spill (under the pinned
    Triton: another, a GPU image's own, may spill a few stores), and waits first."""
    triton = pytest.importorskip("triton")
    from tests.kernels.test_compile_record import pinned_triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_BOTH], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr
    builds = json.loads(proc.stdout)
    overlapping = {b["kernel"] for b in builds if b["pdl"] is True}
    assert overlapping >= {"_invariant_matmul_kernel", "_add_rms_norm_kernel", "_rotary_store_kernel",
                           "_store_kv_kernel", "_unified_attention_kernel", "_reduce_splits_kernel"}
    spill_free = triton.__version__ == pinned_triton()
    assert [p for b in builds for p in b["problems"] if spill_free or "spill" not in p] == []
