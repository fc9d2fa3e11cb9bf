"""Host memory of a CPU engine: glibc's malloc tuned for the decode loop, bounded oneDNN
caches, free heap handed back to the OS, and the figures ``/metrics`` reports.

**malloc thresholds.** Every decode step allocates and frees the same few
multi-megabyte tensors (a batch's logits and log-probabilities are 6 MB each at
32 x 49k fp32). glibc serves blocks above its mmap threshold with a fresh ``mmap``
and returns them on free, and trims the heap top back to the OS, so each step
page-faults its buffers in again. Raising the mmap threshold to glibc's maximum
(32 MiB) and the trim threshold to ``TRIM_THRESHOLD`` keeps those pages mapped and
reused: SmolLM2 at batch 32 ran 8% faster in fp32, and unseeded sampling took 5.0 ms
a step instead of 8.7. vLLM's CPU guide gets the same effect by preloading tcmalloc.
Set ``PAGEDTREE_MALLOC_TUNING=0`` to leave malloc alone.

**oneDNN caches.** oneDNN (behind every CPU linear layer) keeps a compiled primitive
per weight shape *and row count*, about 600 KiB each, in two caches of 1024 entries
by default (ideep's ``LRU_CACHE_CAPACITY`` and oneDNN's
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``). A server sees a new row count with nearly every
new mix of prompts, so both caches grew for hours towards about 1.2 GB. pagedtree
caps both at ``ONEDNN_CACHE_CAPACITY`` entries when it is imported (unless the
variables are already set): decoding and tree speculation ran as fast at 64 entries
as at 1024 (benchmarks/RESULTS.md, "Server memory"). The caps apply when pagedtree
is imported before the process runs its first oneDNN operation.

**Trimming.** ``trim_heap`` (glibc's ``malloc_trim``) returns free heap pages to the
OS, from every thread's arena (tokenizer threads that parsed a huge prompt keep their
pages otherwise). The engine thread calls it when it goes idle and, while busy, at
most once per ``BUSY_TRIM_INTERVAL`` seconds when the free heap is over
``MAX_FREE_HEAP`` (``HeapTrimmer``). A trim of 250 MB of fresh free heap took 23 ms,
one with nothing left to return 0.05 ms.

**Lazily zeroed tensors.** ``lazily_zeroed`` gives a zeroed tensor on an anonymous
mapping: the OS maps a page on its first write, so a KV cache sized for the whole
context is resident only where blocks were used (``torch.zeros`` writes every page:
the 1.5B's default 2 GiB cache was resident at load, before a token).

**What the figures mean.** ``mallinfo2`` counts a free chunk as free whether or not
a trim has handed its pages back (a trim returns the pages inside free chunks with
``madvise`` and leaves the chunks in place), so after a trim ``free`` can stay high
while the process's RSS falls: ``free`` bounds what a trim can return, RSS says what
is resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import time
from dataclasses import dataclass

import torch

from pagedtree.process_env import set_default

logger = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems.
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 512 * 2**20
# Entries of each oneDNN cache (a compiled primitive per weight shape and row count).
ONEDNN_CACHE_CAPACITY = 128
# Free heap the engine thread lets stay mapped while busy, and how often it checks.
MAX_FREE_HEAP = 256 * 2**20
BUSY_TRIM_INTERVAL = 60.0
# Seconds without work after which the engine thread trims (once per idle period).
IDLE_TRIM_DELAY = 1.0

_tuned: bool | None = None
_libc: ctypes.CDLL | None = None
_libc_loaded = False


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap both oneDNN primitive caches at ``capacity`` entries, unless the process
    environment already sets them (read once, at the first oneDNN operation)."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        set_default(name, str(capacity))


def _load_libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"))


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (with ``mallopt``, ``malloc_trim`` and ``mallinfo2``)."""
    global _libc, _libc_loaded
    if not _libc_loaded:
        _libc_loaded = True
        try:
            # glibc's soname first: ``find_library`` runs ``ldconfig -p`` in a child
            # process, a fork of an engine that may hold gigabytes (tools that add up a
            # process tree's resident memory count the child's shared pages again).
            libc = _load_libc()
            libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            libc.mallopt.restype = ctypes.c_int
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
            libc.malloc_trim.restype = ctypes.c_int
            libc.mallinfo2.restype = _MallInfo2
            _libc = libc
        except (OSError, AttributeError):  # not glibc (musl, macOS, Windows), or glibc < 2.33
            _libc = None
    return _libc


def tune_host_allocator() -> bool:
    """Apply the thresholds once per process; returns whether they are in effect
    (False off glibc or when ``PAGEDTREE_MALLOC_TUNING=0``)."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("PAGEDTREE_MALLOC_TUNING", "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    _tuned = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _tuned:
        logger.info("malloc: mmap threshold %d MiB, trim threshold %d MiB", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _tuned


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@dataclass(slots=True)
class HeapStats:
    """glibc's heap over all arenas (``mallinfo2``), in bytes."""

    in_use: int  # allocated and not freed (heap chunks)
    free: int  # in free chunks: at most what ``trim_heap`` can hand back (pages already returned count too)
    mmapped: int  # large blocks mapped one by one (returned on free)


