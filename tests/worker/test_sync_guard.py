"""``SyncGuard`` records each call that syncs host and device (on a CPU: that would
sync on a GPU), made by the code it watches, and nothing else.

Here the code watched is this module (``packages=(__name__,)``); each sync is made
in a helper of its own, so that the recorded function names say which were caught.
"""

from __future__ import annotations

import contextlib
import operator
import types
import warnings

import numpy as np
import pytest
import torch

from pagedtree.diagnostics.sync_guard import SyncError, SyncGuard

CPU = torch.device("cpu")


def _guard(**kwargs) -> SyncGuard:
    return SyncGuard(CPU, packages=(__name__,), **kwargs)


def _caught(calls, **kwargs) -> dict[str, set[str]]:
    """Run each call under a CPU guard: its name -> the kinds recorded in it."""
    with _guard(**kwargs) as guard:
        for call in calls:
            with contextlib.suppress(Exception):  # synchronize() refuses without a GPU
                call()
    out: dict[str, set[str]] = {}
    for sync in guard.syncs:
        out.setdefault(sync.function, set()).add(sync.kind)
    return out


# -------------------------------------------------------------- reads
x = torch.arange(6.0)
one = torch.tensor(3)
mask = x > 2


def _item(): x.sum().item()
def _tolist(): x.tolist()
def _cpu(): x.cpu()
def _numpy(): x.numpy()
def _int(): int(one)
def _float(): float(one)
def _bool(): bool(one)
def _index(): operator.index(one)
def _if(): return 1 if one else 0
def _asarray(): np.asarray(x)
def _format(): return f"{one}"


def test_host_reads_are_caught():
    calls = [_item, _tolist, _cpu, _numpy, _int, _float, _bool, _index, _if, _asarray, _format]
    caught = _caught(calls)
    assert caught == {
        "_item": {"item"}, "_tolist": {"tolist"}, "_cpu": {"cpu"}, "_numpy": {"numpy"}, "_int": {"__int__"},
        "_float": {"__float__"}, "_bool": {"__bool__"}, "_index": {"__index__"}, "_if": {"__bool__"},
        "_asarray": {"numpy"}, "_format": {"item"},
    }


# -------------------------------------------------------------- moves to the CPU
device = torch.device("cpu")  # the engine's device, on a CPU


def _to_string(): x.to("cpu")
def _to_device_object(): x.to(torch.device("cpu"))
def _to_device_keyword(): x.to(device="cpu")
def _to_device_keyword_object(): x.to(device=torch.device("cpu"), dtype=torch.float64)
def _to_string_and_dtype(): x.to("cpu", torch.float64)
def _to_cpu_variable():
    cpu_device = torch.device("cpu")
    x.to(cpu_device)
def _to_dtype(): x.to(torch.float64)
def _to_the_device(): x.to(device)
def _to_a_tensors_device(): x.to(mask.device)
def _to_another_tensor(): x.to(mask)


def test_moves_that_name_the_cpu_are_caught_moves_to_the_device_are_not():
    calls = [_to_string, _to_device_object, _to_device_keyword, _to_device_keyword_object, _to_string_and_dtype,
             _to_cpu_variable, _to_dtype, _to_the_device, _to_a_tensors_device, _to_another_tensor]
    caught = _caught(calls)
    named = {"_to_string", "_to_device_object", "_to_device_keyword", "_to_device_keyword_object",
             "_to_string_and_dtype", "_to_cpu_variable"}
    assert caught == {name: {"to(cpu)"} for name in named}


# -------------------------------------------------------------- host <-> device copies
on_device = torch.zeros(6)
host = torch.zeros(6)


def _copy_out(): host.copy_(on_device)
def _copy_out_of_a_view(): host[:3].copy_(on_device[3:])
def _copy_in(): on_device.copy_(host)
def _copy_in_non_blocking(): on_device[:2].copy_(host[:2], non_blocking=True)
def _upload_non_blocking(): host.to(device, non_blocking=True)
def _copy_on_device(): on_device[:3].copy_(on_device[3:])
def _copy_on_host(): host.copy_(x)
def _device_to_device_non_blocking(): on_device.to(device, non_blocking=True)


