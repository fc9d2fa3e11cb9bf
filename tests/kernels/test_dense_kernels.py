"""The batch-invariant dense kernels (products, add + RMSNorm, rotary + KV store),
run in Triton's interpreter on CPU tensors.

What they promise: a row's bits do not depend on the rows beside it, nor on how a
product spreads its K-groups over programs; and each result is the eager layer's
(exactly where the kernel rounds as eager does, within a product's rounding where
only the summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedtree.kernels import dense_ops
from pagedtree.kernels.dense_ops import BLOCK_K, BLOCK_N, matmul_config
from pagedtree.worker.models.decoder import RMSNorm, apply_rotary

pytestmark = pytest.mark.triton_interpreter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _eager(x, weight, bias, gated):
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if not gated:
        return out
    gate, up = out.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_either_launch(dtype, gated):
    """Rows 1, 17 and 70 (a decode, a 16-node tree, more than a row tile) and both
    launch modes: every row has the bits of the 70-row batch's, and the rows at the
    edges of tiles and reduction chunks (each launched alone: 70 launches would
    interpret for minutes) the bits of that row computed alone."""
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 200  # a partial column tile, K not a multiple of the K step
    halves = 2 if gated else 1
    weight = torch.randn(halves * n, k, generator=gen).to(dtype)
    bias = torch.randn(halves * n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    config = matmul_config(n, k, gated, dtype, num_sms=132)
    assert config.num_groups > 1  # a small layer spreads over K-groups
    batch = dense_ops.invariant_linear(x, weight, bias, config, split=False)
    for i in (0, 7, 8, 16, 63, 64, 69):
        assert torch.equal(dense_ops.invariant_linear(x[i:i + 1], weight, bias, config), batch[i:i + 1]), i
    for rows in (1, 17, 70):
        for split in (True, False):
            out = dense_ops.invariant_linear(x[:rows], weight, bias, config, split=split)
            assert torch.equal(out, batch[:rows]), (rows, split)
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(batch.float(), _eager(x, weight, bias, gated).float(), rtol=tol, atol=tol * 8)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("unroll", [1, 3])
def test_a_split_tile_adds_its_groups_in_order_however_many_loads_it_has_in_flight(monkeypatch, gated, unroll):
    """A split tile's last program loads a few groups' sums at once (the last pass
    masked past the final group) and 16 rows at a time: the bits of the one-program
    launch, with 5 groups in passes of 1 or 3 and a tile of 64 rows plus one of 6."""
    monkeypatch.setattr(dense_ops, "REDUCE_UNROLL", unroll)
    monkeypatch.setattr(dense_ops, "REDUCE_UNROLL_GATED", unroll)
    gen = torch.Generator().manual_seed(2)
    n, k = 72, 300
    halves = 2 if gated else 1
    weight = torch.randn(halves * n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(70, k, generator=gen).to(torch.bfloat16)
    config = matmul_config(n, k, gated, torch.bfloat16, num_sms=132)
    assert config.num_groups == 5 and dense_ops.reduce_unroll(config.num_groups, gated) == unroll
    whole = dense_ops.invariant_linear(x, weight, None, config, split=False)
    assert torch.equal(dense_ops.invariant_linear(x, weight, None, config, split=True), whole)


def test_a_split_launch_leaves_its_counters_at_zero():
    """The tile's last program resets its arrival counter, so the next split launch
    (and the next graph replay) starts from zero."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 256, generator=gen)
    x = torch.randn(3, 256, generator=gen)
    config = matmul_config(96, 256, False, torch.float32, num_sms=132)
    first = dense_ops.invariant_linear(x, weight, None, config, split=True)
    assert int(dense_ops._counters(x.device).abs().sum()) == 0
    assert torch.equal(dense_ops.invariant_linear(x, weight, None, config, split=True), first)


