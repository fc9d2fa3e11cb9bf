"""A stand-in for the ``flashinfer`` module on a CPU: its two paged wrappers, computed
in torch from exactly what FlashInfer's documentation says their arguments mean.

It checks what the engine hands FlashInfer (page tables, last-page lengths, query
offsets, the flattened custom mask, the NHD cache tuple) against those meanings;
whether FlashInfer's own kernels compute them is the GPU check's question
(``benchmarks/attention_sweep.py`` compares them with the Triton kernels).
"""

from __future__ import annotations

import importlib.machinery
import types

import torch


def _keys(cache: torch.Tensor, indices: torch.Tensor, start: int, end: int, last: int) -> torch.Tensor:
    """A request's keys (or values) ``[kv_len, H_kv, D]`` from its pages, NHD layout."""
    pages = indices[start:end].long().cpu()
    page_size = cache.shape[1]
    rows = cache[pages].reshape(-1, cache.shape[2], cache.shape[3])
    return rows[: (len(pages) - 1) * page_size + last]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[Q, H, D]`` over ``k``/``v`` ``[L, H_kv, D]`` where ``allowed`` ``[Q, L]``."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs):
        assert kv_layout == "NHD", kv_layout
        assert workspace.dtype == torch.uint8
        self.kwargs = kwargs
        self.plans: list[dict] = []

    def _check_plan(self, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size):
        for name, t in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("last_page_len", last_page_len)):
            assert t.dtype == torch.int32, (name, t.dtype)
        assert kv_indptr[0] == 0 and kv_indptr[-1] == len(kv_indices)
        assert len(last_page_len) == len(kv_indptr) - 1
        assert all(1 <= int(x) <= page_size for x in last_page_len)
        assert num_qo_heads % num_kv_heads == 0 and head_dim in (64, 128, 256)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """One query per request over its pages."""

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             q_data_type=None, kv_data_type=None, sm_scale=None, **kwargs):
        self._check_plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size)
        self.plans.append(dict(indptr=indptr.tolist(), indices=indices, last=last_page_len.tolist(),
                               heads=num_qo_heads, scale=sm_scale if sm_scale is not None else head_dim ** -0.5))

    def run(self, q, paged_kv_cache):
        plan = self.plans[-1]
        k_cache, v_cache = paged_kv_cache
        assert q.shape[0] == len(plan["last"]) and q.shape[1] == plan["heads"]
        out = []
        for i, last in enumerate(plan["last"]):
            start, end = plan["indptr"][i], plan["indptr"][i + 1]
            k = _keys(k_cache, plan["indices"], start, end, last)
            v = _keys(v_cache, plan["indices"], start, end, last)
            out.append(_attend(q[i : i + 1], k, v, torch.ones(1, len(k), dtype=torch.bool), plan["scale"]))
        return torch.cat(out)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """Each request's queries are the last ``q_len`` of its keys: no mask, a causal
    mask aligned to the bottom right, or the custom mask's row-major block."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, custom_mask=None, causal=False, q_data_type=None,
             kv_data_type=None, sm_scale=None, **kwargs):
        self._check_plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                         head_dim_qk, page_size)
        assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
        qo, kv, last = qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_last_page_len.tolist()
        kv_lens = [(kv[i + 1] - kv[i] - 1) * page_size + last[i] for i in range(len(last))]
        if custom_mask is not None:
            assert custom_mask.dtype == torch.bool
            # FlashInfer packs the mask on its device with these pointers (segment_packbits).
            devices = {t.device for t in (custom_mask, qo_indptr, paged_kv_indptr, paged_kv_last_page_len)}
            assert len(devices) == 1, f"a custom mask and its index pointers on different devices: {devices}"
            assert custom_mask.numel() == sum((qo[i + 1] - qo[i]) * kv_lens[i] for i in range(len(last)))
        self.plans.append(dict(qo=qo, kv=kv, indices=paged_kv_indices, last=last, kv_lens=kv_lens, mask=custom_mask,
                               causal=causal, heads=num_qo_heads,
                               scale=sm_scale if sm_scale is not None else head_dim_qk ** -0.5))

    def run(self, q, paged_kv_cache):
        plan = self.plans[-1]
        k_cache, v_cache = paged_kv_cache
        qo = plan["qo"]
        assert q.shape[0] == qo[-1] and q.shape[1] == plan["heads"]
        out, offset = [], 0
        for i, (last, kv_len) in enumerate(zip(plan["last"], plan["kv_lens"])):
            k = _keys(k_cache, plan["indices"], plan["kv"][i], plan["kv"][i + 1], last)
            v = _keys(v_cache, plan["indices"], plan["kv"][i], plan["kv"][i + 1], last)
            q_len = qo[i + 1] - qo[i]
            if plan["mask"] is not None:
                allowed = plan["mask"][offset : offset + q_len * kv_len].view(q_len, kv_len).cpu()
                offset += q_len * kv_len
            elif plan["causal"]:
                allowed = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
            else:
                allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
            out.append(_attend(q[qo[i] : qo[i + 1]], k, v, allowed, plan["scale"]))
        return torch.cat(out)


def module() -> types.ModuleType:
    """A module object with FlashInfer's two wrapper classes."""
    fake = types.ModuleType("flashinfer")
    fake.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)  # found by importlib.util.find_spec
    fake.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fake.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return fake
