"""Decoder layers streamed from host memory through a few device slots.

On CPU the "device" is host memory too: the same slots, views and copy order as on a
GPU, so a forward through streamed layers must give the resident forward's bits, over
several forwards in a row (the slots wrap from one forward into the next), whichever
layers stream and however many slots they share, and after a forward that failed part
way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedtree.loading.loader import load_model
from pagedtree.worker.layer_streaming import (
    LayerStreamer,
    StreamPlan,
    choose_streamed_layers,
    layer_stream_bytes,
    streamable_tensors,
)
from pagedtree.worker.models.linear import Linear
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A tiny Llama of five layers (so that two slots wrap unevenly)."""
    return save_tiny_model(tmp_path_factory.mktemp("five_layers"), "llama", seed=3, with_tokenizer=False,
                           num_hidden_layers=5)


def causal_attention(fail_at: int | None = None):
    """One sequence's causal attention over the forward's tokens (no KV cache); raises
    at layer ``fail_at``."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer == fail_at:
            raise RuntimeError("a failing layer")
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)

    return attend


def dense_model(path):
    return load_model(str(path), dtype=torch.float32, pack_weights=False).model


def forward(model, tokens: torch.Tensor, attention=None) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.numel()), attention or causal_attention())


@pytest.mark.parametrize("streamed, slots", [((0, 1, 2, 3, 4), 2), ((1, 3, 4), 2), ((0, 2, 4), 1), ((2,), 3)])
def test_streamed_layers_compute_the_resident_bits(five_layers, streamed, slots):
    resident, offloaded = dense_model(five_layers.path), dense_model(five_layers.path)
    streamer = LayerStreamer(offloaded.model.layers, StreamPlan(streamed, slots), torch.device("cpu"))
    offloaded.layer_streamer = streamer
    assert streamer.num_slots == min(slots, len(streamed))
    # The streamed weights are views of the slots: the layer-sized copies live in host buffers.
    slot_pointers = {slot.untyped_storage().data_ptr() for slot in streamer.slots}
    for index in streamed:
        for module, attr in streamable_tensors(offloaded.model.layers[index]):
            assert getattr(module, attr).untyped_storage().data_ptr() in slot_pointers
    assert streamer.slot_bytes == streamer.num_slots * max(layer_stream_bytes(offloaded.model.layers[i])
                                                             for i in streamed)
    g = torch.Generator().manual_seed(0)
    for length in (7, 1, 12):  # forwards in a row: each starts from the slots the last one refilled
        tokens = torch.randint(3, 256, (length,), generator=g)
        assert torch.equal(forward(offloaded, tokens), forward(resident, tokens))


def test_a_forward_that_fails_part_way_leaves_the_slots_ready(five_layers):
    resident, offloaded = dense_model(five_layers.path), dense_model(five_layers.path)
    offloaded.layer_streamer = LayerStreamer(offloaded.model.layers, StreamPlan((0, 1, 2, 3, 4), 2),
                                             torch.device("cpu"))
    tokens = torch.arange(3, 12)
    with pytest.raises(RuntimeError, match="a failing layer"):
        forward(offloaded, tokens, causal_attention(fail_at=3))
    assert torch.equal(forward(offloaded, tokens), forward(resident, tokens))


def test_streaming_needs_tensors_it_can_copy():
    """A layer whose weights a CPU library holds (q4 blocks) cannot be streamed."""
    pytest.importorskip("onnxruntime")
    layer = torch.nn.Sequential(Linear(64, 32, bias=False))
    layer[0].quantize("q4")
    with pytest.raises(ValueError, match="cannot be streamed"):
        streamable_tensors(layer)
    dense, int8 = Linear(64, 32, bias=False), Linear(64, 32, bias=False)
    int8.quantize("int8")
    assert streamable_tensors(torch.nn.Sequential(dense)) == [(dense, "weight")]
    assert streamable_tensors(torch.nn.Sequential(int8)) == [(int8, "qweight"), (int8, "qscales")]


@pytest.mark.parametrize("layers", [1, 5, 28, 80])
def test_streamed_layers_are_spread_over_the_stack(layers):
    for count in range(layers + 1):
        chosen = choose_streamed_layers(layers, count)
        assert len(chosen) == count and chosen == sorted(set(chosen)) and all(0 <= i < layers for i in chosen)
        if 1 < count < layers:  # resident layers sit between streamed ones, not all at one end
            gaps = [b - a for a, b in zip(chosen, chosen[1:])]
            assert max(gaps) - min(gaps) <= 1
            assert chosen[0] <= max(gaps) and layers - 1 - chosen[-1] <= max(gaps)
    with pytest.raises(ValueError):
        choose_streamed_layers(layers, layers + 1)
