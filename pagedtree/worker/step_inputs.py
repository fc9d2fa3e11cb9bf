"""A step's model inputs: built on the host from the scheduled chunks, padded to a
static shape when a CUDA graph replays the step, uploaded in one copy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.step_data import AttentionMetadata
from pagedtree.step_data import ScheduledChunk
from pagedtree.uploads import StagedUpload


def query_starts(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """Where each chunk's tokens start in the step's flat run, and the total at the end."""
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.num_tokens)
    return starts


@dataclass(slots=True)
class HostStep:
    """The step's flat token run and per-request attention metadata, on the host.

    ``logit_rows`` are the rows of the flat run whose logits the step returns.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    tree_parents: list[list[int] | None] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the flat run."""
        return len(self.input_ids)

    def add_request(self, input_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                    context_len: int, block_table: Sequence[int], tree_parents: Sequence[int] | None) -> None:
        """Append one request's run of new tokens."""
        self.input_ids.extend(input_ids)
        self.positions.extend(positions)
        self.slots.extend(slots)
        self.query_starts.append(self.query_starts[-1] + len(input_ids))
        self.context_lens.append(context_len)
        self.block_tables.append(list(block_table))
        self.tree_parents.append(None if tree_parents is None else list(tree_parents))


def host_step(chunks: Sequence[ScheduledChunk], logit_rows: Sequence[int]) -> HostStep:
    """The chunks' tokens as one flat run (in chunk order)."""
    step = HostStep(logit_rows=list(logit_rows))
    for chunk in chunks:
        step.add_request(chunk.token_ids, chunk.positions, chunk.slot_mapping, chunk.context_len,
                         chunk.block_table, chunk.tree_parents)
    return step


def pad_step(step: HostStep, requests: int, tokens: int, scratch_block: int, block_size: int) -> HostStep:
    """``step`` padded to ``requests`` requests of ``tokens`` new tokens each.

    Padding tokens (token 0 at position 0) write their keys and values to
    ``scratch_block``, a KV block no sequence owns. A real request's padding tokens
    come after its own, as extra roots of its tree (or, for a decode, as causal
    successors): no real token sees them, since a tree token sees only its
    ancestors and a causal one only what precedes it. Its context grows by as many,
    its block table by scratch blocks to cover them. Padding requests see only the
    scratch block. The logit rows move with their tokens, then repeat row 0 up to
    one per token, so every padded step of a shape uploads as many values.
    """
    n = len(step.context_lens)
    if n > requests or any(b - a > tokens for a, b in zip(step.query_starts, step.query_starts[1:])):
        raise ValueError(f"a step of {n} requests does not fit {requests} requests of {tokens} tokens")
    scratch_slot = scratch_block * block_size
    out = HostStep()
    moved: dict[int, int] = {}
    for i in range(n):
        start, end = step.query_starts[i], step.query_starts[i + 1]
        pad = tokens - (end - start)
        for row in range(start, end):
            moved[row] = out.num_tokens + row - start
        context = step.context_lens[i] + pad
        table = step.block_tables[i] + [scratch_block] * max(0, -(-context // block_size) - len(step.block_tables[i]))
        parents = step.tree_parents[i]
        out.add_request(step.input_ids[start:end] + [0] * pad, step.positions[start:end] + [0] * pad,
                        step.slots[start:end] + [scratch_slot] * pad, context, table,
                        None if parents is None else parents + [-1] * pad)
    for _ in range(requests - n):
        out.add_request([0] * tokens, [0] * tokens, [scratch_slot] * tokens, tokens,
                        [scratch_block] * -(-tokens // block_size), None)
    rows = [moved[r] for r in step.logit_rows]
    out.logit_rows = rows + [0] * (out.num_tokens - len(rows))
    return out


def upload_step(step: HostStep, upload: StagedUpload,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The step's token ids, positions, attention metadata and logit-row index on the
    device: the four index arrays in one non-blocking copy from pinned memory
    (``upload``). The slots' range is known here, so the attention backend checks it
    without reading the device."""
    n = step.num_tokens
    dev = upload(torch.tensor(step.input_ids + step.positions + step.slots + step.logit_rows, dtype=torch.long))
    meta = AttentionMetadata(
        block_size=block_size,
        slot_mapping=dev[2 * n:3 * n],
        query_start_loc=step.query_starts,
        context_lens=step.context_lens,
        block_tables=step.block_tables,
        tree_parents=step.tree_parents,
        slot_bounds=(min(step.slots), max(step.slots)) if step.slots else None,
    )
    return dev[:n], dev[n:2 * n], meta, dev[3 * n:]
