"""A step's model inputs: built on the host from the scheduled chunks, padded to a
static shape when a CUDA graph replays the step, uploaded in one copy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pagedtree.step_data import AttentionMetadata
from pagedtree.step_data import ScheduledChunk
from pagedtree.uploads import StagedUpload, upload

# Request id -> (a device tensor, a row of it): where each token drawn by a step that
# is not read back yet sits (``StepOutput.token_sources``).
TokenSources = Mapping[str, tuple[torch.Tensor, int]]


def query_starts(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """Where each chunk's tokens start in the step's flat run, and the total at the end."""
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + chunk.num_tokens)
    return starts


def last_token_rows(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """The row of each chunk's last token in the step's flat run (a draft level's
    logit rows)."""
    return [start + chunk.num_tokens - 1 for chunk, start in zip(chunks, query_starts(chunks))]


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


@dataclass(frozen=True, slots=True)
class InputFeed:
    """Input tokens a step takes from the device: the last new token of chunk
    ``chunks[j]`` (``offsets[j]`` tokens into it) is row ``rows[j]`` of ``sources[j]``,
    the draw of a step scheduled before and not read back yet."""

    chunks: list[int]
    offsets: list[int]
    sources: list[torch.Tensor]
    rows: list[int]

    def apply(self, input_ids: torch.Tensor, chunk_starts: Sequence[int]) -> None:
        """Write the fed tokens into the uploaded ``input_ids`` (chunk ``i``'s tokens
        start at ``chunk_starts[i]``: the flat run's, or a padded step's ``i * tokens``),
        queued on the device: one gather and one scatter per source, no host read."""
        by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for chunk, offset, source, row in zip(self.chunks, self.offsets, self.sources, self.rows):
            entry = by_source.setdefault(id(source), (source, [], []))
            entry[1].append(chunk_starts[chunk] + offset)
            entry[2].append(row)
        for source, dst, src in by_source.values():
            taken = source[upload(src, torch.long, source.device)]
            input_ids[upload(dst, torch.long, input_ids.device)] = taken.to(input_ids.dtype)


def input_feed(chunks: Sequence[ScheduledChunk], token_sources: TokenSources | None) -> InputFeed | None:
    """The ``InputFeed`` of the chunks scheduled ahead (``pending_tokens`` > 0), None
    when there are none; ``ValueError`` for one without a source."""
    fed = [(i, chunk) for i, chunk in enumerate(chunks) if chunk.pending_tokens > 0]
    if not fed:
        return None
    sources, rows = [], []
    for _, chunk in fed:
        found = (token_sources or {}).get(chunk.request.request_id)
        if found is None:
            raise ValueError(f"request {chunk.request.request_id} was scheduled ahead without a token source")
        sources.append(found[0])
        rows.append(found[1])
    return InputFeed([i for i, _ in fed], [chunk.num_tokens - 1 for _, chunk in fed], sources, rows)
