"""Long prompt chunks' attention through AMD's zentorch library on AVX-512 CPUs.

The CPU backend sends prompt chunks longer than ``SMALL_QUERY_LEN`` tokens to one
scaled-dot-product attention call per chunk, in fp32 whatever the cache's dtype (a
row's result then does not depend on the rows beside it beyond fp32 rounding; see
``attention.torch_backend.paged_attention``). torch's CPU flash kernel runs that at
100-160 GFLOP/s on the 2-core AVX-512 machine; zentorch's (``zentorch_sdpa``, the
ZenDNN plugin for PyTorch, which vLLM's CPU backend also calls) at 170-320, with the
same accuracy against a float64 reference (a 1,024-token causal prompt of the
Qwen2.5 1.5B's 12/2 heads: 12.0 against 23.4 ms a layer). At 16 prompts of 1,024
tokens that attention was about 10 s (16 x 28 layers x 23.4 ms) of a server's 60 s
to the first tokens.

Only the library's op is loaded (``torch.ops.load_library`` on its
``libzentorch.so``), not its Python package, which imports TorchDynamo and holds
about 190 MiB more. It is used where all of this holds, checked once a process:

- the CPU is AMD's (the library is AMD's and was measured on AMD EPYC only; other
  CPUs keep torch's kernel) with AVX-512F (``devices.cpu_flags``, so
  ``scripts/emulate_avx2.sh`` keeps it off), and ``PAGEDTREE_ZENTORCH`` is not ``0``;
- zentorch is installed for this torch's minor version (``scripts/setup.sh`` pins
  the build for torch 2.13 on x86-64);
- its results agree with torch's on a small GQA case, causal and masked, within fp32
  rounding, and it is the faster of the two on a 512-token causal chunk.

Otherwise ``load`` returns None and the backend keeps torch's kernel; a call the op
refuses later (a shape the self-check did not cover) is served by torch's kernel,
which serves every call of that wrapper from then on. The engine
calls it for 16-bit caches only: an fp32 engine, the one whose outputs match
transformers', keeps transformers' own attention kernel.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedtree.devices import cpu_flags, cpu_vendor

logger = logging.getLogger("pagedtree")

ENV = "PAGEDTREE_ZENTORCH"
# Agreement with torch's kernel on the self-check (fp32 inputs of unit scale).
_TOLERANCE = 1e-5

_loaded = None  # the op, once checked
_checked = False
_lock = threading.Lock()  # engines in threads of one process check once
_why_not = ""


class ZenSdpa:
    """``zentorch_sdpa`` with ``F.scaled_dot_product_attention``'s arguments as the
    CPU backend passes them: ``[B, H, Q, D]`` queries, ``[B, H_kv, K, D]`` keys and
    values (grouped-query attention by head count), and a boolean ``[B, 1, Q, K]``
    mask (True = may attend) or ``is_causal``."""

    def __init__(self, op):
        self._op = op
        self._failed = False  # a call the op refused: torch's kernel from then on
        # The op takes an additive mask of the query's dtype. Every layer of a step
        # passes the same plan's mask: it is converted once, at the first layer.
        self._mask_source: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> torch.Tensor:
        if not self._failed:
            mask = None
            if attn_mask is not None:
                if attn_mask is not self._mask_source or self._mask is None or self._mask.dtype != query.dtype:
                    self._mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
                    self._mask_source = attn_mask
                mask = self._mask
            try:
                # The op pairs query heads with key heads by their counts (no enable_gqa).
                return self._op(query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)[0]
            except RuntimeError as exc:  # a shape the self-check did not cover: never fail the step
                self._failed = True
                self.forget()
                logger.warning("zentorch_sdpa refused a call (%s); torch's attention from now on", exc)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa or query.shape[-3] != key.shape[-3])

    def forget(self) -> None:
        """Drop the converted mask (a new step brings its own plan)."""
        self._mask_source = self._mask = None


def _library() -> Path | None:
    """zentorch's op library for this torch, or None (and why, in ``_why_not``)."""
    global _why_not
    spec = importlib.util.find_spec("zentorch")
    if spec is None or not spec.submodule_search_locations:
        _why_not = "zentorch is not installed"
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    library, build_info = folder / "libzentorch.so", folder / "_build_info.py"
    try:
        built_for = re.search(r'__torchversion__\s*=\s*"([^"]+)"', build_info.read_text()).group(1)
    except (OSError, AttributeError):
        _why_not = f"zentorch at {folder} says no torch version"
        return None
    if built_for.split(".")[:2] != torch.__version__.split(".")[:2]:
        _why_not = f"zentorch was built for torch {built_for}, this is {torch.__version__}"
        return None
    if not library.is_file():
        _why_not = f"zentorch at {folder} has no libzentorch.so"
        return None
    return library


