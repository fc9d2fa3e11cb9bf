"""Where the numba CPU kernels' compiled code is cached: one folder per user, shared
by every checkout and install of the same source.

numba already checks a cached kernel against a hash of its source file, but keeps
the cache next to the file (its ``__pycache__``): a fresh clone or a new install
compiles every kernel again, 10-30 s of a first engine start on two cores. Here the
cache of pagedtree's own kernels lives in ``$PAGEDTREE_CACHE/numba`` (by default
``~/.cache/pagedtree/numba``), as Triton keeps its kernels in ``~/.triton``; a kernel
whose source changed misses there and is compiled again.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def cache_root() -> Path:
    """The folder of the shared cache."""
    return Path(os.environ.get("PAGEDTREE_CACHE", Path.home() / ".cache" / "pagedtree")) / "numba"


def use_shared_cache() -> bool:
    """Make numba cache the kernels defined in pagedtree's files in ``cache_root()``
    (for the ``njit(cache=True)`` decorations that come after; idempotent). Returns
    whether it could: the locator hooks are numba's own (``numba.core.caching``);
    where they are missing, numba keeps its default place."""
    try:
        from numba.core import caching

        locator_base, source_backed = caching._CacheLocator, caching._SourceFileBackedLocatorMixin
        locators = caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):
        return False
    if any(getattr(cls, "shared_by_pagedtree", False) for cls in locators):
        return True

    class SharedCacheLocator(source_backed, locator_base):
        """numba's source-file locator (the stamp: a hash of the file's contents),
        with the cache in ``cache_root()`` for files inside the pagedtree package."""

        shared_by_pagedtree = True

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(cache_root())

        def get_cache_path(self):
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                inside = Path(py_file).resolve().is_relative_to(PACKAGE)
            except OSError:
                return None
            return super().from_function(py_func, py_file) if inside else None

    locators.insert(0, SharedCacheLocator)
    return True
