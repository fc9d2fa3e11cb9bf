"""Products with weights in llama.cpp's own block formats, run by ggml's CPU kernels.

A GGUF file's weights (Q4_K, Q6_K, Q8_0, ... blocks) are multiplied here as the file
stores them: no conversion, no fp32 transit, the same bytes and the same kernels as
llama.cpp (ggml's ``mul_mat``: activations quantized per row to the weight type's
partner format, integer dot products per block).

**Rows independent of their batch.** In the file's layout every output is one dot
product of a weight row and an activation row, the same kernel whatever the batch:
a row's result has the same bits alone and anywhere in any batch, which tree
verification needs (greedy speculation equal to plain decoding). llama.cpp by default
repacks Q4_0 and Q4_K into 8-row interleaved blocks on AVX2 and AVX-512 (its
``CPU_REPACK`` buffer), whose products run 4-row groups through one kernel and the
remaining rows through another that rounds differently; ``repack=True`` takes that
layout (faster in batches, see benchmarks/RESULTS.md) where a caller does not need
the independence.

Each layer builds a small ggml graph per row count (cached): one ``mul_mat`` node per
checkpoint tensor of the layer (a fused q/k/v or gate/up layer has tensors of
different types), each writing its columns of one ``[rows, out_features]`` output by
a row stride, with the activations and the output pointing at torch's memory. One
``ggml_graph_compute`` call runs them on ggml's own thread pool (ggml built without
OpenMP: its threads poll briefly, then sleep, so that torch's and numba's OpenMP
threads have the cores between products), as many threads as torch uses.

ggml comes from the ``ggml-python`` package (built from source at set-up, for the
machine it runs on).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Row counts whose graphs a layer keeps (least recently used dropped): decoding, tree
# verification and batches reuse a few; prefill chunks bring new ones.
GRAPH_CACHE = 32
# How long ggml's worker threads poll for the next product before they sleep (ggml's
# scale, 0-100; 50 is its default). Sleeping at once (0) cost the 1.5B's batch-1
# forward about 10% (a wake-up per product, 113 a token); between two products of
# a forward torch's work is short.
POLL = 50
# Tensor headers a graph's context makes room for per product (its result is one;
# the rest is headroom).
_TENSORS_PER_PART = 4


@dataclass
class GgmlBlocks:
    """A weight's rows as a GGUF file stores them: ``data`` ``[n, row_bytes]`` uint8
    in ggml's ``type_name`` format (``"Q4_K"``, ``"Q6_K"``, ``"F32"``, ...), ``k``
    values a row."""

    type_name: str
    data: np.ndarray
    k: int

    @property
    def n(self) -> int:
        return int(self.data.shape[0])

    def take_rows(self, order: np.ndarray) -> GgmlBlocks:
        """These rows in ``order`` (rows are independent runs of blocks: exact)."""
        return GgmlBlocks(self.type_name, np.ascontiguousarray(self.data[order]), self.k)


def quantize_rows(weight: torch.Tensor, type_name: str | None = None) -> GgmlBlocks:
    """A dense weight ``[n, k]`` in llama.cpp's ``type_name`` blocks, by default Q4_K
    (rows of a multiple of 256 values) or else Q8_0 (of 32), rounded by ggml's own
    quantizer (no importance matrix), as ``llama-quantize`` makes a Q4_K_M file's main
    tensors."""
    import ggml

    n, k = weight.shape
    if type_name is None:
        type_name = "Q4_K" if k % 256 == 0 else "Q8_0"
    type_id = ggml_type(type_name)
    if k % int(ggml.ggml_blck_size(type_id)):
        raise ValueError(f"{type_name} needs in_features divisible by {ggml.ggml_blck_size(type_id)}, got {k}")
    values = weight.detach().float().contiguous().numpy()
    data = np.empty((n, int(ggml.ggml_row_size(type_id, k))), np.uint8)
    ggml.ggml_quantize_chunk(type_id, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             data.ctypes.data_as(ctypes.c_void_p), 0, n, k, None)
    return GgmlBlocks(type_name, data, k)


@functools.cache
def ggml_available() -> bool:
    """Whether ggml's CPU library can be loaded here."""
    try:
        shared_runtime()
    except (ImportError, OSError):
        return False
    return True


def ggml_type(type_name: str) -> int:
    """ggml's type id of a GGUF type name (``ValueError`` for one ggml lacks)."""
    import ggml

    value = getattr(ggml, f"GGML_TYPE_{type_name.upper()}", None)
    if value is None:
        raise ValueError(f"ggml has no type {type_name!r}")
    return int(value)


def _ggml_log(level: int, text: bytes | None, user_data: Any) -> None:
    if text:
        logging.getLogger("pagedtree.ggml").debug(text.decode(errors="replace").rstrip())


