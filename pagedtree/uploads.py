"""Host values to the device without a host sync: pinned staging, non-blocking copies.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory, which
blocks the host until the GPU has caught up; a copy from pinned memory with
``non_blocking=True`` is queued on the stream and the host moves on. On a CPU both
are the host tensor itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host tensor ``host`` on ``device``, queued from pinned memory (CPU: itself)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def upload(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh device tensor of ``values``, queued from pinned memory (CPU: the host tensor)."""
    return to_device(torch.tensor(list(values), dtype=dtype), device)


class StagedUpload:
    """A reused pinned host buffer and a reused device buffer of one dtype: each call
    puts a step's values on the device in one non-blocking copy, and allocates
    nothing once the buffers have grown to the largest step (addresses stay put,
    which a CUDA-graph capture of the consumers needs).

    The pinned buffer is rewritten only after the previous copy out of it has
    finished (an event per copy; normally long done, since a step ends with a
    readback).
    """

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a 1-D host tensor of this dtype) on the device; a view of the
        reused buffer, valid until the next call."""
        if values.dtype != self.dtype or values.dim() != 1:
            raise ValueError(f"expected a 1-D {self.dtype} tensor, got {values.dim()}-D {values.dtype}")
        n = values.numel()
        cuda = self.device.type == "cuda"
        if self._device is None or self._device.numel() < n:
            capacity = 1 << max(8, (n - 1).bit_length())
            self._device = torch.empty(capacity, dtype=self.dtype, device=self.device)
            self._host = torch.empty(capacity, dtype=self.dtype, pin_memory=True) if cuda else None
            self._copied = None
        if not cuda:  # the same reused buffer, filled by the host
            self._device[:n].copy_(values)
            return self._device[:n]
        assert self._host is not None
        if self._copied is not None and not self._copied.query():  # query() does not wait
            self._copied.synchronize()
        self._host[:n].copy_(values)
        self._device[:n].copy_(self._host[:n], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._device[:n]
