"""llama.cpp's block formats decode exactly into ONNX Runtime's block layout."""

import numpy as np
import pytest
import torch

from pagedtree.loading import gguf_blocks
from pagedtree.worker.models import block_quant

gguf = pytest.importorskip("gguf")

# name -> (bytes per block, weights per block, byte offsets of its fp16 fields)
_LAYOUT = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q5_0": (22, 32, (0,)), "Q5_1": (24, 32, (0, 2)),
           "Q8_0": (34, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "Q5_K": (176, 256, (0, 2)), "Q6_K": (210, 256, (208,))}


def _random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in ``name``'s layout, with finite fp16 scales (any other byte is valid)."""
    size, per_block, halves = _LAYOUT[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, size), dtype=np.uint8)
    for at in halves:
        blocks[:, at : at + 2] = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(_LAYOUT))
def test_every_mapped_format_decodes_to_the_files_own_values(name):
    rows, cols = 6, 512
    raw = _random_blocks(name, rows, cols)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    codes = gguf_blocks.decode_blocks(raw, name, rows, cols)
    assert codes.bits == gguf_blocks.exact_bits(name)
    got = block_quant.pack_blocks(codes).dequantize().numpy()
    # The same products in fp32 (scale x code, plus the minimum): equal up to the
    # order numpy and we round them in.
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_widening_and_concatenation_keep_the_weights():
    q4k = gguf_blocks.decode_blocks(_random_blocks("Q4_K", 4, 256, 1), "Q4_K", 4, 256)
    q6k = gguf_blocks.decode_blocks(_random_blocks("Q6_K", 3, 256, 2), "Q6_K", 3, 256)
    q8 = gguf_blocks.decode_blocks(_random_blocks("Q8_0", 2, 256, 3), "Q8_0", 2, 256)
    merged = block_quant.concat_blocks([q4k, q6k, q8])
    assert (merged.bits, merged.block, merged.offsets is not None) == (8, 16, True)
    expected = torch.cat([block_quant.pack_blocks(p).dequantize() for p in (q4k, q6k, q8)])
    torch.testing.assert_close(merged.dequantize(), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot narrow"):
        q6k.widened(4, 16, False)


def test_unmapped_formats_and_wrong_sizes_are_refused():
    assert gguf_blocks.decode_blocks(np.zeros((2, 8), np.uint8), "Q2_K", 2, 256) is None
    assert gguf_blocks.exact_bits("F16") is None
    with pytest.raises(ValueError, match="Q8_0 tensor of 2 blocks"):
        gguf_blocks.decode_blocks(np.zeros((2, 34), np.uint8), "Q8_0", 4, 32)


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_block_matmul_multiplies_the_decoded_weight(name):
    pytest.importorskip("onnxruntime")
    rows, cols = 64, 512
    codes = gguf_blocks.decode_blocks(_random_blocks(name, rows, cols, 4), name, rows, cols)
    weights = block_quant.pack_blocks(codes)
    matmul = block_quant.BlockMatMul(weights)
    x = torch.randn(5, cols)
    expected = x @ weights.dequantize().T
    got = matmul(x)
    # int8 activations per block: within a few hundredths of the output's scale.
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    # rows do not depend on each other (the offsets' block sums included)
    torch.testing.assert_close(matmul(x[2:4]), got[2:4], rtol=0, atol=0)