class GgmlRuntime:
    """ggml's CPU device, its repack buffer type and thread pools (one per thread
    count), shared by every layer of the process; calls are serialized (shared pools,
    one work buffer)."""

    def __init__(self) -> None:
        import ggml

        self.ggml = ggml
        # ggml's log goes to the engine's logger at debug level (it prints a line per
        # repacked tensor to stderr otherwise); the callback is kept alive here.
        self._log = ggml.ggml_log_callback(_ggml_log)
        ggml.ggml_log_set(self._log, None)
        ggml.ggml_cpu_init()
        self.threads = max(1, torch.get_num_threads())
        self._pools: dict[int, int] = {}
        self.device = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
        self.plain_buffer_type = ggml.ggml_backend_dev_buffer_type(self.device)
        self.repack_buffer_type = self._repack_buffer_type()
        self.lock = threading.Lock()
        self._work = np.empty(0, np.uint8)

    def _repack_buffer_type(self) -> int | None:
        """The CPU backend's ``CPU_REPACK`` buffer type, if this build has one."""
        ggml = self.ggml
        registry = ggml.ggml_backend_dev_backend_reg(self.device)
        address = ggml.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_dev_get_extra_bufts")
        if not address:
            return None
        extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(self.device)
        index = 0
        while extra and extra[index]:
            if ggml.ggml_backend_buft_name(extra[index]) == b"CPU_REPACK":
                return extra[index]
            index += 1
        return None

    def pool(self, threads: int) -> int:
        """ggml's thread pool of ``threads`` threads (made on first use: a process
        that only looks up embedding rows never starts the products' workers, which
        poll for work after each product)."""
        pool = self._pools.get(threads)
        if pool is None:
            params = self.ggml.ggml_threadpool_params_default(threads)
            params.poll = POLL
            pool = self._pools[threads] = self.ggml.ggml_threadpool_new(ctypes.byref(params))
        return pool

    def compute(self, graph: Any, plan: Any) -> None:
        """Run ``graph`` by ``plan`` with the shared work buffer (under ``lock``)."""
        if self._work.nbytes < plan.work_size:
            self._work = np.empty(max(plan.work_size, 2 * self._work.nbytes), np.uint8)
        plan.work_data = self._work.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
        status = self.ggml.ggml_graph_compute(graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml's graph compute failed (status {status})")


class GgmlContext:
    """A ggml context in memory of its own: room for ``tensors`` tensor headers and,
    with ``graph``, one graph (of ``graph_nodes`` nodes, or ggml's default size);
    freed with this object."""

    def __init__(self, runtime: GgmlRuntime, tensors: int, graph: bool = False, graph_nodes: int = 0):
        ggml = runtime.ggml
        size = int(ggml.ggml_tensor_overhead()) * tensors + 256
        if graph_nodes:
            size += int(ggml.ggml_graph_overhead_custom(graph_nodes, False)) + 1024
        elif graph:
            size += int(ggml.ggml_graph_overhead()) + 1024
        self._memory = ctypes.create_string_buffer(size)
        params = ggml.ggml_init_params(mem_size=size, mem_buffer=ctypes.cast(self._memory, ctypes.c_void_p),
                                       no_alloc=True)
        self.context = ggml.ggml_init(params)
        self._ggml = ggml

    def __del__(self) -> None:
        ggml = getattr(self, "_ggml", None)
        if ggml is not None:
            ggml.ggml_free(self.context)


class GraphCache:
    """Graphs by row count, the ``GRAPH_CACHE`` most recently used kept."""

    def __init__(self, make: Callable[[int], Any]):
        self._make = make
        self._graphs: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, rows: int) -> Any:
        """The graph for ``rows`` (made on a miss)."""
        graph = self._graphs.get(rows)
        if graph is None:
            graph = self._graphs[rows] = self._make(rows)
            if len(self._graphs) > GRAPH_CACHE:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(rows)
        return graph


@functools.cache
def shared_runtime() -> GgmlRuntime:
    """The process's ggml runtime (made on first use)."""
    return GgmlRuntime()


