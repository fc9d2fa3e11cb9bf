"""The 16-bit ``tl.dot`` path of the attention kernel (tensor cores on a GPU).

On a GPU, fp16/bf16 queries and caches are multiplied by 16-bit ``tl.dot`` with fp32
accumulation: scores from the 16-bit q and k, and probabilities rounded to the cache
dtype before they meet v. The interpreter takes the fp32 path by default; here the
16-bit path is forced (``dot_fp32=False``) so that it runs somewhere before it runs
on a GPU, against the torch reference in fp32.

Tolerance, from the rounding the 16-bit path adds (unit roundoff u = 2**-11 for
fp16, 2**-8 for bf16): the products q.k are exact in fp32 (16-bit significands), so
the scores are as exact as the reference's; the probabilities are rounded to 16
bits (relative error <= u each), so the weighted sum of v is off by at most
u * max|v|; the output is rounded to 16 bits once more (u * |out| <= u * max|v|).
Hence ``atol = 2 u max|v|`` plus fp32 noise.

What the interpreter cannot show: it multiplies with numpy, not with the tensor
cores' MMA instructions, so the accumulation order differs from a GPU's (the bound
above covers any order); and it cannot execute a bf16 ``tl.dot`` at all (numpy has
no bf16: Triton 3.7's interpreter returns values off by 1e8 or more), so the bf16
case is an expected failure there (strict: it will say when the interpreter learns
bf16) and passes on a GPU. The compiled MMA code of both dtypes is checked by the
compile test (``test_cuda_compile.py``) and runs only on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedtree.kernels import triton_ops  # noqa: E402
from pagedtree.kernels.triton_kernels import INTERPRETED  # noqa: E402
from pagedtree.kernels.tiles import TileShape  # noqa: E402
from tests.kernels.test_triton_attention import Batch, mixed  # noqa: E402

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _check_16bit(batch: Batch, tile: TileShape | None = None) -> None:
    out = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, batch.plan(), batch.scale,
                                       tile=tile, dot_fp32=False)
    u = UNIT_ROUNDOFF[batch.query.dtype]
    atol = 2 * u * batch.v_cache.float().abs().max().item() + 1e-5
    torch.testing.assert_close(out.float(), batch.expected(), atol=atol, rtol=0)


BF16_IN_INTERPRETER = pytest.mark.xfail(INTERPRETED, strict=True, reason="the interpreter has no bf16 tl.dot")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_IN_INTERPRETER)])
def test_16bit_dot_path_matches_reference(dtype):
    kinds = [("prefill", 17, 0), ("decode", 1, 20), ("tree", 9, 16), ("chain", 4, 5)]
    # At least 16 rows per tile, as a GPU's tl.dot needs.
    _check_16bit(Batch(kinds, 16, 4, 2, 32, dtype, seed=11), TileShape(block_q=8, group_p=2, tile_n=16, num_splits=1))


def test_16bit_dot_path_with_split_kv_and_gqa():
    kinds = [("decode", 1, 70), ("tree", 6, 33)]
    _check_16bit(Batch(kinds, 16, 8, 2, 64, torch.float16, seed=12),
                 TileShape(block_q=4, group_p=4, tile_n=16, num_splits=3))


def test_16bit_dot_path_is_what_runs():
    """The forced path really differs from the fp32 one (the probabilities are rounded),
    so the test above is not the fp32 path under another name."""
    batch = Batch(mixed(16)[:4], 16, 4, 2, 32, torch.float16, seed=13)
    tile = TileShape(block_q=8, group_p=2, tile_n=16, num_splits=1)
    plan = batch.plan()
    fp32 = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, plan, batch.scale, tile=tile,
                                        dot_fp32=True)
    mma = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, plan, batch.scale, tile=tile,
                                       dot_fp32=False)
    assert not torch.equal(fp32, mma)


def test_16bit_dot_path_rejects_mixed_dtypes():
    batch = Batch([("decode", 1, 4)], 16, 2, 1, 16, torch.float16)
    with pytest.raises(ValueError, match="16-bit products"):
        triton_ops.unified_attention(batch.query.float(), batch.k_cache, batch.v_cache, batch.plan(), batch.scale,
                                     dot_fp32=False)
