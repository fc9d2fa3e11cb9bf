"""Block-quantized linear weights multiplied by ONNX Runtime's MLAS kernels.

The scheme llama.cpp runs on CPUs (its Q4_0/Q8_0 weights against Q8 activations):
weights in blocks of ``BLOCK`` input features, each block with its own fp32 scale
and integer zero point (4 bits: codes 0..15; 8 bits: codes 0..255 around 128), and
activations quantized to int8 per block on the fly, so that the products are integer
dot products. ONNX Runtime's ``MatMulNBits`` operator (``accuracy_level=4``: int8
compute) runs them through MLAS, its linear-algebra library; here each weight gets a
one-node ONNX graph and its own session, called on torch tensors by pointer
(IOBinding: no copies). On the 2-core AVX2 machine it was 2.2-2.6x faster than
torch's int4 kernel at one row (a 1536 -> 17920 layer: 0.89 ms against 2.27 ms), and
the fastest of the measured formats up to 32 rows (benchmarks/RESULTS.md,
"Quantized linear layers").

**Threads.** ONNX Runtime's pool and torch's (and numba's) OpenMP pools take turns on
the same cores. OpenMP threads spin for a while after each parallel region by default,
and an ONNX Runtime call right after one waited for them: the Qwen2.5 1.5B's forward
took 252 ms a token instead of 56 on the 2-core machine. Importing pagedtree before
torch sets ``OMP_WAIT_POLICY=PASSIVE`` (read when OpenMP starts) unless the
environment sets a policy; a warning says so where torch came first. ONNX Runtime's
own threads must not spin either, and only a session's own pool can be told so (the
process-wide pool of ``set_global_thread_pool_sizes`` always spins): each layer's
session has its own pool, as many threads as torch uses, sleeping between calls.
With the shared, spinning pool the 1.5B's q4 stream ran at 6-19 tokens/s from one
48-token generation to the next, as its spinning worker and the forward's thread
took turns on two cores; with sleeping pools, 17.4-18.1 every time.

Rows are independent of each other: each row's activations are quantized on their
own, and a row's result does not depend on the rows beside it, except that MLAS
may run a single row through another kernel (different summation order; on AVX2 it
does for 4-bit rows, while an AVX-512 CPU gave a lone row the same bits); a layer with
``pad_single_rows`` therefore computes one row as two (1.1-1.5x a lone row's time), where
``Linear.lone_row_needs_padding`` finds that a lone row differs.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import torch

from pagedtree.host_memory import release_mapped_file_pages

if TYPE_CHECKING:  # onnx is imported where a graph is built: q4/q8 layers only
    import onnx

logger = logging.getLogger(__name__)

BLOCK = 32
BITS = {"q4": 4, "q8": 8, "q4-rounded": 4}
# Formats that round a llama.cpp block wider than their bits (5- to 8-bit ones to 4):
# a draft's, which need not reproduce its file, reads fewer bytes a forward that way.
ROUNDS_WIDER_BLOCKS = frozenset({"q4-rounded"})
# int8 compute (MLAS's integer kernels); 0 would dequantize to fp32 and run an SGEMM.
_ACCURACY_LEVEL = 4
# The graphs' operator sets: ONNX's own at 21 (Reshape, ReduceSum with its axes as an
# input, MatMul, Add) and Microsoft's, where MatMulNBits lives.
ONNX_OPSET = 21
# The graphs' IR version, written out: onnx stamps its own newest by default (14 for
# onnx 1.23), which an ONNX Runtime older than that onnx refuses ("Unsupported model IR
# version"). 10 is the lowest that opset 21 needs (onnx.helper.VERSION_TABLE), read by
# every ONNX Runtime that runs opset 21.
ONNX_IR_VERSION = 10
# Initializers from this size up go to the external-data file (shapes and axes, which
# shape inference reads at load, stay inline), each at an offset aligned to a page.
_EXTERNAL_MIN_BYTES = 4096
_EXTERNAL_ALIGNMENT = 4096


@dataclass
class BlockCodes:
    """Unpacked block weights: ``codes`` ``[n, k]`` uint8 (below 16 for 4 bits),
    ``scales`` ``[n, k / block]`` fp32, integer ``zero_points`` ``[n, k / block]`` uint8
    and optional ``offsets`` ``[n, k / block]`` fp32; weight = (code - zero point) *
    scale + offset. The form GGUF blocks are decoded into and rows are merged in."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    offsets: np.ndarray | None
    bits: int
    block: int

    def widened(self, bits: int, block: int, offsets: bool) -> BlockCodes:
        """The same weight with more bits, smaller blocks or (zero) offsets: exact."""
        if bits < self.bits or self.block % block or (self.offsets is not None and not offsets):
            raise ValueError(f"cannot narrow {self.bits}-bit blocks of {self.block} to {bits}-bit blocks of {block}")
        repeat = self.block // block
        widen = (lambda a: np.repeat(a, repeat, axis=1)) if repeat > 1 else (lambda a: a)
        extra = None
        if offsets:
            extra = widen(self.offsets) if self.offsets is not None else np.zeros(
                (self.codes.shape[0], self.codes.shape[1] // block), np.float32)
        return BlockCodes(self.codes, widen(self.scales), widen(self.zero_points), extra, bits, block)

    def take_rows(self, order: np.ndarray) -> BlockCodes:
        """These rows in ``order`` (e.g. undoing a row permutation)."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[order])
        return BlockCodes(pick(self.codes), pick(self.scales), pick(self.zero_points), pick(self.offsets),
                          self.bits, self.block)


@dataclass
class BlockWeights:
    """A weight ``[n, k]`` in ``MatMulNBits``'s layout: ``codes`` ``[n, k / block,
    block * bits / 8]`` uint8 (two 4-bit codes per byte, the lower one first),
    ``scales`` ``[n * k / block]`` fp32 and ``zero_points`` (uint8; 4-bit ones two per
    byte, each row's padded to whole bytes); weight = (code - zero point) * scale, plus
    ``offsets[n, k / block]`` (fp32) where a format has a real minimum per block
    (llama.cpp's Q4_1, Q4_K, Q5_K: added as block sums of the input times the offsets)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    n: int
    k: int
    bits: int
    block: int = BLOCK
    offsets: np.ndarray | None = None

    def unpack(self) -> BlockCodes:
        """The codes one per byte, scales and zero points per block."""
        blocks = self.k // self.block
        codes = self.codes.reshape(self.n, blocks, -1)
        zps = self.zero_points.reshape(self.n, -1)
        if self.bits == 4:
            codes = np.stack([codes & 15, codes >> 4], axis=-1)
            zps = np.stack([zps & 15, zps >> 4], axis=-1).reshape(self.n, -1)[:, :blocks]
        return BlockCodes(codes.reshape(self.n, self.k), self.scales.reshape(self.n, blocks), zps,
                          self.offsets, self.bits, self.block)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these blocks stand for."""
        raw = self.unpack()
        codes = torch.from_numpy(raw.codes).view(self.n, -1, self.block).float()
        weight = (codes - torch.from_numpy(raw.zero_points)[..., None].float()) * torch.from_numpy(raw.scales)[..., None]
        if raw.offsets is not None:
            weight = weight + torch.from_numpy(raw.offsets)[..., None]
        return weight.reshape(self.n, self.k)

    @property
    def nbytes(self) -> int:
        extra = self.offsets.nbytes if self.offsets is not None else 0
        return self.codes.nbytes + self.scales.nbytes + self.zero_points.nbytes + extra


def pack_blocks(raw: BlockCodes) -> BlockWeights:
    """``raw`` in ``MatMulNBits``'s packed layout."""
    n, k = raw.codes.shape
    if raw.bits not in (4, 8) or raw.block not in (16, 32, 64, 128) or k % raw.block:
        raise ValueError(f"unsupported blocks: {raw.bits} bits, blocks of {raw.block}, {k} inputs")
    codes = raw.codes.astype(np.uint8, copy=False)
    zps = raw.zero_points.astype(np.uint8, copy=False)
    if raw.bits == 4:
        if codes.max(initial=0) > 15 or zps.max(initial=0) > 15:
            raise ValueError("4-bit codes and zero points must be below 16")
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        if zps.shape[1] % 2:
            zps = np.concatenate([zps, np.zeros((n, 1), np.uint8)], axis=1)
        zps = zps[:, 0::2] | (zps[:, 1::2] << 4)
    offsets = None if raw.offsets is None else np.ascontiguousarray(raw.offsets, dtype=np.float32)
    return BlockWeights(np.ascontiguousarray(codes).reshape(n, k // raw.block, -1),
                        np.ascontiguousarray(raw.scales, dtype=np.float32).reshape(-1),
                        np.ascontiguousarray(zps).reshape(-1), n, k, raw.bits, raw.block, offsets)


def quantize_blocks(weight: torch.Tensor, bits: int, block: int = BLOCK) -> BlockWeights:
    """Round ``weight [n, k]`` to ``bits``-bit blocks of ``block`` (``k`` a multiple of it).

    4 bits: asymmetric, each block's range (stretched to include 0, so that zero
    stays exact) over codes 0..15. 8 bits: symmetric around 128.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = weight.shape
    if k % block:
        raise ValueError(f"block quantization needs in_features divisible by {block}, got {k}")
    blocks = weight.detach().float().reshape(n, k // block, block)
    if bits == 4:
        low = blocks.amin(dim=-1).clamp(max=0)
        high = blocks.amax(dim=-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-12)
        zero = torch.round(-low / scale).clamp(0, 15)
        codes = torch.round(blocks / scale[..., None] + zero[..., None]).clamp(0, 15)
    else:
        scale = (blocks.abs().amax(dim=-1) / 127).clamp(min=1e-12)
        codes = torch.round(blocks / scale[..., None]).clamp(-127, 127) + 128
        zero = torch.full((n, k // block), 128.0)
    return pack_blocks(BlockCodes(codes.to(torch.uint8).reshape(n, k).numpy(), scale.numpy(),
                                  zero.to(torch.uint8).numpy(), None, bits, block))


def concat_blocks(parts: list[BlockWeights | BlockCodes]) -> BlockWeights:
    """Rows of several block weights (same ``k``) stacked, in order: parts of different
    bits or block sizes are widened to the most bits and the smallest block (exactly)."""
    raws = [p.unpack() if isinstance(p, BlockWeights) else p for p in parts]
    if len({r.codes.shape[1] for r in raws}) != 1:
        raise ValueError("concat_blocks needs parts of one width")
    bits, block = max(r.bits for r in raws), min(r.block for r in raws)
    offsets = any(r.offsets is not None for r in raws)
    raws = [r.widened(bits, block, offsets) for r in raws]
    cat = lambda name: np.concatenate([getattr(r, name) for r in raws])
    return pack_blocks(BlockCodes(cat("codes"), cat("scales"), cat("zero_points"),
                                  cat("offsets") if offsets else None, bits, block))


@functools.cache
def _warn_unless_openmp_waits_passively() -> None:
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        logger.warning(
            "q4/q8 layers run on ONNX Runtime's threads between torch's and numba's OpenMP ones, which spin "
            "on the same cores after every parallel region unless OMP_WAIT_POLICY=PASSIVE is set before the "
            "process starts (import pagedtree before torch, or set it in the environment): the Qwen2.5 1.5B "
            "took 252 ms a token instead of 56 on 2 cores")


def block_matmul_model(weights: BlockWeights, weights_file: BinaryIO | None = None,
                       location: str = "linear.weights") -> onnx.ModelProto:
    """The ONNX model of ``A @ weight.T`` for ``weights``:
    ``MatMulNBits`` on the codes, plus the offsets' block sums where the weights have
    offsets; input ``A`` ``[M, k]``, output ``Y`` ``[M, n]``, both fp32.

    With ``weights_file`` (open for writing, named ``location`` beside the model) the
    large initializers are written there straight from ``weights``' arrays and the
    model refers to them: no copy of the weights in the model's protobuf."""
    from onnx import TensorProto, helper, numpy_helper

    def initializer(array: np.ndarray, name: str) -> TensorProto:
        array = np.ascontiguousarray(array)
        if weights_file is None or array.nbytes < _EXTERNAL_MIN_BYTES:
            return numpy_helper.from_array(array, name)
        return _external_initializer(array, name, weights_file, location)

    n, k = weights.n, weights.k
    nodes = [helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                              K=k, N=n, bits=weights.bits, block_size=weights.block,
                              accuracy_level=_ACCURACY_LEVEL)]
    initializers = [initializer(weights.codes, "B"), initializer(weights.scales, "scales"),
                    initializer(weights.zero_points, "zero_points")]
    outputs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])]
    if weights.offsets is not None:
        # Y_offsets = (block sums of A) @ offsets.T: each block's minimum times its
        # inputs' sum, a second output that the caller adds to Y. (Added inside the
        # graph, Y's two halves were intermediates ONNX Runtime allocated on every call,
        # [M, n] each, and their chunks, freed between other allocations, fragmented the
        # heap: with ``BlockMatMul``'s one-row first run, the 1.5B's first 43-token
        # prefill grew it by 141 MiB rather than 13.)
        blocks = k // weights.block
        initializers += [
            initializer(weights.offsets.reshape(n, blocks).T, "offsets"),
            numpy_helper.from_array(np.array([0, blocks, weights.block], np.int64), "block_shape"),
            numpy_helper.from_array(np.array([2], np.int64), "block_axis")]
        nodes += [helper.make_node("Reshape", ["A", "block_shape"], ["A_blocks"]),
                  helper.make_node("ReduceSum", ["A_blocks", "block_axis"], ["A_sums"], keepdims=0),
                  helper.make_node("MatMul", ["A_sums", "offsets"], ["Y_offsets"])]
        outputs.append(helper.make_tensor_value_info("Y_offsets", TensorProto.FLOAT, ["M", n]))
    graph = helper.make_graph(
        nodes, "linear", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])], outputs, initializers)
    return helper.make_model(graph, ir_version=ONNX_IR_VERSION,
                             opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                            helper.make_opsetid("com.microsoft", 1)])


