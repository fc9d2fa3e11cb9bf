"""Device names: ``cuda`` is the current CUDA device, in checks and in the resolved config."""

from __future__ import annotations

import pytest
import torch

from pagedtree.config import EngineConfig
from pagedtree.devices import indexed_device, same_device
from pagedtree.kernels.attention_plan import validate_slots
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
    validate_slots(slots, 2, 8, torch.device("cpu", 0), (0, 3))
    with pytest.raises(ValueError, match="slot_mapping is on cpu, the KV cache on meta"):
        validate_slots(slots, 2, 8, torch.device("meta"), (0, 3))


@pytest.fixture
def cpuinfo(monkeypatch):
    """A /proc/cpuinfo of an AVX-512 machine with bf16, read afresh by ``cpu_flags``."""
    from pagedtree import devices

    text = "processor : 0\nmodel name : AMD EPYC\nflags : fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 amx_tile\n"
    monkeypatch.setattr(devices, "_cpuinfo_field",
                        lambda name: next((line.split(":", 1)[1].strip() for line in text.splitlines()
                                           if line.split(":", 1)[0].strip() == name), ""))
    monkeypatch.delenv(devices.HIDE_CPU_FLAGS_ENV, raising=False)  # as scripts/emulate_avx2.sh sets it
    devices.cpu_flags.cache_clear()
    yield devices
    devices.cpu_flags.cache_clear()


def test_hidden_cpu_flags_make_an_avx512_machine_an_avx2_one_to_the_engine(cpuinfo, monkeypatch):
    from pagedtree.loading.resolve import cpu_has_native_bf16, resolve_dtype

    native = cpuinfo.cpu_identity()
    assert "avx512_bf16" in cpuinfo.cpu_flags() and cpu_has_native_bf16()
    assert resolve_dtype("auto", None, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv(cpuinfo.HIDE_CPU_FLAGS_ENV, "avx512*, AMX*")
    cpuinfo.cpu_flags.cache_clear()
    assert cpuinfo.cpu_flags() == {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
    assert not cpu_has_native_bf16()
    assert resolve_dtype("auto", None, torch.device("cpu")) == torch.float32
    # Costs measured under the emulation are not taken for the machine's own, and the
    # other way round, though the model name is the same.
    assert cpuinfo.cpu_identity() != native and cpuinfo.cpu_identity().startswith("AMD EPYC [")
    monkeypatch.setenv(cpuinfo.HIDE_CPU_FLAGS_ENV, "avx512f")  # an exact name hides that flag only
    cpuinfo.cpu_flags.cache_clear()
    assert "avx512f" not in cpuinfo.cpu_flags() and "avx512bw" in cpuinfo.cpu_flags()


def test_the_tests_run_an_auto_engine_on_the_cpu_of_a_gpu_machine(monkeypatch):
    """(tests/conftest.py) Every place the engine resolves ``device="auto"`` takes the
    CPU in the tests of a GPU machine; a named device is kept."""
    from pagedtree.executor import launcher, worker
    from pagedtree.loading import resolve
    from tests.conftest import pin_auto_device_to_the_cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve.resolve_device("auto") == torch.device("cuda", 0)
    pin_auto_device_to_the_cpu(monkeypatch)
    for module in (resolve, worker, launcher):
        assert module.resolve_device("auto") == torch.device("cpu")
        assert module.resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_config(EngineConfig(model="m")).target.device == torch.device("cpu")
    # Those are all the engine's places (the GPU check resolves its own --device).
    from pathlib import Path

    package = Path(resolve.__file__).parents[1]
    users = {p.relative_to(package).as_posix() for p in package.rglob("*.py") if "resolve_device" in p.read_text()}
    assert users == {"loading/resolve.py", "executor/worker.py", "executor/launcher.py", "diagnostics/gpu_check.py"}
