"""zentorch's attention for long prompt chunks (``kernels/zen_sdpa.py``): used only where
the CPU, the installed build and a self-check allow, and then it gives torch's results
on the shapes the CPU backend sends."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("numba")

from pagedtree.attention.cpu_backend import CpuPagedAttention  # noqa: E402
from pagedtree.kernels import zen_sdpa  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402
from tests.kernels.dense_attention import batch_layout, dense_attention, sequence_rows, visibility_mask  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """``zen_sdpa`` as in a new process (its checks run once a process)."""
    monkeypatch.setattr(zen_sdpa, "_checked", False)
    monkeypatch.setattr(zen_sdpa, "_loaded", None)
    monkeypatch.setattr(zen_sdpa, "_why_not", "")
    return zen_sdpa


@pytest.fixture
def amd_avx512(fresh, monkeypatch):
    """``fresh``, on what reads as an AMD CPU with AVX-512."""
    monkeypatch.setattr(zen_sdpa, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(zen_sdpa, "cpu_vendor", lambda: "AuthenticAMD")
    return fresh


def installed_at(monkeypatch, folder: Path, torch_version: str) -> None:
    """A zentorch "installed" in ``folder``, built for ``torch_version``, whose library
    is not one."""
    (folder / "_build_info.py").write_text(f'__torchversion__ = "{torch_version}"\n')
    (folder / "libzentorch.so").write_bytes(b"not a library")
    monkeypatch.setattr(zen_sdpa.importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=[str(folder)]))


def library() -> zen_sdpa.ZenSdpa:
    """The installed library's op in its wrapper, without ``load``'s self-check (which
    would hide a wrong wrapper behind torch's kernel); skips where it is not installed."""
    if "avx512f" not in zen_sdpa.cpu_flags() or zen_sdpa.cpu_vendor() != "AuthenticAMD":
        pytest.skip("zentorch's attention runs on AMD CPUs with AVX-512 only")
    op = zen_sdpa.library_op()
    if op is None:
        pytest.skip(zen_sdpa.why_not())
    return zen_sdpa.ZenSdpa(op)


def test_off_without_avx512(fresh, monkeypatch):
    monkeypatch.setattr(zen_sdpa, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(zen_sdpa, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert fresh.load() is None and "AVX-512" in fresh.why_not()


def test_off_on_other_vendors_cpus(fresh, monkeypatch):
    monkeypatch.setattr(zen_sdpa, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(zen_sdpa, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert fresh.load() is None and "GenuineIntel" in fresh.why_not()


def test_off_when_the_environment_says_so(fresh, monkeypatch):
    monkeypatch.setenv(zen_sdpa.ENV, "0")
    assert fresh.load() is None and zen_sdpa.ENV in fresh.why_not()


def test_a_build_for_another_torch_is_not_loaded(amd_avx512, monkeypatch, tmp_path: Path):
    installed_at(monkeypatch, tmp_path, "1.99.0+cpu")
    assert amd_avx512.load() is None and "1.99.0" in amd_avx512.why_not()


def test_an_op_that_disagrees_with_torch_is_not_used(amd_avx512, monkeypatch):
    def maskless(query, key, value, dropout, is_causal, *, attn_mask=None, scale=None):
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale,
                                              enable_gqa=True), None

    monkeypatch.setattr(zen_sdpa, "library_op", lambda: maskless)
    assert amd_avx512.load() is None and "disagreed" in amd_avx512.why_not()


def test_an_op_that_refuses_the_checks_is_not_used(amd_avx512, monkeypatch):
    def refuses(*args, **kwargs):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(zen_sdpa, "library_op", lambda: refuses)
    assert amd_avx512.load() is None and "refused" in amd_avx512.why_not()


def test_an_op_that_is_slower_is_not_used(amd_avx512, monkeypatch):
    def slow(query, key, value, dropout, is_causal, *, attn_mask=None, scale=None):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=None if attn_mask is None else attn_mask == 0,
                                             is_causal=is_causal, scale=scale, enable_gqa=True)
        F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=True)
        return out, None

    monkeypatch.setattr(zen_sdpa, "library_op", lambda: slow)
    assert amd_avx512.load() is None and "slower" in amd_avx512.why_not()


def test_a_library_that_will_not_load_leaves_torchs_kernel(amd_avx512, monkeypatch, tmp_path: Path):
    installed_at(monkeypatch, tmp_path, torch.__version__)
    monkeypatch.delattr(torch.ops.zentorch, "zentorch_sdpa", raising=False)
    if hasattr(torch.ops.zentorch, "zentorch_sdpa"):
        pytest.skip("the real library is already loaded in this process")
    assert amd_avx512.load() is None and "failed to load" in amd_avx512.why_not()


def test_a_call_the_op_refuses_is_served_by_torchs_kernel(caplog):
    calls = []

    def refuses(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("unsupported shape")

    sdpa = zen_sdpa.ZenSdpa(refuses)
    q, k = torch.randn(1, 4, 70, 64), torch.randn(1, 2, 70, 64)
    for _ in range(2):
        out = sdpa(q, k, k, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    assert len(calls) == 1 and "refused" in caplog.text  # tried once, then torch's kernel


# (batch, query heads, KV heads, queries, keys, causal, head dim): a first chunk, a
# chunk after a prefix, a padded batch of two, Qwen2.5's 6 and 7 query heads a KV head.
SHAPES = [(1, 12, 2, 65, 65, True, 128), (1, 12, 2, 100, 700, False, 128), (2, 14, 2, 70, 90, False, 64),
          (1, 7, 1, 129, 129, True, 64), (1, 4, 4, 80, 80, False, 32)]


@pytest.mark.parametrize("b,heads,kv_heads,q_len,k_len,causal,dim", SHAPES)
def test_gives_torchs_results_on_the_backends_shapes(b, heads, kv_heads, q_len, k_len, causal, dim):
    sdpa = library()
    generator = torch.Generator().manual_seed(q_len + k_len)
    q = torch.randn(b, q_len, heads, dim, generator=generator).bfloat16().float().transpose(1, 2)
    k, v = (torch.randn(b, k_len, kv_heads, dim, generator=generator).bfloat16().float().transpose(1, 2)
            for _ in range(2))
    mask = None
    if not causal:  # a prefix, then causal among the new tokens; padding rows see key 0
        mask = torch.zeros(b, 1, q_len, k_len, dtype=torch.bool)
        mask[..., : k_len - q_len] = True
        mask[..., k_len - q_len:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        if b > 1:
            mask[1, :, q_len // 2:] = False
            mask[1, :, q_len // 2:, 0] = True
    ours = sdpa(q, k, v, attn_mask=mask, is_causal=causal, scale=dim ** -0.5, enable_gqa=heads != kv_heads)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=dim ** -0.5,
                                            enable_gqa=heads != kv_heads)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=5e-6, rtol=0)


def test_a_new_mask_is_not_served_from_the_last_one():
    sdpa = library()
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 70, 64, generator=generator)
    k, v = (torch.randn(1, 2, 90, 64, generator=generator) for _ in range(2))
    for offset in (0, 5, 0):
        mask = torch.ones(1, 1, 70, 90, dtype=torch.bool).tril(diagonal=20 - offset)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, enable_gqa=True), theirs, atol=5e-6, rtol=0)


# Long chunks and a 64-node tree (65 queries with its root): the backend's SDPA path.
LONG = [("prefill", 130, 0), ("chunk", 96, 200), ("tree", 65, 40), ("decode", 1, 70)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_backend_attends_long_chunks_as_torch_does(dtype):
    """A 16-bit cache's long chunks go through zentorch where it is used, and come out
    as torch's kernel computes them up to bf16 rounding; an fp32 cache keeps torch's."""
    rng = random.Random(7)
    torch.manual_seed(7)
    block_size, heads, kv_heads, dim, num_blocks = 16, 12, 2, 128, 80
    qsl, ctx, tables, parents = batch_layout(rng, block_size, num_blocks, LONG)
    caches = (torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype),
              torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype))
    q = torch.randn(qsl[-1], heads, dim).to(dtype)
    slots = torch.tensor([tables[i][pos // block_size] * block_size + pos % block_size
                          for i, (_, n, prefix) in enumerate(LONG) for pos in range(prefix, prefix + n)])
    new_k, new_v = (c.view(-1, kv_heads, dim)[slots].clone() for c in caches)
    meta = AttentionMetadata(block_size, slots, qsl, ctx, tables, parents)
    outs = {}
    for arm in ("default", "torch"):
        backend = CpuPagedAttention([tuple(c.clone() for c in caches)], scale=dim ** -0.5)
        if arm == "torch":
            backend._sdpa = F.scaled_dot_product_attention
        backend.begin_step(meta)
        outs[arm] = backend(0, q, new_k, new_v)
        if arm == "default":
            uses_zen = isinstance(backend._sdpa, zen_sdpa.ZenSdpa)
            assert uses_zen == (dtype == torch.bfloat16 and zen_sdpa.load() is not None)
            if dtype == torch.bfloat16 and not uses_zen:
                pytest.skip(f"zentorch's attention is not used here: {zen_sdpa.why_not()}")
    for i, (_, n, _prefix) in enumerate(LONG):
        rows = slice(qsl[i], qsl[i + 1])
        k = sequence_rows(caches[0], tables[i], ctx[i], block_size).float()
        v = sequence_rows(caches[1], tables[i], ctx[i], block_size).float()
        expected = dense_attention(q[rows].float(), k, v, visibility_mask(n, ctx[i], parents[i]), dim ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(outs["default"][rows].double(), expected.to(dtype).double(), atol=tol, rtol=tol)
    # Both round the same fp32 results up to its last bits: nearly every bf16 agrees.
    same = (outs["default"] == outs["torch"]).float().mean().item()
    assert same > (0.99 if dtype == torch.bfloat16 else 1 - 1e-9)
