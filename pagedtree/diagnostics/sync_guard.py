"""A guard that records the host<->device synchronisations pagedtree code makes.

An engine step on a GPU should sync host and device once, at its readback. While a
:class:`SyncGuard` is installed and ``active``, every call that syncs (or, on a CPU,
that would sync on a GPU) is recorded with the pagedtree line that made it::

    with SyncGuard(torch.device("cuda")) as guard:
        run_one_step()
    guard.check()  # raises SyncError listing every sync

Only calls made by pagedtree code count: the guard walks the stack past torch's own
Python frames to the first other frame, and records the call only when that frame's
module belongs to ``packages``. A read made by Triton's interpreter (which copies
kernel arguments to the host, and does not exist on a GPU) is Triton's, not
pagedtree's.

**On CUDA** the measure is torch's own: ``torch.cuda.set_sync_debug_mode("warn")``
makes every synchronising operation warn (``.item()``, ``.tolist()``, blocking
copies either way, ``nonzero``, boolean-mask indexing, ``unique`` and the like); the
guard counts those warnings. It also records what the debug mode does not report:
``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``,
``torch.cuda.Stream.synchronize`` (and ``torch.accelerator.synchronize``), and
non-blocking host-to-device copies from pageable (not pinned) memory, which the
host thread copies into a staging buffer before it goes on (not asynchronous).

**On a CPU** nothing syncs, so the guard patches the torch calls that would:

- reads: ``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``__int__``,
  ``__float__``, ``__bool__``, ``__index__`` (and what goes through them: ``int(t)``,
  ``if t:``, ``np.asarray(t)``, formatting a tensor);
- moves to the CPU: ``.to(target)`` whose target names the CPU: the string
  ``"cpu"`` (positional or ``device=``), or a CPU ``torch.device`` on a call whose
  source text says ``cpu`` (``.to(torch.device("cpu"))``, ``.to(device=cpu_device)``).
  On a CPU the engine's device *is* the CPU, so a device taken from a variable or a
  tensor (``.to(device)``, ``.to(x.device)``: a move between device tensors on a
  GPU) cannot be told from the host; a host device kept in a variable whose name
  does not say ``cpu`` is missed there (the CUDA guard sees it);
- data-dependent shapes: ``nonzero``, ``argwhere``, one-argument ``where``,
  ``masked_select``, indexing with a boolean (or uint8) mask, ``unique``,
  ``unique_consecutive``, and ``repeat_interleave`` with tensor repeats and no
  ``output_size``;
- ``multinomial`` with one sample or without replacement: there torch checks the
  distribution with host reads (``.item()``) in older releases (newer ones assert
  on the device); with replacement and several samples it is kernels only in
  every release, and is not recorded;
- copies between host and device memory, which a CPU cannot tell apart by device:
  the guard knows the tensors given to :meth:`SyncGuard.mark_device` as device
  memory (by storage). ``copy_`` from marked into unmarked memory is a
  device-to-host copy; into marked memory from unmarked, a host-to-device copy
  (blocking, or non-blocking from pageable memory: nothing is pinned on a CPU); a
  non-blocking ``.to()`` of an unmarked tensor is an upload from pageable memory;
- the explicit synchronize calls listed for CUDA (recorded before torch refuses
  them for want of a GPU).

A patched call made inside another (``Tensor.unique`` calls ``torch.unique``) is
not recorded again: the outermost one decides.
"""

from __future__ import annotations

import linecache
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

_SYNC_WARNING = "called a synchronizing CUDA operation"
_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
_SKIPPED_MODULES = ("torch", "warnings", __name__)

# A check gets a patched call's arguments and returns what the call is (recorded),
# None (not a sync), or (kind, test): recorded if ``test(caller frame)`` holds.
Check = Callable[..., "str | tuple[str, Callable[[FrameType], bool]] | None"]


class SyncError(AssertionError):
    """Raised by :meth:`SyncGuard.check` when pagedtree code synced."""


@dataclass(frozen=True, slots=True)
class Sync:
    """One recorded synchronisation: what it was and the pagedtree line that made it."""

    kind: str
    module: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.module}:{self.lineno} ({self.function})"


