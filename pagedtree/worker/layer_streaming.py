"""Decoder layers whose weights live in host memory and are streamed to the device.

SpecInfer's offloading mode (FlexGen's regime): a target too large for its GPU keeps
some decoder layers' linear weights in pinned host memory, and every forward copies
them, layer by layer, into a few device buffers ("slots") shared in turn by the
streamed layers. The copies run on a side stream, each waiting for the compute that
last used its slot and each layer's compute waiting for its own copy (CUDA events:
no host sync per layer), so a layer's weights arrive while the layers before it
compute. Everything else stays resident: embeddings, norms, biases, the LM head, the
layers that fit, the draft models and the KV cache.

Streamed layer ``j`` (in forward order) always uses slot ``j % slots``, and its weight
tensors are fixed views into that slot: a layer's weights keep their addresses from
one forward to the next (the fused kernels bind them once), and only the slot's
contents change. After streamed layer ``j`` computes, its slot takes the next layer
that uses it: ``j + slots`` in this forward, or, for the last ``slots`` layers, the
first layers of the next forward (so that a step's first weights arrive while the
host prepares it).

On a CPU the "device" is host memory too: the same slots, views and order, with
copies done in place of the side stream (``tests/worker/test_layer_streaming.py``
checks outputs on CPU; the overlap itself needs a GPU). A pass streaming every layer
costs about the same for 1 and 64 rows (the weights' transfer dominates), which is
what makes wide token trees pay (``speculative/presets.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedtree.worker.models.linear import Linear

# Slot offsets are rounded up to this many bytes, so that every view is aligned for
# any dtype and for vectorised device loads.
_ALIGN = 256
GIB = 1 << 30


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def streamable_tensors(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, attribute)`` of each tensor of ``layer`` that streaming moves: the
    linear layers' weights (dense, or int8/int4 codes and scales). Raises
    ``ValueError`` for a layer whose weights a library holds (q4/q8/ggml, oneDNN's
    packed layout): those cannot be copied to a device."""
    found: list[tuple[nn.Module, str]] = []
    for name, module in layer.named_modules():
        if not isinstance(module, Linear):
            continue
        if module.block_matmul is not None or module.packed_weight is not None:
            raise ValueError(f"layer {name} holds {module.quantization or 'oneDNN-packed'} weights in a CPU "
                             "library, which cannot be streamed to a device: offloading needs dense, int8 or "
                             "int4 weights")
        if module.weight is not None:
            found.append((module, "weight"))
        else:
            found += [(module, "qweight"), (module, "qscales")]
    return found


def layer_stream_bytes(layer: nn.Module) -> int:
    """Bytes one slot needs to hold ``layer``'s streamed tensors (aligned)."""
    return sum(_aligned(getattr(m, a).numel() * getattr(m, a).element_size()) for m, a in streamable_tensors(layer))


def choose_streamed_layers(num_layers: int, count: int) -> list[int]:
    """``count`` of ``num_layers`` layer indices to stream, spread evenly, so that the
    resident layers between them compute while the next streamed one is copied."""
    if not 0 <= count <= num_layers:
        raise ValueError(f"cannot stream {count} of {num_layers} layers")
    return sorted({int((j + 0.5) * num_layers / count) for j in range(count)}) if count else []


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """Which decoder layers stream and through how many slots."""

    streamed: tuple[int, ...]
    slots: int = 2

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"streaming needs at least one slot, got {self.slots}")