def _external_initializer(array: np.ndarray, name: str, weights_file: BinaryIO, location: str) -> onnx.TensorProto:
    """``array`` appended to ``weights_file`` (at an offset aligned for mapping), and the
    initializer that refers to it there."""
    from onnx import TensorProto, helper

    offset = -weights_file.tell() % _EXTERNAL_ALIGNMENT + weights_file.tell()
    weights_file.seek(offset)
    weights_file.write(memoryview(array).cast("B"))
    tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", offset), ("length", array.nbytes)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _session_from_mapped_file(weights: BlockWeights, options: object) -> object:
    """An ONNX Runtime session for ``weights``' model, the weights read from a mapped file.

    ONNX Runtime prepacks ``MatMulNBits``'s blocks into a layout of its own. A model
    passed as bytes leaves it holding the parsed initializers beside the packed copy
    (2.2-2.3x the blocks for a 4-bit 1536 -> 17920 layer; weights given from memory,
    ``add_external_initializers_from_files_in_memory``, are copied too). Weights in an
    external-data file are mapped and packed; the file is written straight from the
    arrays (``block_matmul_model``), so no protobuf copy of them exists (the 1.5B's
    8-bit head is 306 MB). ONNX Runtime keeps the file mapped, and the pages it read
    while packing stayed resident though it never reads them again (with the 1.5B and
    its draft: 365 MiB, none of them touched again by prefills, batches or single
    rows): they are dropped once the session is made (``release_mapped_file_pages``). The file is deleted as soon as the session is
    made. Without a writable temporary folder the model goes over as bytes.
    """
    import onnx
    import onnxruntime as ort

    try:
        workspace = tempfile.TemporaryDirectory(prefix="pagedtree-blocks-")
    except OSError as exc:  # no writable temporary folder: the same session, its weights held twice
        logger.warning("q4/q8 weights load from memory (%s): ONNX Runtime then holds them twice", exc)
        model = block_matmul_model(weights)
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with workspace as folder:
        path, data = os.path.join(folder, "linear.onnx"), os.path.join(folder, "linear.weights")
        with open(data, "wb") as weights_file:
            model = block_matmul_model(weights, weights_file, os.path.basename(data))
        onnx.save_model(model, path)
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        release_mapped_file_pages(data)
        return session


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's fp32 scratch of at least ``numel`` values (grown, never shrunk),
    for results consumed before the next product: one buffer for every layer rather
    than a fresh [rows, n] tensor a call, whose chunks, freed between the layers' other
    allocations, fragmented the heap."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        _SCRATCH.buffer = buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


