"""The loading tests parse each GGUF file once.

The tests here open the packaged files many times (the reference tensors, the
quantized engines), and a parse costs seconds even with ``open_gguf``'s reader. So
``open_gguf`` is memoised for these tests, the engine's own loads included: the
same reader, parsed once per file.
"""

from __future__ import annotations

import os

import pytest

# One reader per (file, modification time, size) for the whole session: a file written
# again under the same name is parsed again.
_READERS: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def _gguf_files_parsed_once(monkeypatch):
    try:
        from pagedtree.loading import gguf_reader
    except ImportError:  # no gguf: the GGUF tests skip themselves
        return
    parse = gguf_reader.open_gguf

    def shared(path):
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
        if key not in _READERS:
            _READERS[key] = parse(path)
        return _READERS[key]

    monkeypatch.setattr(gguf_reader, "open_gguf", shared)