def test_copies_across_host_and_device_memory_are_caught():
    calls = [_copy_out, _copy_out_of_a_view, _copy_in, _copy_in_non_blocking, _upload_non_blocking,
             _copy_on_device, _copy_on_host, _device_to_device_non_blocking]
    with _guard() as guard:
        guard.mark_device(on_device)
        for call in calls:
            call()
    caught = {s.function: s.kind for s in guard.syncs}
    assert caught == {
        "_copy_out": "copy_ device-to-host", "_copy_out_of_a_view": "copy_ device-to-host",
        "_copy_in": "blocking copy_ host-to-device",
        "_copy_in_non_blocking": "non-blocking copy_ from pageable memory",
        "_upload_non_blocking": "non-blocking to() from pageable memory",
    }


# -------------------------------------------------------------- data-dependent shapes
probs = torch.tensor([0.2, 0.3, 0.5])
repeats = torch.tensor([1, 0, 2, 1, 1, 1])


def _nonzero(): torch.nonzero(mask)
def _nonzero_method(): mask.nonzero()
def _argwhere(): torch.argwhere(mask)
def _argwhere_method(): mask.argwhere()
def _where_condition(): torch.where(mask)
def _masked_select(): torch.masked_select(x, mask)
def _masked_select_method(): x.masked_select(mask)
def _bool_index(): x[mask]
def _bool_index_in_tuple(): x.reshape(2, 3)[mask.reshape(2, 3)[:, 0], 1:]
def _unique(): torch.unique(x)
def _unique_method(): x.unique()
def _unique_consecutive(): torch.unique_consecutive(x)
def _repeat_interleave(): torch.repeat_interleave(x, repeats)
def _repeat_interleave_method(): x.repeat_interleave(repeats)
def _repeat_interleave_repeats(): torch.repeat_interleave(repeats)
def _multinomial_one(): torch.multinomial(probs, 1, replacement=True)
def _multinomial_without_replacement(): torch.multinomial(probs, 2)
def _multinomial_method(): probs.multinomial(1)


def test_data_dependent_shapes_are_caught():
    calls = [_nonzero, _nonzero_method, _argwhere, _argwhere_method, _where_condition, _masked_select,
             _masked_select_method, _bool_index, _bool_index_in_tuple, _unique, _unique_method, _unique_consecutive,
             _repeat_interleave, _repeat_interleave_method, _repeat_interleave_repeats, _multinomial_one,
             _multinomial_without_replacement, _multinomial_method]
    with _guard() as guard:
        for call in calls:
            call()
    assert [s.function for s in guard.syncs] == [call.__name__ for call in calls]  # each once (nested calls not again)
    kinds = {s.function: s.kind for s in guard.syncs}
    assert kinds["_bool_index"] == kinds["_bool_index_in_tuple"] == "boolean-mask index"
    assert kinds["_where_condition"] == "where(condition)" and kinds["_unique_method"] == "unique"


# -------------------------------------------------------------- explicit synchronisation
def _cuda_synchronize(): torch.cuda.synchronize()
def _event_synchronize(): torch.cuda.Event.synchronize(object())  # no Event without a GPU
def _stream_synchronize(): torch.cuda.Stream.synchronize(object())
def _accelerator_synchronize(): torch.accelerator.synchronize()


def test_explicit_synchronize_calls_are_caught():
    calls = [_cuda_synchronize, _event_synchronize, _stream_synchronize, _accelerator_synchronize]
    assert _caught(calls) == {
        "_cuda_synchronize": {"torch.cuda.synchronize"}, "_event_synchronize": {"Event.synchronize"},
        "_stream_synchronize": {"Stream.synchronize"}, "_accelerator_synchronize": {"torch.accelerator.synchronize"},
    }


# -------------------------------------------------------------- what is not a sync
def _device_work():
    y = torch.softmax(x, dim=-1).cumsum(0)
    i = torch.searchsorted(y, torch.tensor([0.5]))
    z = torch.where(mask, x, -x)[i] + x[torch.tensor([0, 2])] + x[1:3].sum() + x[0]
    w = torch.topk(x, 2).indices.argmax() + torch.multinomial(probs, 4, replacement=True).sum()
    u = torch.repeat_interleave(x, 2) + 0 * torch.repeat_interleave(x, repeats, output_size=6).sum()
    v = x.index_select(0, torch.tensor([1])).to(torch.float64) + z.sum() + w + u.sum()
    x.new_zeros(3).index_fill_(0, torch.tensor([1]), 1.0).copy_(v.expand(3))
    return v


def test_device_work_is_not_caught():
    with _guard() as guard:
        guard.mark_device(x)
        _device_work()
    assert guard.syncs == [], [str(s) for s in guard.syncs]


