"""Host memory: malloc tuning, bounded oneDNN caches, heap figures and trimming."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import pytest

from pagedtree import host_memory as host_allocator
from pagedtree.host_memory import HeapStats, HeapTrimmer

GLIBC = platform.libc_ver()[0] == "glibc"
SNIPPET = """
import ctypes, sys
from pagedtree.host_memory import tune_host_allocator
print(tune_host_allocator(), tune_host_allocator())
"""


def _run(code: str, **env_values: str | None) -> str:
    env = dict(os.environ)
    for key, value in env_values.items():
        env.pop(key, None)
        if value is not None:
            env[key] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.slow
def test_tuning_applies_on_glibc_and_can_be_switched_off():
    if GLIBC:
        assert _run(SNIPPET, PAGEDTREE_MALLOC_TUNING=None) == "True True"
    assert _run(SNIPPET, PAGEDTREE_MALLOC_TUNING="0") == "False False"


def test_cpu_runner_tunes_malloc(tiny_llama):
    from pagedtree import LLM

    LLM(str(tiny_llama.path), dtype="float32", device="cpu")  # a CPU runner, on any machine
    assert host_allocator._tuned is GLIBC


# 300 products with as many row counts: oneDNN compiles (and by default caches, up to
# 1024 of them) a primitive per row count, about 600 KiB each.
ONEDNN_SNIPPET = """
import torch
import pagedtree  # caps both oneDNN caches unless the environment sets them
from pagedtree.host_memory import heap_stats
from pagedtree.worker.models.linear import Linear
layer = Linear(256, 128, bias=False)
layer.pack_for_cpu()
for rows in range(1, 4):
    layer(torch.randn(rows, 256))
before = heap_stats()
with torch.inference_mode():
    for rows in range(4, 304):
        layer(torch.randn(rows, 256))
after = heap_stats()
print((after.in_use + after.mmapped - before.in_use - before.mmapped) / 2**20)
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="heap figures come from glibc")
def test_onednn_caches_are_bounded_when_pagedtree_is_imported():
    """A server sees a new row count with nearly every new mix of prompts: with
    oneDNN's default caches the heap grew by ~600 KiB per row count, for hours."""
    bounded = float(_run(ONEDNN_SNIPPET, LRU_CACHE_CAPACITY=None, ONEDNN_PRIMITIVE_CACHE_CAPACITY=None))
    unbounded = float(_run(ONEDNN_SNIPPET, LRU_CACHE_CAPACITY="1024", ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024"))
    assert unbounded > 100, unbounded  # the growth the bound removes is real here
    assert bounded < unbounded / 2, (bounded, unbounded)
    # The cap stays below what 300 row counts would take (128 entries of each cache).
    assert bounded < 0.6 * host_allocator.ONEDNN_CACHE_CAPACITY * 2


def test_the_environment_sets_the_caps_first(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    host_allocator.bound_onednn_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(host_allocator.ONEDNN_CACHE_CAPACITY)


# 128 MiB of 64 KiB blocks among small ones that stay (the fragmentation a server
# has), freed, then trimmed. In a process of its own so that other tests' heap does
# not blur the figures.
TRIM_SNIPPET = """
from pagedtree.host_memory import heap_stats, trim_heap, tune_host_allocator
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
print(tune_host_allocator())
stats = heap_stats()
assert stats.in_use > 0 and stats.free >= 0 and stats.mmapped >= 0, stats
blocks, kept = [], []
for i in range(2048):
    blocks.append(bytearray(64 * 1024))
    if i % 16 == 0:
        kept.append(bytearray(1024))  # served by malloc, not by Python's small-object pool
del blocks
before = heap_stats(), rss()
trim_heap()
after = heap_stats(), rss()
print(before[0].free, before[1] - after[1], after[0].free)
"""


@pytest.mark.slow
@pytest.mark.skipif(not GLIBC, reason="mallinfo2 and malloc_trim are glibc's")
def test_heap_figures_and_trimming():
    tuned, free_before, returned, free_after = _run(TRIM_SNIPPET, PAGEDTREE_MALLOC_TUNING=None).split()
    assert tuned == "True"  # below its trim threshold, glibc keeps freed heap: trimming has work to do
    assert int(free_before) > 100 * 2**20
    assert int(returned) > 100 * 2**20  # the RSS fell by the freed blocks
    # mallinfo2 still counts the returned pages inside free chunks as free: "free" is an
    # upper bound on what a trim can return, not a resident figure.
    assert int(free_after) <= int(free_before)


def test_the_trimmer_trims_once_per_idle_period_and_rarely_when_busy(monkeypatch):
    calls = []
    free = [0]
    monkeypatch.setattr(host_allocator, "trim_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(host_allocator, "heap_stats", lambda: HeapStats(0, free[0], 0))
    trimmer = HeapTrimmer(enabled=True, busy_interval=0.0, max_free=100)
    trimmer.idle()
    assert trimmer.num_trims == 0  # nothing ran since start
    trimmer.worked()  # free heap under the bound: no trim while busy
    assert trimmer.num_trims == 0
    trimmer.idle()
    trimmer.idle()
    assert trimmer.num_trims == 1  # once per idle period
    free[0] = 1000
    trimmer.worked()
    assert trimmer.num_trims == 2  # busy with too much free heap
    trimmer = HeapTrimmer(enabled=True, busy_interval=3600.0, max_free=100)
    trimmer.worked()
    assert trimmer.num_trims == 0  # checked at most once per interval
    assert not HeapTrimmer(enabled=False).enabled


def _resident_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc")
def test_mapped_file_pages_are_released_and_read_back_unchanged(tmp_path):
    """The pages of a mapped file that were read leave the resident set, and reading
    them again gives the file's bytes (a private, writable mapping, as ONNX Runtime
    maps a model's external data)."""
    import mmap

    path = str(tmp_path / "weights.bin")
    data = os.urandom(8 * 2**20)
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        assert mapping[:] == data  # every page read: resident
        assert _resident_kib(path) >= 7 * 1024
        assert host_allocator.release_mapped_file_pages(path) == 1
        assert _resident_kib(path) < 1024
        assert mapping[:] == data
        assert host_allocator.release_mapped_file_pages(str(tmp_path / "other.bin")) == 0
    finally:
        mapping.close()


def test_huge_page_advice_covers_only_whole_aligned_huge_pages():
    import mmap as mmap_module

    from pagedtree.host_memory import HUGE_PAGE, advise_huge_pages

    region = mmap_module.mmap(-1, 3 * HUGE_PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert not advise_huge_pages(base + 1, HUGE_PAGE)  # no whole aligned 2 MiB inside
    advised = advise_huge_pages(base, 3 * HUGE_PAGE)
    assert advised == (hasattr(mmap_module, "MADV_HUGEPAGE") and _thp_allowed())
    region[:4] = b"abcd"  # the memory is ordinary memory either way
    assert region[:4] == b"abcd"
    del base
    region.close()


def _thp_allowed() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False
