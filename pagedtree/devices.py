"""Device names compared the way torch places tensors.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` are unequal objects, yet a
tensor made on ``cuda`` reports ``cuda:0`` when 0 is the current CUDA device: they
are the same GPU. The engine resolves its device to an indexed one once
(``indexed_device``), and every device check goes through ``same_device``, so that
a caller's unindexed ``cuda`` never fails a check against its own tensors.
"""

from __future__ import annotations

import functools
import hashlib
import os

import torch


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with an index: an unindexed ``cuda`` becomes the current CUDA device
    (where torch puts a tensor made on ``cuda``); any other device is returned as is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` are the same device, an unindexed ``cuda`` meaning the
    current CUDA device (``cuda`` and ``cuda:0`` are one GPU while 0 is current) and
    ``cpu`` and ``cpu:0`` one CPU."""
    a, b = torch.device(a), torch.device(b)
    if a == b:
        return True  # the common case, without asking CUDA which device is current
    return a.type == b.type and _index(a) == _index(b)


def cuda_kind(device: torch.device) -> tuple[int, int]:
    """``(SMs, compute capability)`` of CUDA ``device``, e.g. ``(132, 90)`` for an H100
    (asked of CUDA once per GPU: launch code reads it on every launch)."""
    return _cuda_kind(_index(torch.device(device)))


@functools.cache
def _cuda_kind(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, 10 * props.major + props.minor


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    # Asked only for an unindexed CUDA device: it initialises CUDA.
    return torch.cuda.current_device() if device.type == "cuda" else 0


# Feature flags the engine treats as absent, comma-separated, a trailing "*" matching
# a prefix ("avx512*,amx*"): scripts/emulate_avx2.sh sets it so that, with the
# libraries' own ISA limits, an AVX-512 machine decides as an AVX2 one would.
HIDE_CPU_FLAGS_ENV = "PAGEDTREE_HIDE_CPU_FLAGS"


def _cpuinfo_field(name: str) -> str:
    """The first ``name : value`` of /proc/cpuinfo ("" where unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where unreadable)."""
    return _cpuinfo_field("model name")


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; "" where
    unreadable)."""
    return _cpuinfo_field("vendor_id")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (none where unreadable), less those
    ``PAGEDTREE_HIDE_CPU_FLAGS`` hides."""
    hidden = [h.strip().lower() for h in os.environ.get(HIDE_CPU_FLAGS_ENV, "").split(",") if h.strip()]

    def shown(flag: str) -> bool:
        return not any(flag.startswith(h[:-1]) if h.endswith("*") else flag == h for h in hidden)

    return frozenset(f for f in _cpuinfo_field("flags").split() if shown(f))


def cpu_identity() -> str:
    """The CPU's model name and a digest of its instruction-set flags: the key of every
    cost measured on a CPU. Virtual machines of different generations may share a model
    name ("AMD EPYC" with and without AVX-512); their kernels and costs differ."""
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c", "sse", "ssse")))
    return f"{cpu_model_name()} [{hashlib.md5(' '.join(isa).encode()).hexdigest()[:12]}]"