def heap_stats() -> HeapStats | None:
    """The heap's figures now, or None off glibc."""
    libc = _glibc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return HeapStats(int(info.uordblks), int(info.fordblks), int(info.hblkhd))


def trim_heap() -> bool:
    """Return free heap pages of every arena to the OS (``malloc_trim(0)``); whether
    any were returned (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def trim_heap_over(free_bytes: int) -> bool:
    """``trim_heap`` when the heap's free chunks exceed ``free_bytes``; whether it trimmed.

    For loops that leave free heap behind faster than they reuse it (a load converting
    layer after layer): checking costs a ``mallinfo2`` walk, far less than a trim."""
    stats = heap_stats()
    if stats is None or stats.free <= free_bytes:
        return False
    return trim_heap()


class HeapTrimmer:
    """When the engine thread trims the heap: once each time it goes idle (after
    ``IDLE_TRIM_DELAY`` seconds without work), and while busy at most once per
    ``BUSY_TRIM_INTERVAL`` seconds, only when the free heap is over ``MAX_FREE_HEAP``."""

    def __init__(self, enabled: bool | None = None, busy_interval: float = BUSY_TRIM_INTERVAL,
                 max_free: int = MAX_FREE_HEAP):
        if enabled is None:
            enabled = os.environ.get("PAGEDTREE_MALLOC_TUNING", "1") != "0" and _glibc() is not None
        self.enabled = enabled
        self.busy_interval = busy_interval
        self.max_free = max_free
        self.num_trims = 0
        self._trimmed_since_work = True  # nothing to trim before the first request
        self._last_busy_check = time.monotonic()

    def worked(self) -> None:
        """The engine ran a step; trim if busy long enough with too much free heap."""
        self._trimmed_since_work = False
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_busy_check < self.busy_interval:
            return
        self._last_busy_check = now
        stats = heap_stats()
        if stats is not None and stats.free > self.max_free:
            self._trim()

    def idle(self) -> None:
        """The engine has had nothing to do for ``IDLE_TRIM_DELAY`` seconds."""
        if self.enabled and not self._trimmed_since_work:
            self._trim()
        self._trimmed_since_work = True

    def _trim(self) -> None:
        started = time.perf_counter()
        trim_heap()
        self.num_trims += 1
        logger.debug("malloc_trim in %.1f ms", (time.perf_counter() - started) * 1e3)


def release_mapped_file_pages(path: str) -> int:
    """Drop this process's resident pages of every mapping of the file ``path``
    (``madvise(MADV_DONTNEED)``); returns how many mappings were found.

    For a library that maps a file, copies what it needs into memory of its own and
    keeps the mapping: the pages it read stay resident, counted in the process's RSS,
    though nothing reads them again. A page that is read again comes back from the
    file (which stays readable while mapped, even deleted), so this changes no data;
    a page written through a private mapping would lose the write, so callers use it
    only on mappings the library does not write. Linux only (elsewhere: 0).
    """
    try:
        with open("/proc/self/maps") as maps:
            ranges = []
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").removesuffix(" (deleted)") == path:
                    start, end = fields[0].split("-")
                    ranges.append((int(start, 16), int(end, 16)))
    except OSError:  # no /proc (not Linux)
        return 0
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None:
        return 0
    libc = _glibc() or _load_libc()
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    for start, end in ranges:
        madvise(start, end - start, advice)
    return len(ranges)


def file_mapping(array):
    """The ``np.memmap`` of a file that the numpy array ``array`` is (a view of), or
    None: memory of its own."""
    base = array
    while base is not None and getattr(base, "_mmap", None) is None:
        base = getattr(base, "base", None)
    return base


def release_file_mapping(array) -> bool:
    """Drop the resident pages of the file mapping that ``array`` is a view of
    (``madvise(MADV_DONTNEED)`` over the whole mapping); returns whether it found one.
    The pages stay in the page cache and any view of the mapping stays valid (a page
    read again comes back from the file). Memory of its own is left alone: advice
    there would lose data."""
    mapping = file_mapping(array)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    mapping._mmap.madvise(mmap.MADV_DONTNEED)
    return True


# Transparent huge pages are 2 MiB on x86-64 (and most Linux machines).
HUGE_PAGE = 2 * 2**20


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of ``[address, address + length)``
    with transparent huge pages (``madvise(MADV_HUGEPAGE)``) as it is first written:
    a stream over a gigabyte of weights then misses the TLB 512 times less often.
    Call it before the memory is touched. Returns whether the kernel took the advice
    (False off Linux, with THP off, or for a range under 2 MiB)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if advice is None or end <= start:
        return False
    try:
        libc = _glibc() or _load_libc()
    except OSError:
        return False
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(start, end - start, advice) == 0


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages become resident when first written (see module
    docstring)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, mapped on first touch
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
