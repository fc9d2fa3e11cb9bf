"""glibc's malloc tuned for an inference loop on CPU.

Every decode step allocates and frees the same few multi-megabyte tensors (a batch's
logits and log-probabilities are 6 MB each at 32 x 49k fp32). glibc serves blocks
above its mmap threshold with a fresh ``mmap`` and returns them on free, and trims
the heap top back to the OS, so each step page-faults its buffers in again. Raising
the mmap threshold to glibc's maximum (32 MiB) and the trim threshold keeps those
pages mapped and reused: SmolLM2 at batch 32 ran 8% faster in fp32 (366 against 396
tokens/s, same machine, same sitting), and unseeded sampling took 5.0 ms a step
instead of 8.7. vLLM's CPU guide gets the same effect by preloading tcmalloc.

The cost: memory freed below the thresholds stays in the process (its peak RSS),
which an engine that repeats the same step sizes reuses anyway. Set
``PAGEDTREE_MALLOC_TUNING=0`` to leave malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 512 * 2**20

_tuned: bool | None = None


def tune_host_allocator() -> bool:
    """Apply the thresholds once per process; returns whether they are in effect
    (False off glibc or when ``PAGEDTREE_MALLOC_TUNING=0``)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("PAGEDTREE_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _tuned:
        logger.info("malloc: mmap threshold %d MiB, trim threshold %d MiB", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _tuned
