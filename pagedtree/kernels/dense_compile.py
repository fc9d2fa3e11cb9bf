"""Compile the dense kernels (``dense_kernels``) for NVIDIA GPUs on a machine that has none.

The same method as ``cuda_compile`` (a fake driver reporting a CUDA target, the real
launchers called on CPU tensors with the kernels swapped for compile-only proxies,
resources read from the cubin): every specialisation a model's forward asks for, at
a decode's row count (K-groups spread over programs) and a batch of trees' (one
program walks them all), for the real shapes of the Qwen2.5 1.5B and 0.5B pair and of
a Llama-3-8B. Run it in a process without ``TRITON_INTERPRET``:

    python -m pagedtree.kernels.dense_compile --arch 80,90

It exits with status 1 when a kernel fails to compile or a 16-bit kernel spills.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator

import torch

from pagedtree.kernels.cuda_compile import ARCH_SMS, DTYPES, FakeCudaDriver, KernelBuild, _CompileOnly, _tools, \
    make_build, overlapping_launches, problems

# (name, hidden, intermediate, heads, kv heads, head dim, vocabulary)
MODELS = {
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151_936),
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151_936),
    "llama-3-8b": (4096, 14_336, 32, 8, 128, 128_256),
}
ROWS = (1, 2080)  # a decode (split K-groups) and 32 trees of 64 nodes with their roots (one program each)


@contextlib.contextmanager
def compile_only(capability: int, overlap: bool = False) -> Iterator[list]:
    """Within: Triton targets ``sm_<capability>`` and the dense launchers compile instead
    of launching (``overlap``: as they launch when launches overlap). Yields the list
    of ``(jit function, compiled kernel, constexprs)``."""
    from triton.runtime import driver

    from pagedtree.kernels import dense_kernels as D
    from pagedtree.kernels import dense_ops

    if dense_ops.INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET is set: run the compile check in a process without it")
    sink: list = []
    names = [n for n in dir(D) if n.endswith("_kernel") and hasattr(getattr(D, n), "warmup")]
    saved = {n: getattr(D, n) for n in names}
    saved_check, saved_kind = dense_ops.check_kernel_device, dense_ops.device_kind
    saved_driver = driver._active
    driver.set_active(FakeCudaDriver(capability))
    try:
        for n in names:
            setattr(D, n, _CompileOnly(saved[n], sink))
        dense_ops.check_kernel_device = lambda device: None  # CPU tensors stand in for CUDA ones
        dense_ops.device_kind = lambda device: (ARCH_SMS[capability], capability)
        with overlapping_launches(capability, overlap):
            yield sink
    finally:
        for n, fn in saved.items():
            setattr(D, n, fn)
        dense_ops.check_kernel_device, dense_ops.device_kind = saved_check, saved_kind
        driver._active = saved_driver


def _launch_model(arch: int, dtype: torch.dtype, model: str, rows: int) -> None:
    """One layer's launches and the LM head's, as a forward over ``rows`` tokens asks."""
    from pagedtree.kernels import dense_ops

    hidden, inter, heads, kv_heads, head_dim, vocab = MODELS[model]
    sms = ARCH_SMS[arch]
    x = torch.empty(rows, hidden, dtype=dtype)
    positions, slots = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
    cos_sin = torch.empty(4096, 2 * head_dim, dtype=dtype)
    cache = torch.empty(64, 16, kv_heads, head_dim, dtype=dtype)
    qkv = dense_ops.qkv_config(heads, kv_heads, head_dim, hidden, dtype, sms, arch)
    # The q/k/v product rotating and storing in its epilogue (and, for the backends
    # that store keys themselves, rotating only), then the layer's other products.
    for rotary in (dense_ops.RotaryEpilogue(positions, cos_sin, heads, kv_heads, head_dim, slots, cache, cache),
                   dense_ops.RotaryEpilogue(positions, cos_sin, heads, kv_heads, head_dim)):
        dense_ops.invariant_linear(x, torch.empty(qkv.n_out, hidden, dtype=dtype), torch.empty(qkv.n_out, dtype=dtype),
                                   qkv, rotary=rotary)
    for n_out, k, gated, bias in ((hidden, heads * head_dim, False, False), (inter, hidden, True, False),
                                  (hidden, inter, False, False), (vocab, hidden, False, False)):
        config = dense_ops.matmul_config(n_out, k, gated, dtype, sms, arch)
        weight = torch.empty((2 if gated else 1) * n_out, k, dtype=dtype)
        dense_ops.invariant_linear(torch.empty(rows, k, dtype=dtype), weight,
                                   torch.empty(weight.shape[0], dtype=dtype) if bias else None, config)
    dense_ops.add_rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6, torch.empty_like(x))
    dense_ops.add_rms_norm(x, torch.empty(hidden, dtype=dtype), 1e-6)
    # rotary_store: the head dims the product's epilogue does not take (and the check's timing).
    dense_ops.rotary_store(torch.empty(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype), positions, cos_sin,
                           heads, kv_heads, head_dim, slots, cache, cache)


def compile_all(arch: int, dtypes=tuple(DTYPES), models=tuple(MODELS), rows=ROWS,
                overlap: bool = False) -> list[KernelBuild]:
    """Every dense kernel specialisation of those models, dtypes and row counts, compiled
    for ``sm_<arch>`` (one entry per distinct specialisation; ``overlap``: as launched
    when launches overlap)."""
    tools = _tools()
    builds: list[KernelBuild] = []
    seen: set[str] = set()
    for dname in dtypes:
        for model in models:
            for m in rows:
                case = f"{dname} {model} rows {m}"
                with compile_only(arch, overlap) as sink:
                    try:
                        _launch_model(arch, DTYPES[dname], model, m)
                    except Exception as exc:  # noqa: BLE001 - recorded; the other cases go on
                        builds.append(KernelBuild("?", case, arch, dname, error=f"{type(exc).__name__}: {exc}"))
                for fn, compiled, kwargs in sink:
                    key = str(compiled.metadata.hash)
                    if key in seen:
                        continue
                    seen.add(key)
                    builds.append(make_build(fn, compiled, kwargs, case, arch, dname, tools))
    return builds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"of {', '.join(DTYPES)}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--overlap", action="store_true",
                        help="compile the launches as they are when launches overlap (PAGEDTREE_PDL=1; sm_90 and "
                             "later), each checked to wait before it touches memory")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    builds: list[KernelBuild] = []
    for arch in (int(a) for a in args.arch.split(",") if a):
        if arch not in ARCH_SMS:
            parser.error(f"unsupported arch {arch}; known: {', '.join(map(str, ARCH_SMS))}")
        builds += compile_all(arch, tuple(args.dtypes.split(",")), tuple(args.models.split(",")),
                              overlap=args.overlap)
    bad = problems(builds)
    print(f"{len(builds)} dense kernel specialisations compiled for sm_{'/sm_'.join(args.arch.split(','))} in "
          f"{time.perf_counter() - started:.0f} s; {len(bad)} problems")
    for b in builds:
        print(f"  sm_{b.arch} {b.kernel:28s} {b.case:34s} warps {b.num_warps} stages {b.num_stages} "
              f"regs {b.registers:3d} smem {b.shared_bytes:6d} spills {b.spill_stores}")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