def _agrees(sdpa: ZenSdpa) -> bool:
    """Whether the op gives torch's results on a small grouped-query case."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 64, generator=generator)
    k, v = (torch.randn(2, 2, 56, 64, generator=generator) for _ in range(2))
    mask = torch.ones(2, 1, 40, 56, dtype=torch.bool).tril(diagonal=16)
    for causal, kv, m in ((True, slice(0, 40), None), (False, slice(0, 56), mask)):
        ours = sdpa(q, k[:, :, kv], v[:, :, kv], attn_mask=m, is_causal=causal, scale=0.125)
        theirs = F.scaled_dot_product_attention(q, k[:, :, kv], v[:, :, kv], attn_mask=m, is_causal=causal,
                                                scale=0.125, enable_gqa=True)
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, atol=_TOLERANCE, rtol=0):
            return False
    return True


def _faster(sdpa: ZenSdpa) -> tuple[bool, float, float]:
    """Whether the op beats torch's kernel on a 512-token causal chunk (12/2 heads,
    head dim 128, fp32); the two timings in seconds (best of 2 each)."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 12, 512, 128, generator=generator)
    k, v = (torch.randn(1, 2, 512, 128, generator=generator) for _ in range(2))
    calls = {"zentorch": lambda: sdpa(q, k, v, is_causal=True),
             "torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    best = {}
    for name, call in calls.items():
        call()  # first call: the library's own one-time work
        times = []
        for _ in range(2):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        best[name] = min(times)
    return best["zentorch"] < best["torch"], best["zentorch"], best["torch"]


def library_op():
    """The installed library's ``zentorch_sdpa`` op, loaded, without the checks of
    ``load`` (None where zentorch is not installed for this torch or will not load;
    ``why_not`` then says why)."""
    global _why_not
    library = _library()
    if library is None:
        return None
    try:
        if not hasattr(torch.ops.zentorch, "zentorch_sdpa"):
            torch.ops.load_library(str(library))
        return torch.ops.zentorch.zentorch_sdpa
    except (OSError, RuntimeError, AttributeError) as exc:  # a library that will not load here
        _why_not = f"zentorch's library failed to load: {exc}"
        return None


def load() -> ZenSdpa | None:
    """zentorch's attention where it is usable and faster here, else None (``why_not``
    then says why). The checks run once a process; each call returns a new wrapper
    (each backend converts its own steps' masks)."""
    global _checked, _loaded
    with _lock:
        if not _checked:
            _loaded = _checked_op()
            _checked = True
        return None if _loaded is None else ZenSdpa(_loaded)


def _checked_op():
    """The op where every check of the module docstring passes, else None (and
    ``_why_not`` says which failed)."""
    global _why_not
    if os.environ.get(ENV, "1") == "0":
        _why_not = f"{ENV}=0"
        return None
    if cpu_vendor() != "AuthenticAMD":
        _why_not = f"the CPU is not AMD's ({cpu_vendor() or 'unknown vendor'})"
        return None
    if "avx512f" not in cpu_flags():
        _why_not = "the CPU has no AVX-512"
        return None
    op = library_op()
    if op is None:
        return None
    try:
        sdpa = ZenSdpa(op)
        if not _agrees(sdpa):
            _why_not = "zentorch_sdpa disagreed with torch's attention on the self-check"
            return None
        faster, ours, theirs = _faster(sdpa)
    except RuntimeError as exc:  # torch's own kernel failing on the checks' inputs
        _why_not = f"the self-check failed here: {exc}"
        return None
    if sdpa._failed:  # the wrapper fell back to torch's kernel during the checks
        _why_not = "zentorch_sdpa refused the self-check's calls"
        return None
    if not faster:
        _why_not = f"zentorch_sdpa was slower here ({ours * 1e3:.1f} against {theirs * 1e3:.1f} ms)"
        return None
    logger.info("long prompt chunks attend through zentorch_sdpa (%.1f against torch's %.1f ms on a 512-token chunk)",
                ours * 1e3, theirs * 1e3)
    return op


def why_not() -> str:
    """Why ``load`` returned None (empty before it ran, or when it loaded)."""
    return _why_not
