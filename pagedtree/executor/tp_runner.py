"""Rank 0's runner of a tensor-parallel model.

The scheduler, block manager and speculator run once, on rank 0. Everything that
touches a rank's shard or KV cache goes through here: before running a step on its
own shard, this runner broadcasts the step's flat inputs (token ids, positions,
slots, block tables, tree parents, logit rows) to the other ranks, which run the
same ``ModelRunner.run_step`` on theirs; block copies (copy-on-write) and slot
copies (accepted tree paths) are sent the same way. The model's all-reduces and
the logit gather keep the ranks in step inside a forward.

A step is checked on rank 0 (``attention.begin_step``) before it is sent, so a bad
step fails here alone and the engine's failure isolation can retry its requests one
by one. Once a command has gone out, any failure is fatal: the other ranks are
already inside it, and the group is declared broken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from pagedtree.distributed.group import TensorParallelError
from pagedtree.executor.commands import CommandChannel, Op, encode_step
from pagedtree.worker.model_runner import ModelRunner
from pagedtree.worker.step_inputs import HostStep, InputFeed, upload_step

T = TypeVar("T")


class TensorParallelRunner(ModelRunner):
    """A ``ModelRunner`` over rank 0's shard that drives the other ranks (module docstring)."""

    takes_device_inputs = False  # the other ranks take each step's tokens from the host

    def __init__(self, *args, channel: CommandChannel, model_index: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = channel
        self.model_index = model_index

    def _in_step(self, what: str, fn: Callable[[], T]) -> T:
        """Run rank 0's part of a command the other ranks are already running."""
        try:
            return fn()
        except TensorParallelError:
            raise
        except Exception as exc:  # noqa: BLE001 - the other ranks cannot be told to stop half-way
            raise self.channel.group.mark_broken(
                f"rank 0 failed in a {what} the other ranks had started ({type(exc).__name__}: {exc})"
            ) from exc

    @torch.inference_mode()
    def run_step(self, step: HostStep, feed: InputFeed | None = None) -> torch.Tensor:
        if feed is not None:  # the other ranks get the step's tokens from the host
            raise ValueError("a tensor-parallel step takes its input tokens from the host, not from the device")
        input_ids, positions, meta, rows = upload_step(step, self._upload, self.block_size)
        self.attention.begin_step(meta)  # a step that fails its checks stops here, before any rank hears of it
        self.channel.send(Op.FORWARD, self.model_index, encode_step(step))
        return self._in_step("forward", lambda: self.run_model(input_ids, positions, rows))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self._copy(Op.COPY_BLOCKS, src, dst, self.num_blocks, ModelRunner.copy_blocks)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._copy(Op.COPY_SLOTS, src, dst, self.num_blocks * self.block_size, ModelRunner.copy_slots)

    def _copy(self, op: Op, src: list[int], dst: list[int], limit: int,
              apply: Callable[[ModelRunner, list[int], list[int]], None]) -> None:
        """Check block or slot copies, send them to the other ranks, apply them here."""
        if not src:
            return
        bad = [i for i in (*src, *dst) if not 0 <= i < limit]
        if len(src) != len(dst) or bad:
            raise ValueError(f"{op.name}: {len(src)} sources for {len(dst)} destinations, out of range: {bad[:5]}")
        self.channel.send(op, self.model_index, [src, dst])
        self._in_step(op.name, lambda: apply(self, src, dst))