class LayerStreamer:
    """Streams ``plan.streamed`` layers of ``layers`` through ``plan.slots`` device slots.

    Built once the model's weights are loaded (on the host) and before anything binds
    them (fused forwards, graphs): it moves each streamed layer's linear weights into
    one host buffer (pinned on CUDA) and points them at their slot, then fills the
    first slots. The forward calls ``layers(...)`` around its loop."""

    def __init__(self, layers: Sequence[nn.Module], plan: StreamPlan, device: torch.device):
        self.device = torch.device(device)
        self.plan = plan
        self.order = list(plan.streamed)
        self.position = {layer: j for j, layer in enumerate(self.order)}  # layer index -> j
        self.num_slots = min(plan.slots, len(self.order))
        cuda = self.device.type == "cuda"
        self.host: list[torch.Tensor] = []
        layouts: list[list[tuple[nn.Module, str, int, torch.Size, torch.dtype]]] = []
        for index in self.order:
            entries, offset = [], 0
            for module, attr in streamable_tensors(layers[index]):
                tensor = getattr(module, attr)
                entries.append((module, attr, offset, tensor.shape, tensor.dtype))
                offset += _aligned(tensor.numel() * tensor.element_size())
            host = torch.empty(offset, dtype=torch.uint8, pin_memory=cuda)
            for module, attr, start, shape, dtype in entries:
                source = getattr(module, attr).detach().contiguous().view(torch.uint8).reshape(-1)
                host[start : start + source.numel()].copy_(source)
                setattr_tensor(module, attr, None)  # the loaded copy goes as soon as it is in the buffer
            self.host.append(host)
            layouts.append(entries)
        slot_bytes = max((h.numel() for h in self.host), default=0)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
        for j, entries in enumerate(layouts):
            slot = self.slots[j % self.num_slots]
            for module, attr, start, shape, dtype in entries:
                size = shape.numel() * torch.empty((), dtype=dtype).element_size()
                setattr_tensor(module, attr, slot[start : start + size].view(dtype).view(shape))
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        # Per slot: its copy's completion, and the completion of the compute that read it.
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(self.num_slots)]
        self.used = [torch.cuda.Event() if cuda else None for _ in range(self.num_slots)]
        self.bytes_per_pass = sum(h.numel() for h in self.host)
        for j in range(self.num_slots):
            self._fetch(j)

    @property
    def slot_bytes(self) -> int:
        """Device bytes the slots take."""
        return sum(s.numel() for s in self.slots)

    def _fetch(self, j: int) -> None:
        """Copy streamed layer ``j``'s weights into its slot, after the slot's last reader."""
        slot = j % self.num_slots
        source = self.host[j]
        if self.stream is None:
            self.slots[slot][: source.numel()].copy_(source)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.used[slot])
            self.slots[slot][: source.numel()].copy_(source, non_blocking=True)
            self.copied[slot].record(self.stream)

    def before(self, layer_index: int) -> None:
        """Layer ``layer_index`` is about to compute: its weights must have arrived."""
        j = self.position.get(layer_index)
        if j is not None and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied[j % self.num_slots])

    def after(self, layer_index: int) -> None:
        """Layer ``layer_index`` has been launched: its slot goes to the next layer using it."""
        j = self.position.get(layer_index)
        if j is None:
            return
        slot = j % self.num_slots
        if self.stream is not None:
            self.used[slot].record(torch.cuda.current_stream(self.device))
        following = j + self.num_slots
        self._fetch(following if following < len(self.order) else slot)

    def layers(self, parts: Iterable, indices: Iterable[int]) -> Iterator:
        """``parts`` in order, each preceded by ``before`` and followed by ``after``
        for its layer index (the forward loops over this instead of ``parts``). A
        forward that stops part way (an error) leaves the slots as they were at its
        start."""
        finished = False
        try:
            for part, index in zip(parts, indices):
                self.before(index)
                yield part
                self.after(index)
            finished = True
        finally:
            if not finished:
                self.reset()

    def reset(self) -> None:
        """Put the first streamed layers back in their slots (after a forward that
        stopped part way, whose later layers' weights the slots may hold)."""
        if self.stream is not None:
            torch.cuda.synchronize(self.device)  # whatever read the slots has finished
        for j in range(self.num_slots):
            self._fetch(j)


def setattr_tensor(module: nn.Module, attr: str, value: torch.Tensor | None) -> None:
    """Point ``module.attr`` at ``value`` (a parameter's data, or a plain attribute)."""
    current = module._parameters.get(attr) if attr in module._parameters else None
    if current is not None and value is not None:
        current.data = value
    elif attr in module._parameters and value is not None:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in module._parameters:
        # Keep the parameter object (its shape for reports) but release its storage.
        module._parameters[attr].data = torch.empty(0, dtype=module._parameters[attr].dtype)
    else:
        setattr(module, attr, value)

