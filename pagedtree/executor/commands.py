"""What rank 0 tells the other tensor-parallel ranks, encoded as int64 tensors.

A command is a header ``[op, model, payload length, sequence number]`` broadcast
from rank 0, then (when the payload is not empty) the payload: a few integer lists
packed as ``[count, len_1, ..., len_count, values...]``. Only integers travel (token
ids, positions, slots, block tables, tree parents, block and slot copies), so a
worker never unpickles anything it is sent. Workers check the sequence numbers: a
gap means the ranks are out of step, which is fatal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from pagedtree.distributed.group import COMMAND_WAIT, TensorParallelGroup
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import HostStep

HEADER = 4


class Op(IntEnum):
    """The commands."""

    FORWARD = 1  # a step's flat inputs (HostStep)
    COPY_BLOCKS = 2  # [src blocks], [dst blocks]
    COPY_SLOTS = 3  # [src slots], [dst slots]
    REPORT = 4  # every rank sends its counters to rank 0
    SHUTDOWN = 5


@dataclass(slots=True)
class Command:
    """A received command: its op, the model it is for (0 target, 1 + i draft i), its lists."""

    op: Op
    model: int
    lists: list[list[int]] = field(default_factory=list)


def pack_lists(lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """Integer lists as one int64 tensor ``[count, lengths..., values...]``."""
    lengths = [len(values) for values in lists]
    parts = [np.asarray([len(lists), *lengths], dtype=np.int64)]
    parts += [np.asarray(values, dtype=np.int64) for values in lists if len(values)]
    return torch.from_numpy(np.concatenate(parts))


def unpack_lists(tensor: torch.Tensor) -> list[list[int]]:
    """The lists ``pack_lists`` packed."""
    values = tensor.tolist()
    count = values[0]
    lengths = values[1:1 + count]
    out, start = [], 1 + count
    for length in lengths:
        out.append(values[start:start + length])
        start += length
    if start != len(values):
        raise ValueError(f"a packed command has {len(values) - start} values past its lists")
    return out


def encode_step(step: HostStep) -> list[list[int]]:
    """A ``HostStep`` as integer lists (block tables and tree parents flattened)."""
    tables = [block for table in step.block_tables for block in table]
    trees = [p for parents in step.tree_parents if parents is not None for p in parents]
    tree_lens = [-1 if parents is None else len(parents) for parents in step.tree_parents]
    return [step.input_ids, step.positions, step.slots, step.query_starts, step.context_lens,
            [len(t) for t in step.block_tables], tables, tree_lens, trees, step.logit_rows]


def decode_step(lists: list[list[int]]) -> HostStep:
    """The ``HostStep`` ``encode_step`` encoded."""
    input_ids, positions, slots, starts, contexts, table_lens, tables, tree_lens, trees, rows = lists
    block_tables, tree_parents = [], []
    at = 0
    for length in table_lens:
        block_tables.append(tables[at:at + length])
        at += length
    at = 0
    for length in tree_lens:
        if length < 0:
            tree_parents.append(None)
        else:
            tree_parents.append(trees[at:at + length])
            at += length
    return HostStep(input_ids=input_ids, positions=positions, slots=slots, query_starts=starts,
                    context_lens=contexts, block_tables=block_tables, tree_parents=tree_parents, logit_rows=rows)


class CommandChannel:
    """Rank 0 sends commands; every other rank receives them in the same order."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self.sequence = 0

    def send(self, op: Op, model: int = 0, lists: Sequence[Sequence[int]] = ()) -> None:
        """Broadcast one command from rank 0."""
        payload = pack_lists(lists) if lists else None
        self.sequence += 1
        length = 0 if payload is None else payload.numel()
        self.group.broadcast_command(torch.tensor([int(op), model, length, self.sequence], dtype=torch.long))
        if payload is not None:
            self.group.broadcast_command(payload)

    def receive(self) -> Command:
        """Wait (as long as the engine idles) for rank 0's next command."""
        header = torch.zeros(HEADER, dtype=torch.long)
        self.group.broadcast_command(header, wait=COMMAND_WAIT)
        op, model, length, sequence = header.tolist()
        self.sequence += 1
        if sequence != self.sequence:
            raise self.group.mark_broken(f"command {sequence} arrived where {self.sequence} was due")
        lists: list[list[int]] = []
        if length:
            payload = torch.zeros(length, dtype=torch.long)
            self.group.broadcast_command(payload)
            lists = unpack_lists(payload)
        return Command(Op(op), model, lists)


# What each rank reports per model (``Op.REPORT``), then its collectives' totals.
MODEL_COUNTERS = ("forward_passes", "block_copies", "slot_copies", "kv_blocks", "weight_bytes", "kv_cache_bytes")
COMM_COUNTERS = ("all_reduces", "all_reduce_bytes", "gathers", "gather_bytes", "collective_us")


def report_values(runners: Sequence[ModelRunner], group: TensorParallelGroup) -> list[int]:
    """This rank's counters, in the order ``parse_report`` reads them."""
    values: list[int] = []
    for runner in runners:
        memory = runner.memory_bytes()
        values += [runner.num_forward_passes, runner.num_block_copies, runner.num_slot_copies,
                   runner.num_blocks, memory["weights"], memory["kv_cache"]]
    stats = group.stats
    return values + [stats.all_reduces, stats.all_reduce_bytes, stats.gathers, stats.gather_bytes,
                     int(stats.seconds * 1e6)]


def parse_report(values: list[int], num_models: int) -> dict[str, object]:
    """One rank's counters as a dict: ``models`` (one dict per model: target, then
    sharded drafts) and the collectives' totals."""
    width = len(MODEL_COUNTERS)
    models = [dict(zip(MODEL_COUNTERS, values[i * width:(i + 1) * width])) for i in range(num_models)]
    comm = dict(zip(COMM_COUNTERS, values[num_models * width:]))
    return {"models": models, **comm}
