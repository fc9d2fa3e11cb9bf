"""Fused CPU element-wise ops (numba): the same numbers as the eager torch ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from pagedtree.kernels.cpu_elementwise import (  # noqa: E402
    add_rms_norm_kernel,
    add_rms_norm_serial,
    rotary_kernel,
    rotary_serial,
)
from pagedtree.loading.loader import load_model  # noqa: E402
from pagedtree.kernels.numba_arrays import as_kernel_array as _array  # noqa: E402
from pagedtree.worker.models.decoder import RMSNorm, apply_rotary  # noqa: E402


def _eager_add_rms_norm(x, residual, weight, eps):
    norm = RMSNorm(residual.shape[-1], eps).to(residual.dtype)
    norm.weight.data.copy_(weight)
    summed = residual + x if x is not None else residual
    return norm(summed), summed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_matches_eager(dtype, num_tokens, with_x):
    torch.manual_seed(num_tokens)
    hidden, eps = 96, 1e-5
    residual = (torch.randn(num_tokens, hidden) * 3).to(dtype)
    x = (torch.randn(num_tokens, hidden) * 2).to(dtype) if with_x else None
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    expected, expected_residual = _eager_add_rms_norm(x, residual, weight, eps)
    fused_residual = residual.clone()
    out = torch.empty_like(residual)
    x_array = _array(x) if x is not None else _array(fused_residual)
    add_rms_norm_kernel(x_array, _array(fused_residual), weight.float().numpy(), _array(out), eps, with_x,
                        dtype == torch.bfloat16)
    # The add rounds the same way as eager's: bit for bit.
    assert torch.equal(fused_residual, expected_residual)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    else:
        # Only the sum of squares is accumulated in another order: at most one bf16
        # step apart, and almost everywhere identical.
        assert (out == expected).float().mean() > 0.98
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bit_exact(dtype):
    """Rotary has no reduction: in-place fused rotary equals eager ``apply_rotary`` exactly."""
    torch.manual_seed(0)
    num_tokens, q_heads, kv_heads, head_dim = 7, 6, 2, 16
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.randn(num_tokens, head_dim // 2) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    fused = qkv.clone()
    rotary_kernel(_array(fused), cos.float().numpy(), sin.float().numpy(), q_heads + kv_heads, head_dim,
                  dtype == torch.bfloat16)
    assert torch.equal(fused[:, : q_heads * head_dim].view_as(q), expected_q)
    assert torch.equal(fused[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view_as(k), expected_k)
    assert torch.equal(fused[:, (q_heads + kv_heads) * head_dim :], v_before)  # values untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 9])
def test_serial_twins_equal_parallel_kernels(dtype, num_tokens):
    """The few-row kernels run the same per-row arithmetic: bit for bit the parallel ones."""
    torch.manual_seed(num_tokens)
    bf16 = dtype == torch.bfloat16
    hidden = 64
    residual = (torch.randn(num_tokens, hidden) * 3).to(dtype)
    x = torch.randn(num_tokens, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).float().numpy()
    results = []
    for kernel in (add_rms_norm_kernel, add_rms_norm_serial):
        res, out = residual.clone(), torch.empty_like(residual)
        kernel(_array(x), _array(res), weight, _array(out), 1e-6, True, bf16)
        results.append((res, out))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    qkv = torch.randn(num_tokens, 6 * 16).to(dtype)
    emb = torch.randn(num_tokens, 16).float()
    rotated = []
    for kernel in (rotary_kernel, rotary_serial):
        fused = qkv.clone()
        kernel(_array(fused), emb.cos().numpy(), emb.sin().numpy(), 4, 16, bf16)
        rotated.append(fused)
    assert torch.equal(rotated[0], rotated[1]) and not torch.equal(rotated[0], qkv)


def _dense_causal_attention(layer, q, k, v):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), is_causal=True
    )
    return out.transpose(0, 1).to(q.dtype).contiguous()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_forward_matches_eager_forward(arch, tiny_llama, tiny_qwen2):
    """The whole decoder forward with fused ops against the eager one (fp32)."""
    model = load_model(str((tiny_llama if arch == "llama" else tiny_qwen2).path)).model
    ids = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(21) + 4
    with torch.inference_mode():
        eager = model(ids, positions, _dense_causal_attention)
        assert model.enable_fused_cpu_ops()
        fused = model(ids, positions, _dense_causal_attention)
    assert model.fused_forward is not None
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_steps_run_the_mlp_in_slices_with_the_eager_result(tiny_qwen2, dtype):
    """A step longer than a layer's MLP slice (here forced to 4 rows) runs its MLP
    slice by slice, SiLU and product in place: the eager forward's result."""
    import dataclasses

    model = load_model(str(tiny_qwen2.path), dtype=dtype).model
    ids = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(21)
    with torch.inference_mode():
        eager = model(ids, positions, _dense_causal_attention)
        assert model.enable_fused_cpu_ops()
        fused = model.fused_forward
        assert all(part.silu for part in fused.layers)
        assert all(part.mlp_slice_rows >= 256 for part in fused.layers)
        fused.layers = [dataclasses.replace(part, mlp_slice_rows=4) for part in fused.layers]
        calls = []
        gate_up = fused.layers[0].gate_up
        fused.layers[0] = dataclasses.replace(fused.layers[0], gate_up=lambda x: calls.append(len(x)) or gate_up(x))
        sliced = model(ids, positions, _dense_causal_attention)
    assert calls == [4, 4, 4, 4, 4, 1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sliced, eager, rtol=tol, atol=tol)


def test_fused_ops_are_off_with_enforce_eager(tiny_llama):
    """On CPU (pinned: the fused ops are CPU kernels, off on any other device)."""
    from pagedtree import LLM

    assert LLM(str(tiny_llama.path), dtype="float32", device="cpu").engine.runner.fused_cpu_ops
    eager = LLM(str(tiny_llama.path), dtype="float32", device="cpu", enforce_eager=True).engine.runner
    assert not eager.fused_cpu_ops and eager.model.fused_forward is None
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(tiny_llama.path), enforce_eager="yes")


def test_bf16_rounding_equals_torch_conversion():
    """The kernels' fp32 -> bf16 rounding (nearest even) is torch's, ties, overflow to
    infinity, subnormals and NaN included."""
    from pagedtree.kernels.cpu_elementwise import _round_bf16

    special = [1.0, 1.00390625, 1.01171875, 1.005859375, -2.5e-3, 3.3961e38, -3.3961e38, float("inf"),
               float("-inf"), 1e-40, -1e-40, 0.0, -0.0, float("nan")]
    values = torch.cat([torch.tensor(special), torch.randn(5000) * 100, torch.randn(1000) * 1e-39])
    bits = values.numpy().view(np.uint32).copy()
    _round_bf16(bits, bits.shape[0])
    expected = values.to(torch.bfloat16).float()
    assert torch.equal(torch.from_numpy(bits.view(np.float32)).nan_to_num(7.0), expected.nan_to_num(7.0))