class GgmlWeight:
    """One checkpoint tensor for ggml: in the file's layout the tensor points at the
    blocks' own memory (a GGUF's mapped pages: nothing copied, as llama.cpp maps its
    file), repacked (``repack``, where ggml repacks the type on this CPU) in a buffer
    of ggml's."""

    def __init__(self, runtime: GgmlRuntime, blocks: GgmlBlocks, repack: bool):
        ggml = runtime.ggml
        self._ggml = ggml
        self.type_id = ggml_type(blocks.type_name)
        if blocks.k % int(ggml.ggml_blck_size(self.type_id)):
            raise ValueError(f"{blocks.type_name} rows hold a multiple of {ggml.ggml_blck_size(self.type_id)} "
                             f"values, not {blocks.k}")
        row_bytes = int(ggml.ggml_row_size(self.type_id, blocks.k))
        if blocks.data.ndim != 2 or blocks.data.shape[1] != row_bytes or blocks.data.dtype != np.uint8:
            raise ValueError(f"{blocks.type_name} rows of {blocks.k} values take {row_bytes} bytes, "
                             f"got rows of {blocks.data.shape[1:]}")
        self.n, self.k = blocks.n, blocks.k
        self.buffer = None
        self._context = GgmlContext(runtime, tensors=1)
        self.tensor = ggml.ggml_new_tensor_2d(self._context.context, self.type_id, self.k, self.n)
        if repack and runtime.repack_buffer_type is not None:
            buffer = ggml.ggml_backend_alloc_ctx_tensors_from_buft(self._context.context, runtime.repack_buffer_type)
            # The repack buffer marks a tensor it can repack (its traits in ``extra``);
            # setting one it cannot would abort inside ggml.
            if self.tensor.contents.extra:
                data = np.ascontiguousarray(blocks.data)
                ggml.ggml_backend_tensor_set(self.tensor, data.ctypes.data_as(ctypes.c_void_p), 0, data.nbytes)
                self.buffer = buffer
                self.nbytes = int(ggml.ggml_backend_buffer_get_size(buffer))
                return
            ggml.ggml_backend_buffer_free(buffer)
            self.tensor.contents.buffer = None
            self.tensor.contents.extra = None
        self._data = np.ascontiguousarray(blocks.data)  # kept alive: the tensor reads it
        self.tensor.contents.data = self._data.ctypes.data
        self.nbytes = int(self._data.nbytes)

    @property
    def repacked(self) -> bool:
        return self.buffer is not None

    def __del__(self) -> None:
        if getattr(self, "buffer", None) is not None:
            self._ggml.ggml_backend_buffer_free(self.buffer)


class _Graph:
    """The products of one row count: ``x [rows, k]`` in, ``out [rows, n]`` out."""

    def __init__(self, runtime: GgmlRuntime, weights: list[GgmlWeight], rows: int, n: int):
        ggml = runtime.ggml
        self._context = GgmlContext(runtime, tensors=_TENSORS_PER_PART * (len(weights) + 1), graph=True)
        context = self._context.context
        k = weights[0].k
        self.x = ggml.ggml_new_tensor_2d(context, ggml.GGML_TYPE_F32, k, rows)
        self.graph = ggml.ggml_new_graph(context)
        self.outputs = []  # (tensor, byte offset of its first column)
        column = 0
        for weight in weights:
            y = ggml.ggml_mul_mat(context, weight.tensor, self.x)
            # Its rows n floats apart: this part's columns of the layer's output.
            y.contents.nb[1] = 4 * n
            y.contents.nb[2] = y.contents.nb[3] = 4 * n * rows
            self.outputs.append((y, 4 * column))
            column += weight.n
            ggml.ggml_build_forward_expand(self.graph, y)
        self.plan = ggml.ggml_graph_plan(self.graph, runtime.threads, runtime.pool(runtime.threads))
        # ggml's reference kernels: its tiled K-quant GEMM (8 rows or more, the file's
        # layout) would round a row differently from the same row alone.
        self.plan.use_ref = True


class GgmlMatMul:
    """``x @ weight.T`` for a weight given as one or more checkpoint tensors of GGUF
    blocks (stacked by rows, in order): fp32 rows in, fp32 rows out; ``repack`` takes
    ggml's interleaved layout where it has one (rows then depend on their batch)."""

    def __init__(self, parts: list[GgmlBlocks], repack: bool = False):
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("GgmlMatMul needs one or more parts of one width")
        self._runtime = shared_runtime()
        self._weights = [GgmlWeight(self._runtime, part, repack) for part in parts]
        self.k = parts[0].k
        self.n = sum(part.n for part in parts)
        self.types = [part.type_name for part in parts]
        self._graphs = GraphCache(lambda rows: _Graph(self._runtime, self._weights, rows, self.n))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        if rows.shape[0] == 0:
            return out
        runtime = self._runtime
        with runtime.lock:
            graph = self._graphs.get(rows.shape[0])
            graph.x.contents.data = rows.data_ptr()
            base = out.data_ptr()
            for tensor, offset in graph.outputs:
                tensor.contents.data = base + offset
            runtime.compute(graph.graph, graph.plan)
        return out

    @property
    def nbytes(self) -> int:
        """The weight's bytes in ggml's buffers."""
        return sum(w.nbytes for w in self._weights)

    @property
    def repacked(self) -> list[bool]:
        """Per part, whether ggml repacked it for this CPU."""
        return [w.repacked for w in self._weights]
