"""CUDA graphs for decode steps: batches padded to a few sizes, launches replayed.

A decode step of a small model on a GPU is mostly launch overhead (two hundred
kernels of a few microseconds each); a CUDA graph replays them all in one call, as
vLLM and nano-vllm do. A graph freezes its kernels' arguments, so everything a
captured step reads must sit at the same addresses with the same shapes every
time:

- the batch is padded to the next of a few sizes (``graph_buckets``); padding
  requests decode token 0 at position 0 into a scratch block of the KV cache that
  the block manager never hands out, so they touch no real sequence;
- the step's inputs and attention plan go to buffers of that bucket's own (reused
  every step: ``StagedUpload`` per bucket, ``StaticShape`` for the plan), with block
  tables as wide as the longest sequence allows and the kernel choice made for
  that width (the kernels read each request's real length);
- the logits of every padded row come out of the graph; the sampler runs after it.

``capture=False`` runs the same padded, static step eagerly: what a CPU can test.
Steps with trees, prefill chunks or more requests than the largest bucket run
eagerly, unpadded.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pagedtree.kernels.attention_plan import StaticShape
from pagedtree.scheduler.plan import ScheduledChunk
from pagedtree.uploads import StagedUpload

if TYPE_CHECKING:
    from pagedtree.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedtree")

MAX_GRAPH_BATCH = 512


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two up to ``max_num_seqs`` (at most 512),
    and ``max_num_seqs`` itself."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sorted(set(sizes + [top]))


class DecodeGraphs:
    """Padded decode steps of one model runner, captured as CUDA graphs per bucket."""

    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_model_len: int, capture: bool):
        if runner.scratch_block is None:
            raise ValueError("decode graphs need a runner with a scratch KV block (the Triton backend)")
        self.runner = runner
        self.buckets = graph_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // runner.block_size)
        self.capture = capture
        self._uploads = {b: StagedUpload(runner.device, torch.long) for b in self.buckets}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.num_steps = 0  # decode steps run padded (replayed, when capturing)

    def bucket_for(self, chunks: list[ScheduledChunk], logit_rows: list[int]) -> int | None:
        """The bucket of a decode-only step that wants every row's logits, else None."""
        n = len(chunks)
        if not chunks or n > self.buckets[-1] or logit_rows != list(range(n)):
            return None
        for chunk in chunks:
            if chunk.num_tokens != 1 or chunk.tree_parents is not None or len(chunk.block_table) > self.max_blocks:
                return None
        return next(b for b in self.buckets if b >= n)

    def forward(self, chunks: list[ScheduledChunk], bucket: int) -> torch.Tensor:
        """Logits ``[len(chunks), V]`` of a decode step, padded to ``bucket`` and run
        from that bucket's static buffers (a graph replay when capturing)."""
        runner = self.runner
        input_ids, positions, meta, _ = runner.step_inputs(chunks, range(bucket), self._uploads[bucket], pad_to=bucket)
        runner.attention.begin_step(meta, StaticShape(bucket, self.max_blocks), runner.model.config.num_attention_heads)
        self.num_steps += 1
        if not self.capture:
            return runner.run_model(input_ids, positions)[: len(chunks)]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._capture(bucket, input_ids, positions)
        graph[0].replay()
        return graph[1][: len(chunks)]

    def _capture(self, bucket: int, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner = self.runner
        # A warm-up outside the graph compiles the kernels and sizes the allocator
        # (it writes the same keys and values the replay writes, so it is harmless).
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            runner.run_model(input_ids, positions)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = runner.run_model(input_ids, positions)
        self._pool = graph.pool()
        self._graphs[bucket] = (graph, logits)
        logger.info("captured a CUDA graph for decode batches of %d", bucket)
        return graph, logits