def test_the_product_shape_depends_on_the_layer_alone():
    """K-groups cover the inputs in K steps; a one-row product has about two programs
    per SM when the layer's shape allows; a wide layer (an LM head) walks K whole."""
    for n, k in ((1536, 1536), (2048, 1536), (1536, 8960), (8960, 1536), (151_936, 1536), (4096, 14_336)):
        config = matmul_config(n, k, False, torch.bfloat16, num_sms=132)
        assert config.group_k % BLOCK_K == 0
        assert config.num_groups * config.group_k >= k > (config.num_groups - 1) * config.group_k
        programs = config.tiles_n * config.num_groups
        steps = -(-k // BLOCK_K)
        assert programs >= min(2 * 132, config.tiles_n * steps)
        assert config.num_groups == 1 or programs < 4 * 2 * 132  # groups as wide as that allows
    assert matmul_config(151_936, 1536, False, torch.bfloat16, 132).num_groups == 1
    assert matmul_config(1536, 1536, False, torch.bfloat16, 132) == matmul_config(1536, 1536, False,
                                                                                 torch.bfloat16, 132)
    assert -(-1536 // BLOCK_N) == matmul_config(1536, 1536, False, torch.bfloat16, 132).tiles_n


def test_the_launch_mode_follows_the_rows():
    config = matmul_config(1536, 1536, False, torch.bfloat16, num_sms=132)
    assert dense_ops.uses_split(1, config, 132) and dense_ops.uses_split(65, config, 132)
    assert not dense_ops.uses_split(2080, config, 132)
    head = matmul_config(151_936, 1536, False, torch.bfloat16, num_sms=132)
    assert not dense_ops.uses_split(1, head, 132)  # one K-group: nothing to spread


def test_bad_shapes_are_refused_before_launching():
    config = matmul_config(32, 64, False, torch.float32, num_sms=132)
    with pytest.raises(ValueError, match="do not fit"):
        dense_ops.invariant_linear(torch.zeros(2, 63), torch.zeros(32, 64), None, config)
    with pytest.raises(ValueError, match="share one of"):
        dense_ops.invariant_linear(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64), None, config)
    with pytest.raises(ValueError, match="bias"):
        dense_ops.invariant_linear(torch.zeros(2, 64), torch.zeros(32, 64), torch.zeros(31), config)
    with pytest.raises(ValueError, match="power-of-two"):
        dense_ops.rotary_store(torch.zeros(1, 4 * 80), torch.zeros(1, dtype=torch.long), torch.zeros(8, 160), 2, 1, 80)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_the_eager_add_and_norm(dtype):
    """The residual becomes ``residual + x`` exactly (one rounding, as eager's add), the
    output the eager RMSNorm of it within one rounding of the fp32 mean; a row alone
    gives the same bits as in a batch."""
    gen = torch.Generator().manual_seed(2)
    hidden = 96  # not a power of two: masked columns
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(9, hidden, generator=gen).to(dtype)
    residual = torch.randn(9, hidden, generator=gen).to(dtype)
    summed = residual + x
    eager = norm(summed)
    batch_residual = residual.clone()
    out = dense_ops.add_rms_norm(x, norm.weight.detach(), 1e-6, batch_residual)
    assert torch.equal(batch_residual, summed)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), eager.float(), rtol=tol, atol=tol)
    lone = residual[4:5].clone()
    assert torch.equal(dense_ops.add_rms_norm(x[4:5], norm.weight.detach(), 1e-6, lone), out[4:5])
    torch.testing.assert_close(dense_ops.add_rms_norm(summed, norm.weight.detach(), 1e-6).float(), out.float(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_is_the_eager_rotary_and_stores_keys_and_values(dtype):
    """Queries and keys rotated in place equal eager ``apply_rotary`` bit for bit (the
    same table, the same roundings); keys and values land in their slots, and a
    negative slot (a padding token) stores nothing."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, tokens, block = 6, 2, 32, 5, 4
    positions = torch.tensor([0, 3, 7, 7, 40])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    want_q = apply_rotary(q.reshape(tokens, heads, head_dim), cos[positions], sin[positions])
    want_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos[positions], sin[positions])
    want_v = v.reshape(tokens, kv_heads, head_dim).clone()
    caches = [torch.zeros(8, block, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    slots = torch.tensor([0, 5, 9, -1, 31])
    dense_ops.rotary_store(qkv, positions, torch.cat((cos, sin), dim=-1).contiguous(), heads, kv_heads, head_dim,
                           slots, caches[0], caches[1])
    assert torch.equal(qkv[:, :heads * head_dim].reshape(tokens, heads, head_dim), want_q)
    assert torch.equal(qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim),
                       want_k)
    flat_k = caches[0].reshape(-1, kv_heads, head_dim)
    flat_v = caches[1].reshape(-1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], want_k[t]) and torch.equal(flat_v[slot], want_v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def _rotary_case(dtype, gen, heads=4, kv_heads=2, head_dim=32, k=200, tokens=70, blocks=40, block=4):
    """A q/k/v layer, a [cos | sin] table, positions (one past the table: read as
    zeros) and slots (one negative: stored nowhere) for ``tokens`` rows."""
    n_out = (heads + 2 * kv_heads) * head_dim
    weight = torch.randn(n_out, k, generator=gen).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    cos_sin = torch.randn(64, 2 * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    positions[3] = 64
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    slots[5] = -1
    return weight, bias, x, cos_sin, positions, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_qkv_product_rotating_in_its_epilogue_gives_the_product_then_the_rotary_kernel(dtype):
    """One head a column tile: the epilogue's rotated queries and keys, and the keys and
    values it stores, are the bits of the same product followed by ``rotary_store``,
    in both launch modes, for a decode, a 16-node tree and a batch past a row tile
    (bf16; fp32 at the tree's rows: the rotation is the rotary kernel's own code, whose
    test covers fp16); without caches it rotates only."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim, block = 4, 2, 32, 4
    weight, bias, x, cos_sin, positions, slots = _rotary_case(dtype, gen, heads, kv_heads, head_dim, block=block)
    config = dense_ops.qkv_config(heads, kv_heads, head_dim, x.shape[1], dtype, num_sms=132)
    assert config.block_n == head_dim and config.num_groups > 1
    for rows in (1, 17, 70) if dtype == torch.bfloat16 else (17,):
        want = dense_ops.invariant_linear(x[:rows], weight, bias, config)
        want_caches = [torch.zeros(40, block, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
        dense_ops.rotary_store(want, positions[:rows], cos_sin, heads, kv_heads, head_dim, slots[:rows],
                               *want_caches)
        for split in (True, False):
            caches = [torch.zeros_like(c) for c in want_caches]
            rotary = dense_ops.RotaryEpilogue(positions[:rows], cos_sin, heads, kv_heads, head_dim, slots[:rows],
                                              *caches)
            got = dense_ops.invariant_linear(x[:rows], weight, bias, config, split=split, rotary=rotary)
            assert torch.equal(got, want), (rows, split)
            assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1]), (rows, split)
    rotated = dense_ops.invariant_linear(x[:17], weight, bias, config,
                                         rotary=dense_ops.RotaryEpilogue(positions[:17], cos_sin, heads, kv_heads,
                                                                         head_dim))
    want = dense_ops.invariant_linear(x[:17], weight, bias, config)
    dense_ops.rotary_store(want, positions[:17], cos_sin, heads, kv_heads, head_dim)
    assert torch.equal(rotated, want)


def test_a_rotating_product_refuses_what_it_cannot_do():
    """A config not cut one head a tile, a gated layer, positions or slots of the wrong
    length, caches of another head count: refused before anything is launched."""
    gen = torch.Generator().manual_seed(5)
    weight, bias, x, cos_sin, positions, slots = _rotary_case(torch.float32, gen, tokens=8)
    caches = [torch.zeros(40, 4, 2, 32) for _ in range(2)]
    qkv = dense_ops.qkv_config(4, 2, 32, 200, torch.float32, num_sms=132)
    plain = matmul_config(qkv.n_out, 200, False, torch.float32, num_sms=132)
    rotary = dense_ops.RotaryEpilogue(positions, cos_sin, 4, 2, 32, slots, *caches)
    with pytest.raises(ValueError, match="one head|heads of 32 columns"):
        dense_ops.invariant_linear(x, weight, bias, plain, rotary=rotary)
    with pytest.raises(ValueError, match=r"positions must be \[8\]"):
        dense_ops.invariant_linear(x, weight, bias, qkv, rotary=dense_ops.RotaryEpilogue(
            positions[:2], cos_sin, 4, 2, 32, slots, *caches))
    with pytest.raises(ValueError, match="a slot per token"):
        dense_ops.invariant_linear(x, weight, bias, qkv, rotary=dense_ops.RotaryEpilogue(
            positions, cos_sin, 4, 2, 32, slots[:1], *caches))
    with pytest.raises(ValueError, match="caches must be"):
        dense_ops.invariant_linear(x, weight, bias, qkv, rotary=dense_ops.RotaryEpilogue(
            positions, cos_sin, 4, 2, 32, slots, torch.zeros(40, 4, 1, 32), torch.zeros(40, 4, 1, 32)))
    with pytest.raises(ValueError, match="power of two from 16 to 64"):
        matmul_config(64, 200, True, torch.float32, num_sms=132, block_n=128)
    assert not dense_ops.rotates_in_epilogue(256) and not dense_ops.rotates_in_epilogue(80)
    assert dense_ops.qkv_config(32, 8, 256, 4096, torch.bfloat16, 132).block_n == BLOCK_N
