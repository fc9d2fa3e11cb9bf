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


import torch

from pagedtree.worker.models.ggml_matmul import (
    GgmlBlocks,
    GgmlContext,
    GgmlRuntime,
    GgmlWeight,
    GraphCache,
    shared_runtime,
)


class _Lookup:
    """The lookup of one row count: ``ids [count]`` int32 in, ``out [count, k]`` fp32 out."""

    def __init__(self, runtime: GgmlRuntime, table: GgmlWeight, count: int):
        ggml = runtime.ggml
        self._context = GgmlContext(runtime, tensors=4, graph=True)
        self.ids = ggml.ggml_new_tensor_1d(self._context.context, ggml.GGML_TYPE_I32, count)
        self.out = ggml.ggml_get_rows(self._context.context, table.tensor, self.ids)
        self.graph = ggml.ggml_new_graph(self._context.context)
        ggml.ggml_build_forward_expand(self.graph, self.out)
        # One thread: a step's rows are a few KB to dequantize, and a pool's workers
        # would poll for work on the cores the forward needs.
        self.plan = ggml.ggml_graph_plan(self.graph, 1, runtime.pool(1))


class GgmlRows:
    """``table[ids]`` in fp32 for a table of GGUF blocks ``[n, k]`` (see module docstring)."""

    def __init__(self, blocks: GgmlBlocks):
        self._runtime = shared_runtime()
        self._table = GgmlWeight(self._runtime, blocks, repack=False)
        self.n, self.k, self.type_name = blocks.n, blocks.k, blocks.type_name
        self._lookups = GraphCache(lambda count: _Lookup(self._runtime, self._table, count))

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
            lookup = self._lookups.get(index.numel())
            lookup.ids.contents.data = index.data_ptr()
            lookup.out.contents.data = out.data_ptr()
            runtime.compute(lookup.graph, lookup.plan)
        return out.view(*ids.shape, self.k)

    @property
    def nbytes(self) -> int:
        """The table's bytes."""
        return self._table.nbytes

