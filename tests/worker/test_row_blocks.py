"""Row-wise work in fixed blocks of rows (what CUDA engines run): a row's result is
the same bits whether it is computed alone, in a decode batch or among a 64-node
tree's 65 rows, because every library call has the same shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedtree.loading.loader import load_model
from pagedtree.worker.models.decoder import RMSNorm
from pagedtree.worker.models.linear import Linear
from pagedtree.worker.models.row_blocks import in_row_blocks, row_block_for

BLOCK = 16


def _rows_alone_and_in_batches(layer, x: torch.Tensor) -> None:
    """Every slice of ``x`` (1-65 rows at its start and end) gives the full batch's rows."""
    full = layer(x)
    for rows in (1, 2, 3, 16, 17, 33, 64, 65):
        for start in (0, x.shape[0] - rows):
            assert torch.equal(layer(x[start:start + rows]), full[start:start + rows]), (rows, start)


def test_in_row_blocks_calls_one_shape_and_keeps_the_rows():
    shapes = []

    def double(block: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(block.shape))
        return block * 2

    x = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    out = in_row_blocks(x, BLOCK, double)
    assert torch.equal(out, x * 2) and set(shapes) == {(BLOCK, 3)} and len(shapes) == 5
    shapes.clear()
    assert torch.equal(in_row_blocks(x[:1], BLOCK, double), x[:1] * 2) and shapes == [(BLOCK, 3)]
    # No rows (a prefill chunk that does not end its prompt asks the LM head for none):
    # an empty result of fn's width, from a call of the same shape.
    shapes.clear()
    wide = in_row_blocks(x[:0], BLOCK, lambda block: double(block).repeat(1, 2))
    assert wide.shape == (0, 6) and shapes == [(BLOCK, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_layer_in_row_blocks_gives_a_row_the_same_bits_in_any_batch(dtype, monkeypatch):
    """Every product has exactly ``row_block`` rows; a row's bits do not depend on
    the rows beside it (4864 x 896: the 0.5B's down projection)."""
    torch.manual_seed(0)
    layer = Linear(4864, 896, bias=True).to(dtype)
    layer.row_block = BLOCK
    x = torch.randn(65, 4864).to(dtype)
    rows_seen = set()
    linear = F.linear

    def counting(rows, weight, bias=None):
        rows_seen.add(rows.shape[0])
        return linear(rows, weight, bias)

    monkeypatch.setattr(F, "linear", counting)
    with torch.inference_mode():
        _rows_alone_and_in_batches(layer, x)
        assert rows_seen == {BLOCK}
        # Batched leading dimensions keep their shape.
        assert layer(x.view(5, 13, 4864)).shape == (5, 13, 896)


def test_an_rms_norm_in_row_blocks_gives_a_row_the_same_bits_in_any_batch():
    torch.manual_seed(0)
    norm = RMSNorm(1536, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    norm.row_block = BLOCK
    rows_seen = set()
    normalize = norm._normalize

    def counting(rows: torch.Tensor) -> torch.Tensor:
        rows_seen.add(rows.shape[0])
        return normalize(rows)

    norm._normalize = counting
    x = torch.randn(65, 1536).to(torch.bfloat16) * 3
    with torch.inference_mode():
        _rows_alone_and_in_batches(norm, x)
        assert rows_seen == {BLOCK}
        norm.row_block = None  # the same normalisation, unblocked
        torch.testing.assert_close(norm(x), in_row_blocks(x, BLOCK, normalize), rtol=0, atol=0)


def test_row_blocks_switch_every_dense_product_and_norm(tiny_llama):
    """``make_rows_consistent(row_block)`` (what a CUDA engine calls): every dense
    linear layer and RMSNorm of the model computes in row blocks."""
    model = load_model(tiny_llama.path, pack_weights=False).model
    switched = model.make_rows_consistent(BLOCK)
    layers = [m for m in model.modules() if isinstance(m, (Linear, RMSNorm))]
    assert switched == len(layers) and all(m.row_block == BLOCK for m in layers)


def test_the_row_block_is_about_the_gpus_ridge_point(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert row_block_for(torch.device("cuda")) == 256
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert row_block_for(torch.device("cuda")) == 128
