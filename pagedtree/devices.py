"""Device names compared the way torch places tensors.

``torch.device("cuda")`` and ``torch.device("cuda:0")`` are unequal objects, yet a
tensor made on ``cuda`` reports ``cuda:0`` when 0 is the current CUDA device: they
are the same GPU. The engine resolves its device to an indexed one once
(``indexed_device``), and every device check goes through ``same_device``, so that
a caller's unindexed ``cuda`` never fails a check against its own tensors.
"""

from __future__ import annotations

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


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    # Asked only for an unindexed CUDA device: it initialises CUDA.
    return torch.cuda.current_device() if device.type == "cuda" else 0


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where unreadable): part of the key
    of every cost measured on a CPU."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""
