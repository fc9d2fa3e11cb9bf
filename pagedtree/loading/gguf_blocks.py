"""llama.cpp's quantized blocks decoded, exactly, into ONNX Runtime's block layout.

Every llama.cpp block format used by the common files is a grid per block of 16 or 32
weights: ``weight = scale * code + minimum`` or ``scale * (code - zero)``. The
``MatMulNBits`` layout (``block_quant``) holds 4- or 8-bit codes with an fp32 scale
and an integer zero point per block, plus the fp32 ``offsets`` ``block_quant`` adds
for formats with a real minimum; so each format maps without rounding:

========  ===========================  =================================
format    stored                       blocks here
========  ===========================  =================================
Q4_0      d * (q - 8), 32 per block    4 bits, zero point 8
Q4_1      d * q + m                    4 bits, zero point, offset
Q4_K      d*sc * q - dmin*m, 32        4 bits, zero point, offset
Q5_0      d * (q - 16)                 8 bits, zero point 16
Q5_1      d * q + m                    8 bits, zero point, offset
Q5_K      d*sc * q - dmin*m, 32        8 bits, zero point, offset
Q6_K      d*sc * (q - 32), 16          8 bits (blocks of 16), zero 32
Q8_0      d * q, 32                    8 bits, zero point 128
========  ===========================  =================================

(the products of the fp16 ``d`` and the 6- or 8-bit sub-block scales are formed in
fp32, as llama.cpp's own dequantization forms them; where a block has a minimum, the
zero point is the integer nearest ``-minimum / scale`` and the offset the fp32
remainder, see ``_centered``). Other formats (the 2- and 3-bit
K-quants, the IQ families, dense tensors) return None; the loader rounds them to
8-bit blocks instead.

The layouts follow ggml's ``block_q*`` structs (ggml-common.h).
"""

from __future__ import annotations

import numpy as np

from pagedtree.worker.models.block_quant import BlockCodes

_QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (``[blocks, 2]`` bytes) as fp32 ``[blocks]``."""
    return np.ascontiguousarray(raw).view(np.float16)[:, 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Nibbles of ``[blocks, 16]`` bytes as ``[blocks, 32]`` codes: the low nibbles
    are elements 0..15, the high ones 16..31 (ggml's Q4_0/Q4_1/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits_of(qh: np.ndarray) -> np.ndarray:
    """The 32 high bits of Q5_0/Q5_1 blocks (``[blocks, 4]`` bytes, little-endian)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of each Q4_K/Q5_K super-block."""
    scales = scales.reshape(-1, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _centered(codes, scale, minimum, bits, block):
    """``scale * code + minimum`` as ``scale * (code - zero) + residual``, with the integer
    ``zero`` nearest ``-minimum / scale``: the same weight, but the codes centred, so
    that the int8 activations' rounding errors meet ``code - zero`` (about the weight)
    rather than ``code`` (the weight minus its block's minimum, twice as large), and
    the residual is small."""
    ratio = np.divide(-minimum, scale, out=np.zeros_like(minimum), where=scale != 0)
    zero = np.clip(np.rint(ratio), 0, (1 << bits) - 1)
    return codes, scale, zero.astype(np.uint8), (minimum + zero * scale).astype(np.float32), bits, block


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    codes = _low_high(b[:, 2:18])
    return codes, d[:, None], np.full((len(b), 1), 8, np.uint8), None, 4, 32


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _centered(_low_high(b[:, 4:20]), d[:, None], m[:, None], 4, 32)


def _q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    codes = _low_high(b[:, 6:22]) | (_bits_of(b[:, 2:6]) << 4)
    return codes, d[:, None], np.full((len(b), 1), 16, np.uint8), None, 8, 32


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    codes = _low_high(b[:, 8:24]) | (_bits_of(b[:, 4:8]) << 4)
    return _centered(codes, d[:, None], m[:, None], 8, 32)


def _q8_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    codes = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d[:, None], np.full((len(b), 1), 128, np.uint8), None, 8, 32


def _q4_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mins = k_scale_min(b[:, 4:16])
    # 128 bytes in four 32-byte chunks; chunk j holds sub-blocks 2j (low) and 2j+1 (high).
    qs = b[:, 16:144].reshape(-1, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return _centered(codes.reshape(-1, _QK_K), d[:, None] * sc, -(dmin[:, None] * mins), 4, 32)


def _q5_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mins = k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]  # bit i of byte l: the fifth bit of element l of sub-block i
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = np.unpackbits(qh[:, None, :], axis=1, count=8, bitorder="little")  # [blocks, 8 sub-blocks, 32]
    codes = low | (high << 4)
    return _centered(codes.reshape(-1, _QK_K), d[:, None] * sc, -(dmin[:, None] * mins), 8, 32)


def _q6_k(b: np.ndarray):
    ql = b[:, 0:128].reshape(-1, 2, 2, 32)  # [half, low/high 32 bytes of the half, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # 16 scales, one per 16 weights
    d = _f16(b[:, 208:210])
    # Within each 128-weight half: elements l, l+32, l+64, l+96 take the low nibble of
    # ql[l], the low of ql[l+32], the high of ql[l], the high of ql[l+32], and two bits
    # each (shifts 0, 2, 4, 6) of qh[l].
    nibbles = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    codes = nibbles | (high << 4)  # [blocks, 2, 4, 32] = element order
    return codes.reshape(-1, _QK_K), d[:, None] * sc, np.full(sc.shape, 32, np.uint8), None, 8, 16


# name -> (bytes per block, weights per block, decoder)
_FORMATS = {
    "Q4_0": (18, 32, _q4_0), "Q4_1": (20, 32, _q4_1), "Q5_0": (22, 32, _q5_0), "Q5_1": (24, 32, _q5_1),
    "Q8_0": (34, 32, _q8_0), "Q4_K": (144, _QK_K, _q4_k), "Q5_K": (176, _QK_K, _q5_k), "Q6_K": (210, _QK_K, _q6_k),
}
EXACT_FORMATS = tuple(_FORMATS)


def exact_bits(format_name: str) -> int | None:
    """The code width (4 or 8) a format decodes to, or None if it is not mapped."""
    return {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4}.get(format_name, 8 if format_name in _FORMATS else None)


def decode_blocks(raw: np.ndarray, format_name: str, rows: int, cols: int) -> BlockCodes | None:
    """The ``[rows, cols]`` weight stored as ``raw`` bytes in ``format_name``, as
    ``BlockCodes`` that represent it exactly (None for formats not mapped)."""
    if format_name not in _FORMATS:
        return None
    size, per_block, decode = _FORMATS[format_name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    if blocks.shape[0] * per_block != rows * cols:
        raise ValueError(f"{format_name} tensor of {blocks.shape[0]} blocks for a [{rows}, {cols}] weight")
    codes, scales, zeros, offsets, bits, block = decode(blocks)
    groups = cols // block
    shape = lambda a: None if a is None else np.ascontiguousarray(a, dtype=a.dtype).reshape(rows, groups)
    return BlockCodes(np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, cols), shape(scales).astype(np.float32),
                      shape(zeros).astype(np.uint8), None if offsets is None else shape(offsets).astype(np.float32),
                      bits, block)
