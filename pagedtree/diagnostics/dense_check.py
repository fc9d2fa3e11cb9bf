"""Check: the batch-invariant dense kernels on this GPU, bits and speed.

1. Bits: every product of a real layer shape (the Qwen2.5 1.5B's, a Llama-3-8B's)
   gives each row the same bits alone, in batches of 1 to 2,080 rows and in both
   launch modes (K-groups spread over programs, or walked by one), and stays within
   the dtype's rounding of an fp32 reference; RMSNorm rows likewise, and the q/k/v
   product that rotates and stores in its epilogue gives the product-then-rotary
   kernel's bits. A row that differs fails the check: greedy speculation would then
   differ from plain decoding.
2. Speed (informational): each product against cuBLAS (``F.linear``; for the gated
   MLP, ``F.linear`` then SiLU * up) at 1 to 2,080 rows, and the weights' stream in
   GB/s at one row; the q/k/v product rotating in its epilogue against the product
   and the rotary kernel launched apart; the fused norm and rotary + KV store against
   their eager ops
   and, on a GPU, the libraries that fuse them (Inductor through ``torch.compile``;
   FlashInfer's and Liger's fused add + RMSNorm and rotary where they import).
   Timed as CUDA graphs of repeated calls over enough weight copies to spill the
   L2 cache, so launch overhead and cached weights flatter neither side.

In the interpreter (``--device cpu``) the same checks run on small shapes; the
timings there mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedtree.diagnostics.graph_timing import graph_replay_seconds
from pagedtree.diagnostics.report import FAIL, INFO, PASS, Row

CHECK = "dense kernels"
# (name, n_out, k, gated, bias): one model's products; the head last.
QWEN_1_5B = (("qkv", 2048, 1536, False, True), ("o", 1536, 1536, False, False),
             ("gate_up", 8960, 1536, True, False), ("down", 1536, 8960, False, False),
             ("head", 151_936, 1536, False, False))
LLAMA_8B = (("qkv", 6144, 4096, False, False), ("o", 4096, 4096, False, False),
            ("gate_up", 14_336, 4096, True, False), ("down", 4096, 14_336, False, False),
            ("head", 128_256, 4096, False, False))
TINY = (("qkv", 96, 200, False, True), ("gate_up", 80, 64, True, False), ("down", 64, 160, False, False))
CUDA_ROWS = (1, 17, 65, 256, 2080)
CPU_ROWS = (1, 17, 70)
TIMED_ROWS = (1, 16, 64, 256, 2080)
L2_SPILL_BYTES = 256 << 20  # weight copies cycled through per timing: more than any L2


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    if not gated:
        return out
    gate, up = out.to(x.dtype).float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _layer(name: str, n_out: int, k: int, gated: bool, bias: bool, dtype: torch.dtype, device: torch.device,
           gen: torch.Generator):
    from pagedtree.kernels import dense_ops

    halves = 2 if gated else 1
    weight = (torch.randn(halves * n_out, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    b = (torch.randn(halves * n_out, generator=gen, device=device) * 0.1).to(dtype) if bias else None
    config = dense_ops.matmul_config(n_out, k, gated, dtype, *dense_ops.device_kind(device))
    return weight, b, config


def invariance_rows(device: torch.device, quick: bool, seed: int = 0) -> list[Row]:
    """Check 1's rows: one per layer shape and dtype, FAIL when any row's bits depend
    on its batch or launch mode, or the error against fp32 passes the dtype's bound."""
    from pagedtree.kernels import dense_ops

    on_gpu = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [("qwen2.5-1.5b", QWEN_1_5B)] + ([] if quick else [("llama-3-8b", LLAMA_8B)]) if on_gpu \
        else [("tiny", TINY)]
    counts = CUDA_ROWS if on_gpu else CPU_ROWS
    dtypes = (torch.bfloat16, torch.float16) if on_gpu and not quick else (torch.bfloat16,)
    rows = []
    for model, layers in shapes:
        for dtype in dtypes:
            for name, n_out, k, gated, bias in layers:
                if name == "head" and dtype != torch.bfloat16:
                    continue
                weight, b, config = _layer(name, n_out, k, gated, bias, dtype, device, gen)
                x = torch.randn(counts[-1], k, generator=gen, device=device).to(dtype)
                full = dense_ops.invariant_linear(x, weight, b, config)
                mismatches = []
                for m in counts:
                    modes = (True, False) if m <= dense_ops.SPLIT_MAX_ROWS else (False,)
                    for split in modes:
                        if not torch.equal(dense_ops.invariant_linear(x[:m], weight, b, config, split=split),
                                           full[:m]):
                            mismatches.append(f"{m} rows{' split' if split else ''}")
                for i in sorted({0, 5, min(64, counts[-1] - 1), counts[-1] - 1}):
                    if not torch.equal(dense_ops.invariant_linear(x[i:i + 1], weight, b, config), full[i:i + 1]):
                        mismatches.append(f"row {i} alone")
                ref = _reference(x, weight, b, gated)
                error = float((full.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
                bound = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
                ok = not mismatches and error <= bound
                case = f"{model} {name} {n_out}x{k}{' gated' if gated else ''} {str(dtype).removeprefix('torch.')}"
                result = "same bits in every batch and mode" if not mismatches else "differ: " + ", ".join(
                    mismatches[:4])
                rows.append(Row(CHECK, case, result, f"max error {error:.2e} of max |ref| (bound {bound:.0e})",
                                PASS if ok else FAIL, dict(mismatches=mismatches, error=error,
                                                           group_k=config.group_k, groups=config.num_groups)))
                del weight, b, x, full, ref
    rows.append(_norm_row(device, gen))
    rows.append(_rotary_epilogue_row(device, gen))
    return rows


def _rotary_case(device: torch.device, gen: torch.Generator, m: int):
    """The 1.5B's q/k/v layer (a tiny one in the interpreter), ``m`` rows, a [cos | sin]
    table, positions, slots and zeroed caches: ``(weight, bias, x, rotary, heads)``."""
    from pagedtree.kernels import dense_ops

    on_gpu = device.type == "cuda"
    hidden, heads, kv_heads, head_dim = (1536, 12, 2, 128) if on_gpu else (96, 4, 2, 32)
    dtype = torch.bfloat16
    n_out = (heads + 2 * kv_heads) * head_dim
    weight = (torch.randn(n_out, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype)
    bias = (torch.randn(n_out, generator=gen, device=device) * 0.1).to(dtype)
    x = torch.randn(m, hidden, generator=gen, device=device).to(dtype)
    cos_sin = torch.randn(4096, 2 * head_dim, generator=gen, device=device).to(dtype)
    positions = torch.randint(0, 4096, (m,), generator=gen, device=device)
    blocks = -(-m // 16) + 8
    slots = torch.randperm(blocks * 16, generator=gen, device=device)[:m]
    caches = [torch.zeros(blocks, 16, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)]
    rotary = dense_ops.RotaryEpilogue(positions, cos_sin, heads, kv_heads, head_dim, slots, *caches)
    return weight, bias, x, rotary


def _rotary_epilogue_row(device: torch.device, gen: torch.Generator) -> Row:
    """The q/k/v product rotating and storing in its epilogue: its output and the keys
    and values it stores are the bits of the same product followed by
    ``rotary_store``, at a decode's, a tree's and a batch's row counts, both launch
    modes."""
    from pagedtree.kernels import dense_ops

    counts = CUDA_ROWS if device.type == "cuda" else CPU_ROWS[:2]  # the interpreter: a decode and a tree
    weight, bias, x, rotary = _rotary_case(device, gen, counts[-1])
    config = dense_ops.qkv_config(rotary.num_heads, rotary.num_kv_heads, rotary.head_dim, x.shape[1], x.dtype,
                                  *dense_ops.device_kind(device))
    mismatches = []
    for m in counts:
        part = dense_ops.RotaryEpilogue(rotary.positions[:m], rotary.cos_sin, rotary.num_heads, rotary.num_kv_heads,
                                        rotary.head_dim, rotary.slot_mapping[:m], torch.zeros_like(rotary.key_cache),
                                        torch.zeros_like(rotary.value_cache))
        want = dense_ops.invariant_linear(x[:m], weight, bias, config)
        want_caches = [torch.zeros_like(rotary.key_cache), torch.zeros_like(rotary.value_cache)]
        dense_ops.rotary_store(want, part.positions, part.cos_sin, part.num_heads, part.num_kv_heads, part.head_dim,
                               part.slot_mapping, *want_caches)
        for split in (True, False) if m <= dense_ops.SPLIT_MAX_ROWS else (False,):
            part.key_cache.zero_()
            part.value_cache.zero_()
            got = dense_ops.invariant_linear(x[:m], weight, bias, config, split=split, rotary=part)
            if not (torch.equal(got, want) and torch.equal(part.key_cache, want_caches[0])
                    and torch.equal(part.value_cache, want_caches[1])):
                mismatches.append(f"{m} rows{' split' if split else ''}")
    case = (f"q/k/v {config.n_out}x{config.k} rotating and storing in its epilogue, "
            f"{rotary.num_heads}/{rotary.num_kv_heads} heads of {rotary.head_dim}, bf16")
    return Row(CHECK, case, "the product-then-rotary-kernel bits" if not mismatches else
               "differ: " + ", ".join(mismatches[:4]), "-", FAIL if mismatches else PASS,
               dict(mismatches=mismatches))


def _norm_row(device: torch.device, gen: torch.Generator) -> Row:
    """The fused add + RMSNorm: the residual exactly ``residual + x``, a row alone the
    same bits as in a batch of 2,080."""
    from pagedtree.kernels import dense_ops

    hidden, count = (1536, 2080) if device.type == "cuda" else (96, 9)
    weight = torch.randn(hidden, generator=gen, device=device).to(torch.bfloat16)
    x = torch.randn(count, hidden, generator=gen, device=device).to(torch.bfloat16)
    residual = torch.randn(count, hidden, generator=gen, device=device).to(torch.bfloat16)
    summed = residual + x
    batch = residual.clone()
    out = dense_ops.add_rms_norm(x, weight, 1e-6, batch)
    lone = residual[count - 1:].clone()
    same = torch.equal(batch, summed) and torch.equal(
        dense_ops.add_rms_norm(x[count - 1:], weight, 1e-6, lone), out[count - 1:])
    return Row(CHECK, f"add + RMSNorm, {count} x {hidden} bf16", "same bits alone and in a batch" if same
               else "a row differs alone", "-", PASS if same else FAIL)


def graph_seconds(make_calls: Callable[[], list[Callable[[], object]]], device: torch.device,
                  repeats: int = 3) -> float:
    """Seconds one call takes on the GPU: ``make_calls()``'s calls (over distinct
    weight copies) captured into one CUDA graph, replayed, the median per call. On CPU:
    wall time of a plain loop."""
    import time

    calls = make_calls()
    for call in calls[:2]:
        call()
    if device.type != "cuda":
        started = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - started) / len(calls)
    return graph_replay_seconds(lambda: [call() for call in calls], device, repeats) / len(calls)


def speed_rows(device: torch.device, quick: bool, seed: int = 0) -> list[Row]:
    """Check 2's rows: each product against cuBLAS per row count, the stream at one row."""
    from pagedtree.kernels import dense_ops

    on_gpu = device.type == "cuda"
    if on_gpu:
        from pagedtree.diagnostics.kernel_bench import spin_up

        spin_up(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dtype = torch.bfloat16
    layers = QWEN_1_5B + (() if quick else LLAMA_8B) if on_gpu else TINY
    counts = TIMED_ROWS if on_gpu else (1, 16)
    note = "" if on_gpu else " (interpreter: not a timing)"
    rows = []
    for index, (name, n_out, k, gated, bias) in enumerate(layers):
        weight, b, config = _layer(name, n_out, k, gated, bias, dtype, device, gen)
        nbytes = weight.numel() * weight.element_size()
        copies = max(1, min(16, -(-L2_SPILL_BYTES // nbytes))) if on_gpu else 1
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        model = "qwen2.5-1.5b" if index < len(QWEN_1_5B) or not on_gpu else "llama-3-8b"
        for m in counts:
            x = torch.randn(m, k, generator=gen, device=device).to(dtype)

            def ours(w, x=x):
                return lambda: dense_ops.invariant_linear(x, w, b, config)

            def cublas(w, x=x):
                if not gated:
                    return lambda: F.linear(x, w, b)

                def run():
                    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
                    return F.silu(gate) * up
                return run

            mine = graph_seconds(lambda: [ours(w) for w in weights], device)
            theirs = graph_seconds(lambda: [cublas(w) for w in weights], device)
            figure = f"{theirs / mine:.2f}x cuBLAS's speed"
            if m == 1:
                figure += f"; {nbytes / mine / 1e9:.0f} GB/s"
            rows.append(Row(CHECK, f"{model} {name} {n_out}x{k}, {m} rows",
                            f"{mine * 1e6:.1f} us (cuBLAS {theirs * 1e6:.1f} us){note}", figure, INFO,
                            dict(rows=m, seconds=mine, cublas_seconds=theirs, weight_bytes=nbytes,
                                 split=dense_ops.uses_split(m, config, dense_ops.device_sms(device)))))
        del weights, weight
    rotary_counts = counts if on_gpu else counts[:1]  # the interpreter: the code path, once
    return rows + _rotary_epilogue_speed_rows(device, gen, rotary_counts, note) + _glue_rows(device, gen, note)


def _rotary_epilogue_speed_rows(device: torch.device, gen: torch.Generator, counts, note: str) -> list[Row]:
    """The q/k/v product rotating and storing in its epilogue (one head a column tile)
    against the product in its usual tiles and ``rotary_store`` launched after it."""
    from pagedtree.kernels import dense_ops

    on_gpu = device.type == "cuda"
    rows = []
    for m in counts:
        weight, bias, x, rotary = _rotary_case(device, gen, m)
        kind = dense_ops.device_kind(device)
        fused_config = dense_ops.qkv_config(rotary.num_heads, rotary.num_kv_heads, rotary.head_dim, x.shape[1],
                                            x.dtype, *kind)
        apart_config = dense_ops.matmul_config(fused_config.n_out, x.shape[1], False, x.dtype, *kind)
        nbytes = weight.numel() * weight.element_size()
        copies = max(1, min(16, -(-L2_SPILL_BYTES // nbytes))) if on_gpu else 1
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]

        def fused(w):
            return lambda: dense_ops.invariant_linear(x, w, bias, fused_config, rotary=rotary)

        def apart(w):
            def run():
                qkv = dense_ops.invariant_linear(x, w, bias, apart_config)
                dense_ops.rotary_store(qkv, rotary.positions, rotary.cos_sin, rotary.num_heads, rotary.num_kv_heads,
                                       rotary.head_dim, rotary.slot_mapping, rotary.key_cache, rotary.value_cache)
            return run

        one = graph_seconds(lambda: [fused(w) for w in weights], device)
        two = graph_seconds(lambda: [apart(w) for w in weights], device)
        rows.append(Row(CHECK, f"q/k/v + rotary + KV store, {m} rows: in the epilogue / two launches",
                        f"{one * 1e6:.1f} us (two launches {two * 1e6:.1f} us){note}", f"{two / one:.2f}x", INFO,
                        dict(rows=m, seconds=one, apart_seconds=two)))
        del weights, weight
    return rows


def _alternatives(device: torch.device, calls: dict[str, Callable[[], Callable[[], object]]]) -> dict[str, object]:
    """Seconds a call of each library's version takes (timed as ``graph_seconds``
    does), or why it could not run: each is made by its factory first (a compile, an
    import), and one that raises is reported, not fatal."""
    found: dict[str, object] = {}
    for name, factory in calls.items():
        try:
            call = factory()
            found[name] = graph_seconds(lambda call=call: [call] * 8, device)
        except Exception as exc:  # noqa: BLE001 - a library that does not run here is a finding
            found[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return found


def _versus(fused: float, eager: float, libraries: dict[str, object], note: str) -> tuple[str, str, dict]:
    """A glue row's result, figure and detail: ours against eager and each library."""
    timed = {name: t for name, t in libraries.items() if isinstance(t, float)}
    result = f"{fused * 1e6:.1f} us (eager {eager * 1e6:.1f} us" + "".join(
        f"; {name} {t * 1e6:.1f} us" if isinstance(t, float) else f"; {name} did not run"
        for name, t in libraries.items()) + f"){note}"
    figure = f"{eager / fused:.2f}x eager"
    if timed:
        best = min(timed, key=timed.get)
        figure += f", {timed[best] / fused:.2f}x {best}"
    return result, figure, dict(seconds=fused, eager_seconds=eager, libraries=libraries)


def _flashinfer_built(module: str) -> None:
    """Raise unless FlashInfer's ``module`` kernels are built already (ahead of time,
    or by an earlier run): the check does not wait for a compile."""
    import importlib

    spec = getattr(importlib.import_module(f"flashinfer.jit.{module}"), f"gen_{module}_module")()
    if not spec.is_compiled:
        raise RuntimeError(f"FlashInfer's {module} kernels are not built (they would compile now)")


def _library_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eager) -> dict:
    """FlashInfer's and Liger's fused add + RMSNorm and Inductor's fusion of the eager
    ops, where they run."""
    def flashinfer():
        from flashinfer.norm import fused_add_rmsnorm

        _flashinfer_built("norm")
        a, r = x.clone(), residual.clone()
        return lambda: fused_add_rmsnorm(a, r, weight, 1e-6)

    def liger():
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

        return lambda: fused_add_rms_norm_forward(x, residual, weight, 1e-6, 0.0, "llama")

    return {"torch.compile": lambda: torch.compile(eager), "FlashInfer": flashinfer, "Liger": liger}


def _library_rotary(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, heads: int, kv_heads: int,
                    head_dim: int, store, rotary) -> dict:
    """FlashInfer's and Liger's rotary and Inductor's fusion of the eager rotary, each
    then the same store, where they run."""
    def flashinfer():
        from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

        _flashinfer_built("rope")
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=qkv.device, dtype=torch.float32) / head_dim))
        angles = torch.arange(4096, device=qkv.device, dtype=torch.float32)[:, None] * inv[None, :]
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # FlashInfer's [positions, cos | sin], fp32
        q, k, _ = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)

        def run():
            apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, table, is_neox=True)
            store()
        return run

    def compiled():
        fused = torch.compile(rotary)

        def run():
            store(fused())
        return run

    def liger():
        from liger_kernel.ops.rope import rope_forward

        m = qkv.shape[0]
        q, k, _ = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        # Liger's layout: [batch, heads, tokens, head_dim], one sequence of the step's tokens.
        q4 = q.view(1, m, heads, head_dim).transpose(1, 2)
        k4 = k.view(1, m, kv_heads, head_dim).transpose(1, 2)

        def run():
            cos, sin = cos_sin[positions, :head_dim], cos_sin[positions, head_dim:]
            _, rotated = rope_forward(q4, k4, cos, sin, None, 1, None)[:2]
            store(rotated.transpose(1, 2).reshape(m, kv_heads, head_dim))
        return run

    return {"torch.compile": compiled, "FlashInfer": flashinfer, "Liger": liger}


def _glue_rows(device: torch.device, gen: torch.Generator, note: str) -> list[Row]:
    """The fused add + RMSNorm and rotary + KV store against their eager ops (1.5B
    shapes) and, on a GPU, against the libraries that fuse them: Inductor's fusion of
    the eager ops (``torch.compile``), FlashInfer's and Liger's kernels where they
    import."""
    from pagedtree.kernels import dense_ops
    from pagedtree.kernels import triton_ops
    from pagedtree.worker.models.decoder import RMSNorm, apply_rotary

    on_gpu = device.type == "cuda"
    hidden, heads, kv_heads, head_dim = (1536, 12, 2, 128) if on_gpu else (96, 4, 2, 32)
    dtype = torch.bfloat16
    rows = []
    norm = RMSNorm(hidden, 1e-6).to(device=device, dtype=dtype)
    cos_sin = torch.randn(4096, 2 * head_dim, generator=gen, device=device).to(dtype)
    cache = [torch.zeros(256, 16, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)]
    # On a GPU, 8 calls a graph; in the interpreter one call of each at one row count
    # runs the code paths (its timings mean nothing).
    calls = 8 if on_gpu else 1
    for m in (1, 64) if on_gpu else (1,):
        x = torch.randn(m, hidden, generator=gen, device=device).to(dtype)
        residual = torch.randn(m, hidden, generator=gen, device=device).to(dtype)

        def eager_norm():
            s = residual + x
            return norm(s)

        fused = graph_seconds(lambda: [lambda: dense_ops.add_rms_norm(x, norm.weight, 1e-6, residual)] * calls,
                              device)
        eager = graph_seconds(lambda: [eager_norm] * calls, device)
        libraries = _alternatives(device, _library_norm(x, residual, norm.weight, eager_norm)) if on_gpu else {}
        result, figure, detail = _versus(fused, eager, libraries, note)
        rows.append(Row(CHECK, f"add + RMSNorm, {m} rows x {hidden}", result, figure, INFO, detail))
        qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim, generator=gen, device=device).to(dtype)
        positions = torch.randint(0, 4096, (m,), generator=gen, device=device)
        slots = torch.randperm(256 * 16, generator=gen, device=device)[:m]

        def rotary_only():
            q, k, _ = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
            cos, sin = cos_sin[positions, :head_dim], cos_sin[positions, head_dim:]
            apply_rotary(q.view(m, heads, head_dim), cos, sin)
            return apply_rotary(k.view(m, kv_heads, head_dim), cos, sin)

        def store(k=None):
            _, rotated, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
            k = rotated.view(m, kv_heads, head_dim) if k is None else k
            triton_ops.store_kv(k, v.view(m, kv_heads, head_dim), cache[0], cache[1], slots, slots_checked=True)

        def eager_rotary():
            store(rotary_only())

        fused = graph_seconds(lambda: [lambda: dense_ops.rotary_store(qkv, positions, cos_sin, heads, kv_heads,
                                                                      head_dim, slots, cache[0], cache[1])] * calls,
                              device)
        eager = graph_seconds(lambda: [eager_rotary] * calls, device)
        libraries = _alternatives(device, _library_rotary(qkv, positions, cos_sin, heads, kv_heads, head_dim, store,
                                                          rotary_only)) if on_gpu else {}
        result, figure, detail = _versus(fused, eager, libraries, note)
        rows.append(Row(CHECK, f"rotary + KV store, {m} tokens, {heads}/{kv_heads} heads", result, figure, INFO,
                        detail))
    return rows


def dense_rows(device: torch.device, quick: bool, seed: int = 0) -> list[Row]:
    """The check's rows: bits first, then speed."""
    return invariance_rows(device, quick, seed) + speed_rows(device, quick, seed)
