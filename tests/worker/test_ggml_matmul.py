"""llama.cpp's block formats through ggml's kernels: products against gguf-py's own
dequantization, several checkpoint tensors of different formats in one layer, rows
independent of their batch, and a GGUF model end to end."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

ggml = pytest.importorskip("ggml")

from pagedtree.worker.models import ggml_matmul  # noqa: E402
from pagedtree.worker.models.ggml_matmul import GgmlBlocks, GgmlMatMul  # noqa: E402
from pagedtree.worker.models.linear import Linear  # noqa: E402


def _blocks(weight: torch.Tensor, type_name: str) -> GgmlBlocks:
    """``weight`` in ``type_name`` blocks, by ggml's quantizer (as llama-quantize)."""
    n, k = weight.shape
    type_id = ggml_matmul.ggml_type(type_name)
    data = np.empty((n, ggml.ggml_row_size(type_id, k)), np.uint8)
    values = weight.float().contiguous().numpy()
    ggml.ggml_quantize_chunk(type_id, values.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                             data.ctypes.data_as(ctypes.c_void_p), 0, n, k, None)
    return GgmlBlocks(type_name, data, k)


def _dequantized(blocks: GgmlBlocks) -> torch.Tensor:
    """The weight the blocks stand for, by gguf-py's numpy code (independent of ggml)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(blocks.data, GGMLQuantizationType[blocks.type_name])
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.n, blocks.k))


# The formats of the packaged files (Q4_K_M: Q4_K and Q6_K; SmolLM2: Q4_1) and others
# llama.cpp writes, in the shapes that matter: the 8-row repack groups of Q4_K, an odd
# row count, a Qwen2.5 0.5B width (896 = 3.5 x 256: Q8_0 then).
FORMATS = [("Q4_K", 1536), ("Q6_K", 512), ("Q8_0", 896), ("Q4_0", 256), ("Q4_1", 576), ("Q5_K", 256), ("F32", 64)]


@pytest.mark.parametrize("type_name,k", FORMATS)
@pytest.mark.parametrize("n", [8, 24, 37])
def test_products_equal_the_dequantized_weight_up_to_the_rounding_of_the_activations(type_name, k, n):
    """ggml rounds each row of activations to 8-bit blocks (Q8_K or Q8_0/Q8_1), so a
    product is the dequantized weight's up to about 1% of its scale; F32 weights
    multiply exactly (to fp32 rounding)."""
    if type_name in ("Q4_K", "Q6_K", "Q5_K") and k % 256:
        pytest.skip("K-quants need rows of a multiple of 256")
    torch.manual_seed(n)
    blocks = _blocks(torch.randn(n, k) * 0.05, type_name)
    matmul = GgmlMatMul([blocks])
    x = torch.randn(5, k)
    expected = x @ _dequantized(blocks).t()
    got = matmul(x)
    assert got.shape == (5, n) and got.dtype == torch.float32
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < (1e-5 if type_name == "F32" else 0.02), error


def test_a_layer_of_several_tensors_of_different_formats_writes_each_ones_columns():
    """A fused q/k/v layer of a Q4_K_M file: its three tensors in two formats, one
    ``[rows, n]`` output whose columns are each tensor's product, in order."""
    torch.manual_seed(0)
    parts = [_blocks(torch.randn(n, 512) * 0.05, t) for n, t in ((64, "Q4_K"), (16, "Q4_K"), (16, "Q6_K"))]
    matmul = GgmlMatMul(parts)
    assert matmul.n == 96 and matmul.types == ["Q4_K", "Q4_K", "Q6_K"]
    x = torch.randn(7, 512)
    whole = matmul(x)
    start = 0
    for part in parts:
        alone = GgmlMatMul([part])(x)
        assert torch.equal(whole[:, start:start + part.n], alone)
        start += part.n


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_a_row_gets_the_same_bits_alone_and_at_any_place_in_any_batch(type_name):
    """Tree verification needs a token's logits independent of the rows beside it
    (greedy speculation equals plain decoding): a row alone, and a row anywhere in a
    product of 2-65 rows (a 64-node tree and its root), give the same bits."""
    torch.manual_seed(1)
    k = 512 if type_name != "Q4_1" else 576
    matmul = GgmlMatMul([_blocks(torch.randn(64, k) * 0.05, type_name)])
    x = torch.randn(65, k)
    full = matmul(x)
    for rows in (1, 2, 3, 4, 5, 8, 16, 17, 64):
        for start in sorted({0, (65 - rows) // 2, 65 - rows}):
            assert torch.equal(matmul(x[start:start + rows]), full[start:start + rows]), (rows, start)


def test_rows_that_do_not_match_the_format_are_refused():
    blocks = _blocks(torch.randn(8, 256), "Q4_K")
    with pytest.raises(ValueError, match=r"Q4_K rows of 512 values take 288 bytes, got rows of \(144,\)"):
        GgmlMatMul([GgmlBlocks("Q4_K", blocks.data, 512)])
    with pytest.raises(ValueError, match="ggml has no type 'Q9_Z'"):
        GgmlMatMul([GgmlBlocks("Q9_Z", blocks.data, 256)])
    with pytest.raises(ValueError, match="Q4_K rows hold a multiple of 256 values, not 896"):
        GgmlMatMul([GgmlBlocks("Q4_K", np.zeros((8, 504), np.uint8), 896)])
    with pytest.raises(ValueError, match="Q4_K needs in_features divisible by 256, got 896"):
        ggml_matmul.quantize_rows(torch.randn(8, 896), "Q4_K")
    with pytest.raises(ValueError, match="one width"):
        GgmlMatMul([blocks, _blocks(torch.randn(8, 512), "Q4_K")])


def test_a_dense_layer_quantizes_to_q4_k_or_q8_0_by_its_width():
    """``quantize("ggml")`` rounds a dense weight as llama-quantize would: Q4_K for
    rows of a multiple of 256, Q8_0 otherwise; bias added, bf16 in gives bf16 out."""
    torch.manual_seed(0)
    for k, kind in ((512, "Q4_K"), (96, "Q8_0")):
        layer = Linear(k, 16, bias=True)
        dense, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
        layer.quantize("ggml")
        assert layer.weight is None and layer.quantization == "ggml" and layer.block_matmul.types == [kind]
        x = torch.randn(3, k)
        expected = x @ dense.t() + bias
        assert ((layer(x) - expected).norm() / expected.norm()).item() < 0.1
        assert layer(x.bfloat16()).dtype == torch.bfloat16
        assert layer.weight_bytes == layer.block_matmul.nbytes > 0


def test_graphs_per_row_count_stay_bounded():
    matmul = GgmlMatMul([_blocks(torch.randn(8, 256), "Q4_K")])
    for rows in range(1, ggml_matmul.GRAPH_CACHE + 10):
        matmul(torch.randn(rows, 256))
    assert len(matmul._graphs) == ggml_matmul.GRAPH_CACHE
    assert matmul(torch.randn(0, 256)).shape == (0, 8)


def test_the_repacked_layout_gives_the_same_products_up_to_rounding():
    """``repack=True`` takes llama.cpp's interleaved layout where this CPU's ggml has
    one for the type (Q4_K on AVX2 and AVX-512): the same products up to the order of
    the sums."""
    torch.manual_seed(2)
    blocks = _blocks(torch.randn(64, 512) * 0.05, "Q4_K")
    x = torch.randn(9, 512)
    plain, repacked = GgmlMatMul([blocks])(x), GgmlMatMul([blocks], repack=True)(x)
    torch.testing.assert_close(repacked, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name,k", [("Q4_K", 512), ("Q5_0", 96), ("Q6_K", 256), ("F32", 48)])
def test_looked_up_rows_are_the_tables_dequantized_rows(type_name, k):
    """An embedding kept in GGUF blocks (``GgmlRows``): any ids, in any shape and
    order, repeated or not, give the rows gguf-py's dequantization gives; ids outside
    the table are refused, none at all give no rows."""
    from pagedtree.worker.models.ggml_rows import GgmlRows

    torch.manual_seed(3)
    blocks = _blocks(torch.randn(40, k), type_name)
    table = _dequantized(blocks)
    rows = GgmlRows(blocks)
    for ids in (torch.tensor([7]), torch.tensor([39, 0, 7, 7, 12]), torch.randint(0, 40, (3, 4))):
        torch.testing.assert_close(rows(ids), table[ids], rtol=1e-6, atol=1e-6)
    assert rows(torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 40\)"):
        rows(torch.tensor([3, 40]))
