"""The numba CPU kernels cache their compiled code in one folder per user
(``pagedtree/numba_cache.py``), so a fresh clone or install does not compile them again."""

from __future__ import annotations

import pytest

numba = pytest.importorskip("numba")

from numba.core import caching  # noqa: E402

from pagedtree.kernels import cpu_attention, cpu_elementwise  # noqa: E402
from pagedtree.numba_cache import cache_root, use_shared_cache  # noqa: E402


def _shared_locator():
    return next(cls for cls in caching.CacheImpl._locator_classes if getattr(cls, "shared_by_pagedtree", False))


def test_pagedtrees_kernels_cache_in_the_shared_folder():
    assert use_shared_cache()  # installed once, idempotent
    assert sum(getattr(cls, "shared_by_pagedtree", False) for cls in caching.CacheImpl._locator_classes) == 1
    for kernel in (cpu_attention.paged_attention_kernel, cpu_elementwise.add_rms_norm_kernel):
        assert kernel._cache._cache_path == str(cache_root())
        assert type(kernel._cache._impl._locator).__name__ == "SharedCacheLocator"


def test_functions_outside_pagedtree_keep_numbas_place(tmp_path, monkeypatch):
    def outside():  # defined in the tests, not in the package
        return 1

    assert _shared_locator().from_function(outside, __file__) is None
    monkeypatch.setenv("PAGEDTREE_CACHE", str(tmp_path))
    inside = _shared_locator().from_function(cpu_attention.paged_attention_kernel.py_func, cpu_attention.__file__)
    assert inside.get_cache_path() == str(tmp_path / "numba") and (tmp_path / "numba").is_dir()
    # The stamp is numba's: a hash of the source file's contents, not its path or time.
    assert isinstance(inside.get_source_stamp(), bytes) and len(inside.get_source_stamp()) == 32
