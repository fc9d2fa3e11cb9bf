"""An offloaded target: how many layers stream from host memory, and placing them.

``offload_weights_gb`` (``EngineConfig``) asks for it: ``"all"`` streams every
decoder layer, a number streams the fewest layers that hold at least that many GiB
of weights, and None (the default) streams on a GPU only what does not fit: the
fewest layers that leave the rest of the weights, two slots, activations and a KV
cache for one full-length sequence inside ``gpu_memory_utilization`` of the device
(0 never streams, and a model too large then fails to load as any other would).
The mechanism is ``worker/layer_streaming.py``; this module sizes and places.

A target whose streamed layers do not fit in the host's available memory either is
refused before loading, with both figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedtree.config import OFFLOAD_ALL, OFFLOAD_AUTO, CacheConfig, ModelConfig, SchedulerConfig
from pagedtree.loading.offload_sizing import device_weight_budget, estimate_weight_bytes
from pagedtree.worker.layer_streaming import (
    GIB,
    LayerStreamer,
    StreamPlan,
    choose_streamed_layers,
    layer_stream_bytes,
)
from pagedtree.worker.models.linear import Linear

logger = logging.getLogger("pagedtree")

# Device buffers the streamed layers take in turn: one layer computes while the next
# arrives.
STREAM_SLOTS = 2


@dataclass(frozen=True, slots=True)
class OffloadSizing:
    """What streaming a given number of layers costs and saves."""

    layer_bytes: tuple[int, ...]  # streamed bytes of each decoder layer
    other_bytes: int  # everything that stays resident whatever is streamed

    def resident_bytes(self, plan: StreamPlan) -> int:
        """Device bytes of the weights with ``plan``: the rest, the unstreamed layers, the slots."""
        streamed = [self.layer_bytes[i] for i in plan.streamed]
        slots = min(plan.slots, len(streamed)) * max(streamed, default=0)
        return self.other_bytes + sum(self.layer_bytes) - sum(streamed) + slots


def plan_offload(requested: float | str | None, sizing: OffloadSizing, budget: int | None,
                 slots: int = STREAM_SLOTS) -> StreamPlan:
    """The layers to stream for ``requested`` (see module docstring)."""
    num_layers = len(sizing.layer_bytes)
    if requested == OFFLOAD_ALL:
        return StreamPlan(tuple(range(num_layers)), slots)
    if isinstance(requested, float):
        # The fewest layers whose bytes reach the GiB asked for (counted largest first);
        # which layers is the even spread.
        want, count, held = requested * GIB, 0, 0
        for size in sorted(sizing.layer_bytes, reverse=True):
            if held >= want:
                break
            held, count = held + size, count + 1
        return StreamPlan(tuple(choose_streamed_layers(num_layers, count)), slots)
    if requested != OFFLOAD_AUTO or budget is None:
        return StreamPlan((), slots)
    for count in range(num_layers + 1):
        plan = StreamPlan(tuple(choose_streamed_layers(num_layers, count)), slots)
        if sizing.resident_bytes(plan) <= budget:
            return plan
    raise ValueError(
        f"the model does not fit on the device even with every layer streamed: the weights that stay resident "
        f"(embeddings, head, norms and {slots} layer buffers) take "
        f"{sizing.resident_bytes(StreamPlan(tuple(range(num_layers)), slots)) / GIB:.2f} GiB, the device holds "
        f"{max(budget, 0) / GIB:.2f} GiB for weights beside the activations and one sequence's KV cache")


def sizing_of(model) -> OffloadSizing:
    """``model``'s (a ``DecoderForCausalLM``, weights loaded) streamable bytes per layer."""
    layers = model.model.layers
    layer_bytes = tuple(layer_stream_bytes(layer) for layer in layers)
    total = model.weight_bytes()
    return OffloadSizing(layer_bytes, max(total - sum(layer_bytes), 0))


def check_host_memory(model_bytes: int, available: int | None, device_budget: int | None) -> None:
    """Refuse, before loading, a model the host cannot hold (``available`` None: unknown)."""
    if available is not None and model_bytes > available:
        device = "" if device_budget is None else f" (the device holds {max(device_budget, 0) / GIB:.2f} GiB of it)"
        raise ValueError(
            f"the model fits neither on the device nor in host memory: its weights take {model_bytes / GIB:.2f} "
            f"GiB{device}, and the host has {available / GIB:.2f} GiB available to hold the streamed layers")


def place_offloaded(model, plan: StreamPlan, device: torch.device) -> LayerStreamer | None:
    """Stream ``plan``'s layers of ``model`` (loaded on the host) and move everything
    else to ``device``. Before anything binds the weights (fused forwards, graphs).
    A plan that streams nothing (the model fits after all) only moves it: no
    streamer, and the engine keeps its CUDA graphs."""
    if not plan.streamed:
        _move(model, device)
        return None
    streamer = LayerStreamer(model.model.layers, plan, device)
    model.layer_streamer = streamer
    _move(model, device)
    logger.info("offloaded %d of %d layers: %.2f GiB stream from host memory each pass through %d buffers "
                "of %.0f MiB", len(plan.streamed), len(model.model.layers), streamer.bytes_per_pass / GIB,
                streamer.num_slots, (streamer.slot_bytes / max(streamer.num_slots, 1)) / 2**20)
    return streamer


def _move(model, device: torch.device) -> None:
    """Everything of ``model`` not on ``device`` yet goes there (streamed weights are
    views of its slots already)."""
    if device.type == "cpu":
        return
    model.to(device)
    for module in model.modules():  # quantized codes are plain attributes, which ``to`` skips
        if isinstance(module, Linear):
            for attr in ("qweight", "qscales"):
                value = getattr(module, attr)
                if value is not None and value.device != device:
                    setattr(module, attr, value.to(device))



def refuse_unless_host_holds(config: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig,
                             max_model_len: int | None) -> None:
    """Before an offloaded target loads (on the host): ``ValueError`` when the host's
    available memory cannot hold its weights, with the figures."""
    from transformers import AutoConfig

    from pagedtree.loading.loader import resolve_model_path
    from pagedtree.loading.model_format import available_memory

    try:
        hf_config = AutoConfig.from_pretrained(str(resolve_model_path(config.model)))
    except (OSError, ValueError):  # a GGUF without a converted folder: its load reads the sizes
        return
    budget = device_weight_budget(config.device, hf_config, config.dtype, cache.gpu_memory_utilization,
                                  scheduler.max_num_batched_tokens, max_model_len)
    check_host_memory(estimate_weight_bytes(hf_config, config.dtype), available_memory(), budget)


def offload_target(model, config: ModelConfig, cache: CacheConfig, scheduler: SchedulerConfig,
                   max_model_len: int) -> LayerStreamer | None:
    """Plan and place ``model`` (a target loaded on the host) for ``config.offload_weights_gb``."""
    budget = device_weight_budget(config.device, model.config, config.dtype, cache.gpu_memory_utilization,
                                  scheduler.max_num_batched_tokens, max_model_len)
    return place_offloaded(model, plan_offload(config.offload_weights_gb, sizing_of(model), budget), config.device)
