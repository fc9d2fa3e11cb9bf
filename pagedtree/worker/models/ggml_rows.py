"""Rows of a table in llama.cpp's block formats, looked up by ggml: a token embedding
kept as the GGUF file stores it.

A 150k-token vocabulary's embedding is 0.9 GB in fp32 and 0.47 GB in bf16 for a
hidden size of 1536; the Qwen2.5 1.5B's file holds it as Q4_K blocks (131 MB). Here
the table stays in the file's blocks (its mapped pages, as the products in
``ggml_matmul`` read theirs) and each step dequantizes only the rows of its tokens,
with ggml's ``get_rows`` (the lookup llama.cpp runs): the same values as the dense
table that the file's blocks stand for.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import torch

from pagedtree.worker.models.ggml_matmul import GRAPH_CACHE, GgmlBlocks, GgmlRuntime, GgmlWeight, shared_runtime


class _Lookup:
    """The lookup of one row count: ``ids [count]`` int32 in, ``out [count, k]`` fp32 out."""

    def __init__(self, runtime: GgmlRuntime, table: GgmlWeight, count: int):
        ggml = runtime.ggml
        size = int(ggml.ggml_tensor_overhead()) * 4 + int(ggml.ggml_graph_overhead()) + 1024
        self._memory = ctypes.create_string_buffer(size)
        params = ggml.ggml_init_params(mem_size=size, mem_buffer=ctypes.cast(self._memory, ctypes.c_void_p),
                                       no_alloc=True)
        self._context = ggml.ggml_init(params)
        self.ids = ggml.ggml_new_tensor_1d(self._context, ggml.GGML_TYPE_I32, count)
        self.out = ggml.ggml_get_rows(self._context, table.tensor, self.ids)
        self.graph = ggml.ggml_new_graph(self._context)
        ggml.ggml_build_forward_expand(self.graph, self.out)
        # One thread: a step's rows are a few KB to dequantize, and a pool's workers
        # would poll for work on the cores the forward needs.
        self.plan = ggml.ggml_graph_plan(self.graph, 1, runtime.pool(1))
        self._ggml = ggml

    def __del__(self) -> None:
        ggml = getattr(self, "_ggml", None)
        if ggml is not None:
            ggml.ggml_free(self._context)


class GgmlRows:
    """``table[ids]`` in fp32 for a table of GGUF blocks ``[n, k]`` (see module docstring)."""

    def __init__(self, blocks: GgmlBlocks):
        self._runtime = shared_runtime()
        self._table = GgmlWeight(self._runtime, blocks, repack=False)
        self.n, self.k, self.type_name = blocks.n, blocks.k, blocks.type_name
        self._lookups: OrderedDict[int, _Lookup] = OrderedDict()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.n):
            raise IndexError(f"token ids must be in [0, {self.n}), got {int(flat.min())}..{int(flat.max())}")
        index = flat.to(torch.int32).contiguous()
        out = torch.empty(index.numel(), self.k, dtype=torch.float32)
        if index.numel() == 0:
            return out.view(*ids.shape, self.k)
        runtime = self._runtime
        with runtime.lock:
            lookup = self._lookup(index.numel())
            lookup.ids.contents.data = index.data_ptr()
            lookup.out.contents.data = out.data_ptr()
            lookup.plan.work_data = runtime.work(lookup.plan.work_size)
            status = runtime.ggml.ggml_graph_compute(lookup.graph, ctypes.byref(lookup.plan))
        if status != 0:
            raise RuntimeError(f"ggml's graph compute failed (status {status})")
        return out.view(*ids.shape, self.k)

    def _lookup(self, count: int) -> _Lookup:
        lookup = self._lookups.get(count)
        if lookup is None:
            lookup = self._lookups[count] = _Lookup(self._runtime, self._table, count)
            if len(self._lookups) > GRAPH_CACHE:
                self._lookups.popitem(last=False)
        else:
            self._lookups.move_to_end(count)
        return lookup

    @property
    def nbytes(self) -> int:
        """The table's bytes."""
        return self._table.nbytes