def _caller_module(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outwards that is not torch's, the warnings
    machinery's or this module's."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == m or module.startswith(m + ".") for m in _SKIPPED_MODULES):
            return frame
        frame = frame.f_back
    return None


def _call_text(frame: FrameType) -> str:
    """The source of the call ``frame`` is making ('' when the source is unknown)."""
    lines = linecache.getlines(frame.f_code.co_filename)
    try:
        start, end, col, end_col = list(frame.f_code.co_positions())[frame.f_lasti // 2]
    except (AttributeError, IndexError, ValueError):  # Python 3.10: the whole line
        start, end, col, end_col = frame.f_lineno, frame.f_lineno, None, None
    if start is None or not lines:
        return ""
    text = lines[start - 1:(end or start)]
    if col is not None and end_col is not None:  # byte offsets into the first and last lines
        if len(text) == 1:
            return text[0].encode()[col:end_col].decode(errors="replace")
        text = [text[0].encode()[col:].decode(errors="replace"), *text[1:-1],
                text[-1].encode()[:end_col].decode(errors="replace")]
    return "".join(text)


def _names_cpu(frame: FrameType) -> bool:
    return "cpu" in _call_text(frame)


def _is_bool_index(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in index)
    return False


def _target_device(args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """The device and ``non_blocking`` of a ``Tensor.to`` call (None: a dtype change)."""
    try:
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None, False  # the real call raises its own error
    return device, bool(non_blocking)


def _names_cpu_string(args: tuple, kwargs: dict) -> bool:
    target = args[0] if args else kwargs.get("device")
    return isinstance(target, str) and torch.device(target).type == "cpu"


class SyncGuard:
    """Records the host<->device synchronisations made by ``packages`` code (module
    docstring). Install it with ``with``; it records while ``active``.

    ``device`` is the device the engine runs on: CUDA uses torch's sync debug mode,
    anything else the patched calls that would sync on a GPU.
    """

    def __init__(self, device: torch.device | str = "cpu", packages: Sequence[str] = ("pagedtree",),
                 active: bool = True):
        self.device = torch.device(device)
        self.packages = tuple(packages)
        self.active = active
        self.syncs: list[Sync] = []
        self._device_storages: dict[int, torch.Tensor] = {}
        self._restore: list[Callable[[], None]] = []
        self._local = threading.local()
        self._installed = False

    # ------------------------------------------------------------ the record
    @property
    def cuda(self) -> bool:
        """Whether the guard measures a CUDA device (else it stands in for one)."""
        return self.device.type == "cuda"

    def check(self) -> None:
        """Raise :class:`SyncError` listing every recorded sync, if there is any."""
        if self.syncs:
            raise SyncError(f"{len(self.syncs)} host-device syncs by {', '.join(self.packages)} code:\n"
                            + "\n".join(f"  {s}" for s in self.syncs))

    def clear(self) -> None:
        """Forget what was recorded."""
        self.syncs = []

    @contextmanager
    def recording(self) -> Iterator[SyncGuard]:
        """Record only inside this block (the guard must be installed)."""
        previous, self.active = self.active, True
        try:
            yield self
        finally:
            self.active = previous

    def mark_device(self, *tensors: torch.Tensor) -> None:
        """Treat these tensors' storages as device memory (CPU guard: copies into or
        out of them cross host and device)."""
        for t in tensors:
            self._device_storages[t.untyped_storage().data_ptr()] = t

    def _on_device(self, tensor: torch.Tensor) -> bool:
        if self.cuda:
            return tensor.device.type == "cuda"
        return tensor.untyped_storage().data_ptr() in self._device_storages

    def _record(self, kind: str | tuple[str, Callable[[FrameType], bool]], frame: FrameType | None) -> None:
        caller = _caller_module(frame)
        if caller is None:
            return
        module = caller.f_globals.get("__name__", "")
        if not any(module == p or module.startswith(p + ".") for p in self.packages):
            return
        if isinstance(kind, tuple):
            kind, test = kind
            if not test(caller):
                return
        self.syncs.append(Sync(kind, module, caller.f_lineno, caller.f_code.co_name))

    # ------------------------------------------------------------ installing
    def __enter__(self) -> SyncGuard:
        if self._installed:
            raise RuntimeError("this SyncGuard is installed already")
        self._installed = True
        try:
            self._install_cuda() if self.cuda else self._install_cpu()
            self._install_synchronize()
        except BaseException:
            self._uninstall()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._uninstall()

    def _uninstall(self) -> None:
        while self._restore:
            self._restore.pop()()
        self._installed = False

    def _patch(self, owner: Any, name: str, check: Check, owns: bool = True) -> None:
        """Replace ``owner.name`` by a wrapper that records ``check(*args)`` (a kind,
        or None) for calls by ``packages`` code. A call that ``owns`` what it calls
        keeps nested patched calls from being recorded again."""
        real = getattr(owner, name, None)
        if real is None:
            return
        had = name in vars(owner)
        guard = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not guard.active:
                return real(*args, **kwargs)
            depth = getattr(guard._local, "depth", 0)
            if depth == 0:
                try:
                    kind = check(*args, **kwargs)
                except Exception:  # noqa: BLE001 - arguments the real call will refuse
                    kind = None
                if kind is not None:
                    guard._record(kind, sys._getframe(1))
            if not owns:
                return real(*args, **kwargs)
            guard._local.depth = depth + 1
            try:
                return real(*args, **kwargs)
            finally:
                guard._local.depth = depth

        wrapper.__name__ = getattr(real, "__name__", name)
        wrapper.__doc__ = getattr(real, "__doc__", None)
        setattr(owner, name, wrapper)
        self._restore.append(lambda: setattr(owner, name, real) if had else delattr(owner, name))

    def _install_synchronize(self) -> None:
        for owner, name, kind in ((torch.cuda, "synchronize", "torch.cuda.synchronize"),
                                  (torch.cuda.Event, "synchronize", "Event.synchronize"),
                                  (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
                                  (getattr(torch, "accelerator", None), "synchronize",
                                   "torch.accelerator.synchronize")):
            if owner is not None:
                self._patch(owner, name, lambda *a, _kind=kind, **k: _kind)

    def _install_cuda(self) -> None:
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self._restore.append(lambda: torch.cuda.set_sync_debug_mode(previous))
        catcher = warnings.catch_warnings()
        catcher.__enter__()
        self._restore.append(lambda: catcher.__exit__(None, None, None))
        warnings.filterwarnings("always", message=_SYNC_WARNING)
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if str(message).startswith(_SYNC_WARNING):
                if self.active and getattr(self._local, "depth", 0) == 0:
                    self._record("synchronizing CUDA operation", sys._getframe(1))
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

        def pageable_upload(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> str | None:
            device, non_blocking = _target_device(args, kwargs)
            if (non_blocking and device is not None and device.type == "cuda"
                    and tensor.device.type == "cpu" and not tensor.is_pinned()):
                return "non-blocking to() from pageable memory"
            return None

        def pageable_copy(dst: torch.Tensor, src: Any, non_blocking: bool = False) -> str | None:
            if (non_blocking and isinstance(src, torch.Tensor) and dst.device.type == "cuda"
                    and src.device.type == "cpu" and not src.is_pinned()):
                return "non-blocking copy_ from pageable memory"
            return None

        def pageable_cuda(tensor: torch.Tensor, device: Any = None, non_blocking: bool = False,
                          **kwargs: Any) -> str | None:
            if non_blocking and tensor.device.type == "cpu" and not tensor.is_pinned():
                return "non-blocking cuda() from pageable memory"
            return None

        # The debug mode judges whatever these calls sync: they record only the uploads.
        self._patch(torch.Tensor, "to", pageable_upload, owns=False)
        self._patch(torch.Tensor, "copy_", pageable_copy, owns=False)
        self._patch(torch.Tensor, "cuda", pageable_cuda, owns=False)

    def _install_cpu(self) -> None:
        for name in _READS:
            self._patch(torch.Tensor, name, lambda *a, _name=name, **k: _name)
        self._patch(torch.Tensor, "to", self._check_to)
        self._patch(torch.Tensor, "copy_", self._check_copy)
        self._patch(torch.Tensor, "__getitem__",
                    lambda tensor, index: "boolean-mask index" if _is_bool_index(index) else None)
        always = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive")
        for owner in (torch, torch.Tensor):
            for name in always:
                self._patch(owner, name, lambda *a, _name=name, **k: _name)
            self._patch(owner, "multinomial", _check_multinomial)
            self._patch(owner, "repeat_interleave", _check_repeat_interleave)
        self._patch(torch, "where", lambda *a, **k: "where(condition)" if len(a) + len(k) == 1 else None)

    def _check_to(self, tensor: torch.Tensor, *args: Any,
                  **kwargs: Any) -> str | tuple[str, Callable[[FrameType], bool]] | None:
        device, non_blocking = _target_device(args, kwargs)
        if device is None or device.type != "cpu":
            return None
        if _names_cpu_string(args, kwargs):
            return "to(cpu)"
        if non_blocking and not self._on_device(tensor):
            return "non-blocking to() from pageable memory"
        return "to(cpu)", _names_cpu

    def _check_copy(self, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> str | None:
        if not isinstance(src, torch.Tensor):
            return None
        into, out_of = self._on_device(dst), self._on_device(src)
        if out_of and not into:
            return "copy_ device-to-host"
        if into and not out_of:
            return "non-blocking copy_ from pageable memory" if non_blocking else "blocking copy_ host-to-device"
        return None


def _check_multinomial(probs: torch.Tensor, num_samples: int, replacement: bool = False,
                       **kwargs: Any) -> str | None:
    if num_samples == 1 or not replacement:
        return "multinomial"
    return None


def _check_repeat_interleave(tensor: torch.Tensor, repeats: Any = None, dim: int | None = None,
                             *, output_size: int | None = None) -> str | None:
    if output_size is not None:
        return None
    if repeats is None or isinstance(repeats, torch.Tensor):  # repeat_interleave(repeats): sizes from data
        return "repeat_interleave"
    return None