class BlockMatMul:
    """``x @ weight.T`` for one ``BlockWeights`` (fp32 rows in, fp32 rows out)."""

    def __init__(self, weights: BlockWeights):
        import onnxruntime as ort

        _warn_unless_openmp_waits_passively()
        self.n, self.k, self.bits = weights.n, weights.k, weights.bits
        options = ort.SessionOptions()
        # A pool of the session's own, whose threads sleep between calls (see "Threads"):
        # the engine's threads (torch's and numba's) run between these products.
        options.use_per_session_threads = True
        options.intra_op_num_threads = max(1, torch.get_num_threads())
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = False  # inputs and outputs are ours; no arena to grow
        # No allocation plan kept per input shape (with no arena, each run allocates
        # its buffers anyway): every new row count would add one to the heap.
        options.enable_mem_pattern = False
        options.log_severity_level = 3
        self._session = _session_from_mapped_file(weights, options)
        self._binding = self._session.io_binding()
        self._packed_bytes = weights.nbytes
        self._has_offsets = weights.offsets is not None
        # A session keeps a little memory from its first run. Made by a one-row product
        # now, it lands among the load's small free chunks; made by the first prefill,
        # it split the large chunks that the prefill's [rows, n] outputs had just freed,
        # and the next layers' outputs took fresh heap: the 1.5B's first 43-token
        # prefill grew the heap by 84 MiB, 13 after this run.
        self(torch.zeros(1, self.k))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        if rows.shape[0] == 0:
            # No rows (a prefill chunk whose logits nobody reads): ONNX Runtime refuses
            # to bind an empty buffer, whose address is null.
            return out
        binding = self._binding
        binding.bind_input("A", "cpu", 0, np.float32, list(rows.shape), rows.data_ptr())
        binding.bind_output("Y", "cpu", 0, np.float32, list(out.shape), out.data_ptr())
        if not self._has_offsets:
            self._session.run_with_iobinding(binding)
            return out
        offsets = _scratch(out.numel()).view(out.shape)
        binding.bind_output("Y_offsets", "cpu", 0, np.float32, list(offsets.shape), offsets.data_ptr())
        self._session.run_with_iobinding(binding)
        return out.add_(offsets)  # element-wise: each row's bits independent of the batch

    @property
    def nbytes(self) -> int:
        """The quantized weight's bytes (codes, scales, zero points)."""
        return self._packed_bytes

