"""What one forward pass tells its attention backend: which query tokens belong to
which request, where their keys and values go, and what each may attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """How the step's flat run of query tokens maps onto requests and the paged cache."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_start_loc: list[int]  # [B + 1]
    context_lens: list[int]  # [B] KV entries each request sees after this step's writes
    block_tables: list[list[int]]  # [B][num_blocks of the request]
    tree_parents: list[list[int] | None]  # [B] None = causal among the new tokens
    # (min, max) of slot_mapping, known on the host to whoever built it: the range
    # check then needs no read of the device tensor.
    slot_bounds: tuple[int, int] | None = None