# -------------------------------------------------------------- whose calls count
def _as_module(fn, module: str):
    return types.FunctionType(fn.__code__, {"__name__": module, "x": x, "torch": torch}, fn.__name__)


def _read_in_another_module():
    x.tolist()
    torch.nonzero(x)


def test_only_the_watched_packages_calls_count():
    calls = [_as_module(_read_in_another_module, "triton.runtime.interpreter"),
             _as_module(_read_in_another_module, f"{__name__}_not_a_submodule"),
             _as_module(_read_in_another_module, f"{__name__}.submodule")]
    assert _caught(calls) == {"_read_in_another_module": {"tolist", "nonzero"}}
    # pagedtree's own guard watches pagedtree only: this module's reads are not its business.
    with SyncGuard(CPU) as guard:
        _item()
    assert guard.syncs == []


def test_recording_only_while_active_and_check():
    with _guard(active=False) as guard:
        _item()
        with guard.recording():
            _tolist()
        _cpu()
    assert [s.function for s in guard.syncs] == ["_tolist"]
    assert str(guard.syncs[0]).startswith(f"tolist at {__name__}:")
    with pytest.raises(SyncError, match=f"1 host-device syncs by {__name__} code:\n  tolist at"):
        guard.check()
    guard.clear()
    guard.check()


def test_leaving_the_guard_restores_torch():
    before = {name: vars(torch.Tensor).get(name) for name in ("item", "__getitem__", "to", "copy_", "__bool__")}
    functions = (torch.nonzero, torch.where, torch.multinomial, torch.cuda.synchronize, torch.cuda.Event.synchronize)
    with _guard():
        assert torch.Tensor.item is not before["item"] and torch.nonzero is not functions[0]
    assert {name: vars(torch.Tensor).get(name) for name in before} == before
    assert (torch.nonzero, torch.where, torch.multinomial, torch.cuda.synchronize,
            torch.cuda.Event.synchronize) == functions
    with _guard() as guard:
        with pytest.raises(RuntimeError, match="installed already"):
            guard.__enter__()


# -------------------------------------------------------------- CUDA
def _synchronizing_op():
    warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)")


def _other_warning():
    warnings.warn("something else")


def test_the_cuda_guard_records_torchs_sync_warnings(monkeypatch):
    """The CUDA guard's plumbing, with torch's debug mode stood in for: each sync
    warning is recorded at the watched code that made it, whatever the warning
    filters say, and nothing else is."""
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    shown = warnings.showwarning
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("ignore")
        with SyncGuard("cuda", packages=(__name__,)) as guard:
            _synchronizing_op()
            _synchronizing_op()
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                _other_warning()
            guard.active = False
            _synchronizing_op()
    assert modes == ["warn", 0] and warnings.showwarning is shown
    assert [(s.function, s.kind) for s in guard.syncs] == [("_synchronizing_op", "synchronizing CUDA operation")] * 2
    assert [str(w.message) for w in others] == ["something else"]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a GPU's syncs")


@needs_cuda
def test_the_cuda_guard_counts_the_syncs_torch_reports():
    previous = torch.cuda.get_sync_debug_mode()
    x_gpu = torch.arange(6.0, device="cuda")
    pinned = torch.ones(6).pin_memory()

    def read(): x_gpu.sum().item()
    def nonzero(): torch.nonzero(x_gpu > 2)
    def bool_index(): x_gpu[x_gpu > 2]
    def blocking_copy_out(): torch.empty(6).copy_(x_gpu)
    def pageable_upload(): torch.ones(6).to("cuda", non_blocking=True)
    def synchronize(): torch.cuda.synchronize()
    def event_synchronize():
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
    def device_work():
        y = torch.where(x_gpu > 2, x_gpu, -x_gpu).softmax(-1).cumsum(0)
        torch.searchsorted(y, torch.rand(1, device="cuda")) + torch.topk(y, 2).indices.argmax()
        pinned.to("cuda", non_blocking=True).add_(1)
        torch.ones(6).sum().item()  # a host tensor: no sync

    with SyncGuard("cuda", packages=(__name__,)) as guard:
        assert torch.cuda.get_sync_debug_mode() != 0
        for call in (read, nonzero, bool_index, blocking_copy_out, pageable_upload, synchronize, event_synchronize,
                     device_work):
            call()
    assert torch.cuda.get_sync_debug_mode() == previous
    assert {s.function for s in guard.syncs} == {"read", "nonzero", "bool_index", "blocking_copy_out",
                                                 "pageable_upload", "synchronize", "event_synchronize"}
