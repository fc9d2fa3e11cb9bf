"""Every attention backend implements the one interface and is made by name."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedtree.attention import ATTENTION_BACKENDS, BACKENDS, AttentionBackend, make_backend
from pagedtree.step_data import AttentionMetadata
from tests.attention import fake_flashinfer


def _caches(layers=2, blocks=4, block_size=4, kv_heads=2, head_dim=8):
    shape = (blocks, block_size, kv_heads, head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(layers)]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_registered_backend_implements_the_interface_and_agrees_with_torch(name, monkeypatch):
    torch.manual_seed(0)
    head_dim = 8
    if name == "flashinfer":  # FlashInfer's wrappers as its documentation reads them; its head dims
        monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
        head_dim = 64
    caches, reference_caches = _caches(head_dim=head_dim), _caches(head_dim=head_dim)
    backend = make_backend(name, caches, 0.5)
    reference = make_backend("torch", reference_caches, 0.5)
    assert isinstance(backend, AttentionBackend) and backend.name == name
    # One request: a 3-token prefill chunk into block 1.
    q, k, v = torch.randn(3, 4, head_dim), torch.randn(3, 2, head_dim), torch.randn(3, 2, head_dim)
    outputs = []
    for b in (backend, reference):
        meta = AttentionMetadata(block_size=4, slot_mapping=torch.tensor([4, 5, 6]), query_start_loc=[0, 3],
                                 context_lens=[3], block_tables=[[1]], tree_parents=[None], slot_bounds=(4, 6))
        b.begin_step(meta)
        outputs.append(b(0, q, k, v))
        b.copy_blocks([1], [2])
        b.copy_slots([4], [0])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(caches[0][0][2], caches[0][0][1]) and torch.equal(caches[0][0][0, 0], k[0])


def test_an_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        make_backend("flash", _caches(), 1.0)
    assert set(ATTENTION_BACKENDS) == {"auto", "torch", "cpu", "triton", "flashinfer"}
    assert ATTENTION_BACKENDS[0] == "auto"


def test_a_backend_missing_a_method_cannot_be_made():
    class Partial(AttentionBackend):
        def begin_step(self, meta, static=None, num_heads=0):
            pass

    with pytest.raises(TypeError):
        Partial(_caches(), 1.0)
