"""Programmatic dependent launch: a kernel's programs start while the kernel before it ends.

A batch-1 step is a chain of about 250 small kernels (8-9 a layer), and on a GPU each
boundary costs the next kernel's launch, its programs' start and their first loads
while the SMs idle. On sm_90 and later a kernel launched with the programmatic
stream serialization attribute (Triton's ``launch_pdl``) may begin once every program
of the kernel before it has signalled (``griddepcontrol.launch_dependents``); its
programs then wait (``griddepcontrol.wait``) until that kernel has finished and its
writes are visible. CUDA graphs keep the edges, so a captured step overlaps too.

The rule every kernel launched this way keeps: before its wait it writes nothing and
reads nothing an earlier kernel wrote; it may compute indices and (the products, in
their split form) prefetch its weight slice into L2, which no kernel writes. Every
program waits, early-exiting ones included, so a kernel never finishes before the
one it follows, and the order is transitive down the chain. Each program signals
right after its wait: the next kernel can then launch its programs in the slots this
one frees, and they wait in turn.

Off unless ``PAGEDTREE_PDL=1`` (read when pagedtree is imported) or switched on
with :func:`overlapping`, and only on CUDA devices of compute capability 9.0 or more
outside the interpreter; elsewhere the kernels compile without the instructions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from pagedtree.devices import cuda_kind
from pagedtree.kernels import triton_kernels
from pagedtree.kernels.triton_kernels import INTERPRETED

ENV = "PAGEDTREE_PDL"
MIN_CAPABILITY = 90


def _from_env() -> bool:
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


_enabled = _from_env()


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched this way (CUDA, sm_90 or later,
    compiled kernels, a Triton with grid dependency control)."""
    if device.type != "cuda" or INTERPRETED or triton_kernels.gdc_wait is None:
        return False
    return cuda_kind(device)[1] >= MIN_CAPABILITY


def active(device: torch.device) -> bool:
    """Whether launches on ``device`` overlap now (switched on and supported)."""
    return _enabled and supported(device)


def launch_options(device: torch.device) -> dict:
    """The kernel arguments of a launch on ``device``: ``PDL`` (the kernel's wait and
    signal) and, when it is on, Triton's ``launch_pdl``. Pass them to every kernel
    that takes ``PDL``; the launch attribute and the wait go together."""
    return {"PDL": True, "launch_pdl": True} if active(device) else {"PDL": False}


def enabled() -> bool:
    """Whether overlapping launches is switched on (supported or not)."""
    return _enabled


@contextlib.contextmanager
def overlapping(on: bool = True) -> Iterator[None]:
    """Within: launches overlap (``on``) or not, whatever ``PAGEDTREE_PDL`` says. A
    CUDA graph keeps the launches of its capture."""
    global _enabled
    saved = _enabled
    _enabled = bool(on)
    try:
        yield
    finally:
        _enabled = saved
