"""Device names: ``cuda`` is the current CUDA device, in checks and in the resolved config."""

from __future__ import annotations

import pytest
import torch

from pagedtree.config import EngineConfig
from pagedtree.devices import indexed_device, same_device
from pagedtree.kernels.attention_plan import _validate_slots
from pagedtree.loading.resolve import resolve_config, resolve_device


@pytest.fixture
def cuda_device_1(monkeypatch):
    """A machine whose current CUDA device is 1 (nothing is placed on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


def test_unindexed_cuda_is_the_current_device(cuda_device_1):
    assert indexed_device("cuda") == torch.device("cuda", 1)
    assert indexed_device(torch.device("cuda:0")) == torch.device("cuda", 0)
    assert indexed_device("cpu") == torch.device("cpu")
    assert same_device(torch.device("cuda"), torch.device("cuda:1"))
    assert same_device("cuda:1", "cuda")
    assert not same_device("cuda", "cuda:0")
    assert not same_device("cuda:0", "cuda:1")
    assert not same_device("cuda", "cpu")
    assert same_device("cpu", torch.device("cpu", 0))


def test_same_device_asks_cuda_only_for_an_unindexed_cuda_device(monkeypatch):
    def no_cuda() -> int:
        raise AssertionError("asked CUDA for its current device")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    assert same_device("cuda", "cuda") and same_device("cuda:0", torch.device("cuda", 0))
    assert not same_device("cuda", "cpu") and not same_device("cuda:0", "cuda:1")


def test_the_engine_device_is_resolved_with_its_index(cuda_device_1, tiny_llama):
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cpu") == torch.device("cpu")
    resolved = resolve_config(EngineConfig(model=str(tiny_llama.path), device="cuda",
                                           draft_model=str(tiny_llama.path)))
    assert resolved.target.device == torch.device("cuda", 1)
    assert [d.device for d in resolved.drafts] == [torch.device("cuda", 1)]


def test_no_cuda_is_named_when_cuda_is_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


def test_a_kernel_check_takes_the_same_device_under_another_name():
    """What failed on the first GPU: slots on ``cuda:0``, the cache's device named
    ``cuda``; on a CPU, ``cpu`` and ``cpu:0`` stand for the two names."""
    slots = torch.tensor([0, 3], dtype=torch.int32)
    _validate_slots(slots, 2, 8, torch.device("cpu", 0), (0, 3))
    with pytest.raises(ValueError, match="slot_mapping is on cpu, the KV cache on meta"):
        _validate_slots(slots, 2, 8, torch.device("meta"), (0, 3))
