"""CUDA graphs for decode and tree-verify steps: batches padded to a few shapes,
launches replayed.

A decode or verify step of a small model on a GPU is mostly launch overhead (two
hundred kernels of a few microseconds each); a CUDA graph replays them all in one
call, as vLLM and nano-vllm do. A graph freezes its kernels' arguments, so
everything a captured step reads must sit at the same addresses with the same
shapes every time:

- the step is padded to a shape ``(requests, tokens)``: the batch to the next of a
  few sizes (``graph_buckets``), every request's new tokens to the next of a few
  counts (``token_buckets``: 1 for decodes, up to the largest tree plus its root
  for verify steps). Padding tokens write to a scratch block of the KV cache that
  the block manager never hands out, and no real token sees them
  (``step_inputs.pad_step``);
- the step's inputs and attention plan go to buffers of that shape's own (reused
  every step: ``StagedUpload`` per shape, ``StaticShape`` for the plan), with block
  tables as wide as the longest sequence and its padding allow and the kernel
  choice made for that width (the kernels read each request's real length);
- the hidden states of every padded row come out of the graph; the LM head runs
  after it on the rows the step wants, then the sampler or the verifier.

``capture=False`` runs the same padded, static steps eagerly: what a CPU can test.
Steps with prefill chunks, more requests than the largest batch size, or more
than ``MAX_GRAPH_TOKENS`` padded tokens run eagerly, unpadded (launch overhead is
small next to their compute).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from pagedtree.kernels.attention_plan import StaticShape
from pagedtree.step_data import ScheduledChunk
from pagedtree.uploads import StagedUpload
from pagedtree.worker.step_inputs import host_step, pad_step, upload_step

class GraphedRunner(Protocol):
    """What the graphs need of the model runner whose steps they run."""

    model: Any  # the decoder (``DecoderForCausalLM``)
    attention: Any  # its attention backend
    device: torch.device
    block_size: int
    scratch_block: int | None  # the block padding tokens write to


logger = logging.getLogger("pagedtree")

MAX_GRAPH_BATCH = 512
MAX_GRAPH_TOKENS = 512  # padded tokens per captured step (vLLM's default capture limit)


def _powers_up_to(top: int) -> list[int]:
    """Powers of two up to ``top``, and ``top`` itself."""
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top})


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two up to ``max_num_seqs`` (at most 512),
    and ``max_num_seqs`` itself."""
    return _powers_up_to(min(max_num_seqs, MAX_GRAPH_BATCH))


def token_buckets(max_tree_tokens: int) -> list[int]:
    """New tokens per request with a graph: 1 (decodes), and for verify steps
    (a tree and its root) powers of two up to ``max_tree_tokens`` and that itself."""
    return _powers_up_to(max(1, max_tree_tokens))


class StepGraphs:
    """Padded decode and verify steps of one model runner, captured as CUDA graphs
    per shape ``(requests, tokens per request)``."""

    def __init__(self, runner: GraphedRunner, max_num_seqs: int, max_model_len: int, max_tree_tokens: int,
                 capture: bool):
        if runner.scratch_block is None:
            raise ValueError("step graphs need a runner with a scratch KV block (the Triton backend)")
        self.runner = runner
        self.buckets = graph_buckets(max_num_seqs)
        self.token_buckets = token_buckets(max_tree_tokens)
        # Padding tokens extend a request's context by up to the largest tree.
        self.max_blocks = -(-(max_model_len + self.token_buckets[-1]) // runner.block_size)
        self.capture = capture
        self._uploads: dict[tuple[int, int], StagedUpload] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.num_steps = 0  # steps run padded (replayed, when capturing)

    def shape_for(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The padded shape ``(requests, tokens)`` of a step of decodes and token
        trees, else None (a prefill chunk, too many requests or tokens, a table too wide)."""
        n = len(chunks)
        if not chunks or n > self.buckets[-1]:
            return None
        longest = 0
        for chunk in chunks:
            if chunk.tree_parents is None and chunk.num_tokens != 1:
                return None  # a prefill chunk
            if len(chunk.block_table) > self.max_blocks:
                return None
            longest = max(longest, chunk.num_tokens)
        tokens = next((t for t in self.token_buckets if t >= longest), None)
        requests = next(b for b in self.buckets if b >= n)
        if tokens is None or requests * tokens > MAX_GRAPH_TOKENS:
            return None
        return requests, tokens

    def forward(self, chunks: list[ScheduledChunk], logit_rows: list[int], shape: tuple[int, int]) -> torch.Tensor:
        """Logits ``[len(logit_rows), V]`` of the step, padded to ``shape`` and run from
        that shape's static buffers (a graph replay when capturing)."""
        runner = self.runner
        input_ids, positions, rows = self.prepare(chunks, logit_rows, shape)
        self.num_steps += 1
        if not self.capture:
            hidden = runner.model(input_ids, positions, runner.attention)
        else:
            graph = self._graphs.get(shape)
            if graph is None:
                graph = self._capture(shape, input_ids, positions)
            graph[0].replay()
            hidden = graph[1]
        return runner.model.compute_logits(hidden[rows[:len(logit_rows)]])

    def prepare(self, chunks: list[ScheduledChunk], logit_rows: list[int],
                shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad the step to ``shape``, upload its inputs to that shape's buffers and its
        attention plan (``StaticShape``); its token ids, positions and logit-row index
        (the step's rows first, then row 0 up to one per padded token)."""
        runner = self.runner
        requests, tokens = shape
        step = pad_step(host_step(chunks, logit_rows), requests, tokens, runner.scratch_block, runner.block_size)
        upload = self._uploads.get(shape)
        if upload is None:
            upload = self._uploads[shape] = StagedUpload(runner.device, torch.long)
        input_ids, positions, meta, rows = upload_step(step, upload, runner.block_size)
        runner.attention.begin_step(meta, StaticShape(requests, self.max_blocks, tokens),
                                    runner.model.config.num_attention_heads)
        return input_ids, positions, rows

    def _capture(self, shape: tuple[int, int], input_ids: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner = self.runner
        # A warm-up outside the graph compiles the kernels and sizes the allocator
        # (it writes the same keys and values the replay writes, so it is harmless).
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            runner.model(input_ids, positions, runner.attention)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden = runner.model(input_ids, positions, runner.attention)
        self._pool = graph.pool()
        self._graphs[shape] = (graph, hidden)
        logger.info("captured a CUDA graph for steps of %d requests x %d tokens", *shape)
        return graph, hidden
