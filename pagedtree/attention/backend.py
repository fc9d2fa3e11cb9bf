"""The interface every attention backend implements.

A model's attention layers see only this: ``begin_step(meta)`` once per forward
(the step's query layout, slots and block tables), then ``backend(layer, q, k, v)``
per layer, which stores the new keys and values in that layer's paged cache and
returns the attention output. ``copy_blocks`` and ``copy_slots`` serve the block
manager's copy-on-write orders and the compaction of accepted tree paths.

A new backend is one file with a subclass, and one line in ``BACKENDS``
(``pagedtree/attention/__init__.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedtree.step_data import StaticShape
    from pagedtree.step_data import AttentionMetadata


class AttentionBackend(ABC):
    """Paged (tree) attention over per-layer KV caches ``[blocks, block_size, H_kv, D]``."""

    name: str = ""

    @classmethod
    def unavailable(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot hold a KV cache of ``dtype`` on ``device`` in this
        process (None: it can)."""
        return None

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.kv_caches = kv_caches
        self.scale = scale

    @abstractmethod
    def begin_step(self, meta: AttentionMetadata, static: StaticShape | None = None, num_heads: int = 0) -> None:
        """Validate and prepare the step's metadata once for every layer.

        ``static`` (with the model's ``num_heads``) marks a padded step of a fixed
        shape that a CUDA graph replays; backends without static-shape kernels
        ignore it."""

    @abstractmethod
    def __call__(self, layer_index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Store ``key``/``value`` ``[T, H_kv, D]`` in layer ``layer_index``'s cache at
        the step's slots; return the attention of ``query`` ``[T, H, D]``."""

    def store_target(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Layer ``layer_index``'s key cache, value cache and this step's slots, for a
        caller that writes the new keys and values itself (the fused rotary kernel)
        and then calls ``attend``; None (the default) when this backend stores them."""
        return None

    def attend(self, layer_index: int, query: torch.Tensor) -> torch.Tensor:
        """Attention of ``query`` ``[T, H, D]`` over layer ``layer_index``'s cache, whose
        new keys and values the caller has stored (``store_target``)."""
        raise NotImplementedError(f"the {self.name} backend stores keys and values itself")

    @abstractmethod
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write)."""

    @abstractmethod
    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy single token slots ``src[i] -> dst[i]`` in every layer (an accepted
        tree path into sequence order)."""
