"""A model's weights repacked into ggml's interleaved layout, in one buffer.

llama.cpp repacks Q4_0/Q4_K weights on x86 (and ARM) into 8-row interleaved blocks
(its ``CPU_REPACK`` buffer), whose one-row product reads them faster than the file's
layout (the Qwen2.5 1.5B decoded 32.1 tokens/s against 26.0, one ggml graph a step,
the AVX-512 machine). Here every such weight of a model goes into a single buffer of
ggml's repack type, which Linux is asked to back with transparent huge pages before
the weights are written into it: a step streams about a gigabyte of weights, and
4 KiB pages cost it a TLB miss every 4 KiB (5% of a decode step with the file's
layout; about 1% with the repacked one, 35.0-35.6 against 34.8-35.2 tokens/s, where
the file's 6-bit tensors stay in 4 KiB pages of the mapping).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from pagedtree.host_memory import advise_huge_pages
from pagedtree.worker.models.ggml_matmul import GgmlContext, GgmlRuntime, GgmlWeight


class RepackedWeights:
    """Repacked copies of ``weights`` (``GgmlWeight`` in the file's layout): ``tensor``
    gives the copy of a weight whose type this CPU repacks, None for the others."""

    def __init__(self, runtime: GgmlRuntime, weights: list[GgmlWeight]):
        ggml = runtime.ggml
        self._ggml = ggml
        self._tensors: dict[int, Any] = {}
        self.buffer = None
        self.nbytes = 0
        self.huge_pages = False
        if runtime.repack_buffer_type is None or not weights:
            return
        self._context = GgmlContext(runtime, tensors=len(weights) + 1)
        tensors = [ggml.ggml_new_tensor_2d(self._context.context, w.type_id, w.k, w.n) for w in weights]
        self.buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(self._context.context, runtime.repack_buffer_type)
        if not self.buffer:
            raise MemoryError("ggml could not allocate the repacked weights")
        self.nbytes = int(ggml.ggml_backend_buffer_get_size(self.buffer))
        self.huge_pages = advise_huge_pages(int(ggml.ggml_backend_buffer_get_base(self.buffer)), self.nbytes)
        for weight, tensor in zip(weights, tensors):
            # The buffer marks a tensor it can repack (its traits in ``extra``); one of
            # another type keeps its place unwritten (no memory) and the file's layout.
            if tensor.contents.extra:
                data = np.ascontiguousarray(weight._data)
                ggml.ggml_backend_tensor_set(tensor, data.ctypes.data_as(ctypes.c_void_p), 0, data.nbytes)
                self._tensors[id(weight)] = tensor
        if not self._tensors:  # no type this CPU repacks (a model of 8-bit blocks)
            ggml.ggml_backend_buffer_free(self.buffer)
            self.buffer, self.nbytes, self.huge_pages = None, 0, False

    def tensor(self, weight: GgmlWeight) -> Any | None:
        """The repacked copy of ``weight`` (None: its type is not repacked here)."""
        return self._tensors.get(id(weight))

    def __len__(self) -> int:
        return len(self._tensors)

    def __del__(self) -> None:
        if getattr(self, "buffer", None):
            self._ggml.ggml_backend_buffer_free(self.buffer)
