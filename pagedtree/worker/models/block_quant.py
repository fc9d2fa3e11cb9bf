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
took 252 ms a token instead of 56 on the 2-core machine. Start q4/q8 processes with
``OMP_WAIT_POLICY=PASSIVE`` (read when OpenMP starts, before torch is imported; a
warning says so otherwise); it cost fp32 batch-16 decoding about 5%, so it is not set
for every process.

Rows are independent of each other: each row's activations are quantized on their
own, and a row's result does not depend on the rows beside it, except that MLAS
runs a single 4-bit row through another kernel (different summation order); a layer
with ``pad_single_rows`` therefore computes one row as two, which costs the same.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK = 32
BITS = {"q4": 4, "q8": 8}
# int8 compute (MLAS's integer kernels); 0 would dequantize to fp32 and run an SGEMM.
_ACCURACY_LEVEL = 4


@dataclass
class BlockWeights:
    """A weight ``[n, k]`` in ``MatMulNBits``'s layout: ``codes`` ``[n, k / BLOCK,
    BLOCK * bits / 8]`` uint8 (two 4-bit codes per byte, the lower one first),
    ``scales`` ``[n * k / BLOCK]`` fp32 and ``zero_points`` (uint8; 4-bit ones two per
    byte, each row's padded to whole bytes); weight = (code - zero point) * scale."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    n: int
    k: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight these blocks stand for."""
        codes = torch.from_numpy(self.codes).view(self.n, self.k // BLOCK, -1)
        zps = torch.from_numpy(self.zero_points).view(self.n, -1)
        if self.bits == 4:
            codes = torch.stack([codes & 15, codes >> 4], dim=-1).view(self.n, self.k // BLOCK, BLOCK)
            zps = torch.stack([zps & 15, zps >> 4], dim=-1).view(self.n, -1)[:, : self.k // BLOCK]
        scales = torch.from_numpy(self.scales).view(self.n, -1)
        return ((codes.float() - zps[..., None].float()) * scales[..., None]).view(self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.zero_points.nbytes


def quantize_blocks(weight: torch.Tensor, bits: int) -> BlockWeights:
    """Round ``weight [n, k]`` to ``bits``-bit blocks of ``BLOCK`` (``k`` a multiple of it).

    4 bits: asymmetric, each block's range (stretched to include 0, so that zero
    stays exact) over codes 0..15. 8 bits: symmetric around 128.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if bits == 4:
        low = blocks.amin(dim=-1).clamp(max=0)
        high = blocks.amax(dim=-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-12)
        zero = torch.round(-low / scale).clamp(0, 15)
        codes = torch.round(blocks / scale[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        zero = zero.to(torch.uint8)
        if zero.shape[1] % 2:
            zero = torch.cat([zero, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
        zero_points = (zero[:, 0::2] | (zero[:, 1::2] << 4)).contiguous()
    else:
        scale = (blocks.abs().amax(dim=-1) / 127).clamp(min=1e-12)
        packed = (torch.round(blocks / scale[..., None]).clamp(-127, 127) + 128).to(torch.uint8).contiguous()
        zero_points = torch.full((n, k // BLOCK), 128, dtype=torch.uint8)
    return BlockWeights(packed.numpy(), scale.reshape(-1).contiguous().numpy(), zero_points.reshape(-1).numpy(),
                        n, k, bits)


def concat_blocks(parts: list[BlockWeights]) -> BlockWeights:
    """Rows of several ``BlockWeights`` (same ``k`` and bits) stacked, in order."""
    if len({(p.k, p.bits) for p in parts}) != 1:
        raise ValueError("concat_blocks needs parts of one width and one bit count")
    return BlockWeights(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                        np.concatenate([p.zero_points for p in parts]), sum(p.n for p in parts), parts[0].k,
                        parts[0].bits)


@functools.cache
def _share_thread_pool() -> None:
    """One intra-op thread pool for every session, as many threads as torch uses (a
    pool per session would start a thread set per layer)."""
    from onnxruntime.capi import _pybind_state

    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        logger.warning(
            "q4/q8 layers run on ONNX Runtime's threads between torch's and numba's OpenMP ones, which spin "
            "on the same cores after every parallel region unless OMP_WAIT_POLICY=PASSIVE is set before the "
            "process starts: the Qwen2.5 1.5B took 252 ms a token instead of 56 on 2 cores")

    threads = max(1, torch.get_num_threads())
    _pybind_state.set_global_thread_pool_sizes(threads, 1)


class BlockMatMul:
    """``x @ weight.T`` for one ``BlockWeights`` (fp32 rows in, fp32 rows out)."""

    def __init__(self, weights: BlockWeights):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        _share_thread_pool()
        self.n, self.k, self.bits = weights.n, weights.k, weights.bits
        node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                                K=self.k, N=self.n, bits=self.bits, block_size=BLOCK,
                                accuracy_level=_ACCURACY_LEVEL)
        graph = helper.make_graph(
            [node], "linear", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", self.k])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", self.n])],
            [numpy_helper.from_array(weights.codes, "B"), numpy_helper.from_array(weights.scales, "scales"),
             numpy_helper.from_array(weights.zero_points, "zero_points")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.use_per_session_threads = False
        # The engine's own threads (torch's OpenMP pool) run between these calls:
        # spinning ONNX Runtime threads would steal their cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_cpu_mem_arena = False  # inputs and outputs are ours; no arena to grow
        options.log_severity_level = 3
        self._session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        self._binding = self._session.io_binding()
        self._packed_bytes = weights.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        out = torch.empty(rows.shape[0], self.n, dtype=torch.float32)
        binding = self._binding
        binding.bind_input("A", "cpu", 0, np.float32, list(rows.shape), rows.data_ptr())
        binding.bind_output("Y", "cpu", 0, np.float32, list(out.shape), out.data_ptr())
        self._session.run_with_iobinding(binding)
        return out

    @property
    def nbytes(self) -> int:
        """The quantized weight's bytes (codes, scales, zero points)."""
        return self._packed_bytes

