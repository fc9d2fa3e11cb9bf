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
  for verify steps; a causal run that short, such as a draft's catch-up of the
  tokens it has not fed, takes the same shapes). Padding tokens write to a scratch block of the KV cache that
  the block manager never hands out, and no real token sees them
  (``step_inputs.pad_step``);
- the step's inputs and attention plan go to buffers of that shape's own (reused
  every step: ``StagedUpload`` per shape, ``StaticShape`` for the plan), the kernel
  choice made for the longest sequence and its padding (the kernels read each
  request's real length); the block tables stay on the device in one table as
  wide as that, shared by every shape, and a step sends only the entries that
  changed (``kernels.block_tables.DeviceBlockTables``), so its host work follows the
  tables' real lengths, not ``max_model_len``;
- a decode step's graph (one token a request) ends with the LM head over every
  padded row, so its logits come out of the graph and the head costs no launches
  of its own; a verify step's graph gives the hidden states of every padded row
  and the LM head runs after it on the rows the step wants (its padded rows would
  be up to 32 x 65 vocabulary rows). Then the sampler or the verifier.

Every shape is captured at start-up (``capture_all``), largest first, into one
memory pool that all graphs share (each graph's activations are dead once it has
run, so the smaller graphs reuse the largest one's memory), before the engine
serves: a capture synchronises the device, which mid-traffic would stall every
request. The engine measures what the graphs take on a one-block cache first and
holds it back from the KV cache (``model_runner.measure_cuda_graph_memory``). A
shape whose capture fails runs eagerly (a warning says why); a replay that fails
is the step's error and raises.

A whole draft of a runner with these graphs runs as one graph of its own
(``draft_graphs.py``, captured the first time its shape runs, in the same pool).

``capture=False`` runs the same padded, static steps eagerly: what a CPU can test.
Steps with longer prefill chunks, more requests than the largest batch size, more than
``MAX_GRAPH_TOKENS`` padded tokens, or a shape whose capture failed run eagerly,
unpadded (launch overhead is small next to their compute).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedtree.step_data import StaticShape
from pagedtree.step_data import ScheduledChunk
from pagedtree.uploads import StagedUpload
from pagedtree.worker.draft_graphs import DraftGraphs
from pagedtree.worker.step_inputs import HostStep, InputFeed, host_step, pad_step, upload_step

class GraphedRunner(Protocol):
    """What the graphs need of the model runner whose steps they run."""

    model: Any  # the decoder (``DecoderForCausalLM``)
    attention: Any  # its attention backend
    device: torch.device
    block_size: int
    scratch_block: int | None  # the block padding tokens write to


logger = logging.getLogger("pagedtree")

MAX_GRAPH_BATCH = 512  # requests per captured step (vLLM's default capture limit)
# Padded tokens per captured step: 32 trees of 64 nodes and their roots. Decodes stop
# at MAX_GRAPH_BATCH first. All graphs share one pool, which the largest shape's
# activations size, so this bounds the graphs' memory.
MAX_GRAPH_TOKENS = 32 * 65


def _powers_up_to(top: int) -> list[int]:
    """Powers of two up to ``top``, and ``top`` itself."""
    return sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top})


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two up to ``max_num_seqs`` (at most 512),
    and ``max_num_seqs`` itself."""
    return _powers_up_to(min(max_num_seqs, MAX_GRAPH_BATCH))


def token_buckets(max_tree_tokens: int) -> list[int]:
    """New tokens per request with a graph: 1 (decodes), and for verify steps
    (a tree and its root) powers of two up to ``max_tree_tokens`` and that itself,
    but a power within an eighth of it (64 for 65: a 64-node tree and its root),
    whose graphs would save at most that share of a step's tokens."""
    top = max(1, max_tree_tokens)
    return [t for t in _powers_up_to(top) if t == top or 9 * t < 8 * top]


def graph_shapes(buckets: list[int], tokens: list[int]) -> list[tuple[int, int]]:
    """The shapes ``(requests, tokens)`` with a graph (at most ``MAX_GRAPH_TOKENS``
    padded tokens), largest first: the capture order, so that the first graph sizes
    the pool the smaller ones reuse."""
    shapes = [(r, t) for t in tokens for r in buckets if r * t <= MAX_GRAPH_TOKENS]
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape[0]), reverse=True)


@dataclass(slots=True)
class CaptureReport:
    """What the start-up pass over every shape did."""

    shapes: int  # shapes whose static buffers were prepared
    captured: int  # graphs captured (0 with capture off)
    seconds: float
    memory_bytes: int  # device memory the graphs and their buffers hold (0 with capture off)
    failed: list[tuple[tuple[int, int], str]] = field(default_factory=list)  # shape, why; they run eagerly


def _free_device_memory(device: torch.device) -> int:
    """Free memory of a CUDA device once queued work is done and the allocator's
    unused cache is returned (what a capture left behind is then its own)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


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
        self.shapes = graph_shapes(self.buckets, self.token_buckets)
        # Padding tokens extend a request's context by up to the largest tree.
        self.max_blocks = -(-(max_model_len + self.token_buckets[-1]) // runner.block_size)
        self.capture = capture
        self._uploads: dict[tuple[int, int], StagedUpload] = {}
        # shape -> (CUDA graph, its hidden states, its logits: decode shapes only)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None  # the graphs' shared memory pool (the whole-draft graphs' too)
        self._side_stream: torch.cuda.Stream | None = None  # of every warm-up: one cuBLAS workspace
        self.report: CaptureReport | None = None
        self.num_steps = 0  # steps run padded (replayed, when capturing)
        # Whole drafts on this runner as one program each (``draft_graphs.py``).
        self.drafts = DraftGraphs(self)

    def shape_for(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The padded shape ``(requests, tokens)`` of a step of decodes, token trees
        and short causal runs (a draft's catch-up: the tokens it has not fed, up to
        the largest token count), else None (a longer prefill chunk, too many
        requests or tokens, a table too wide, a shape without a graph when
        capturing)."""
        shape = self.padded_shape(chunks)
        if shape is not None and self.capture and shape not in self._graphs:
            return None  # its capture failed (or has not run): eager
        return shape

    def padded_shape(self, chunks: Sequence[ScheduledChunk]) -> tuple[int, int] | None:
        """``shape_for``'s shape whether or not a graph of it was captured: the
        static shape a step of ``chunks`` pads to (a level of a whole-draft graph)."""
        n = len(chunks)
        if not chunks or n > self.buckets[-1]:
            return None
        longest = 0
        for chunk in chunks:
            if chunk.tree_parents is None and chunk.num_tokens > self.token_buckets[-1]:
                return None  # a prefill chunk longer than the shapes' token counts
            if len(chunk.block_table) > self.max_blocks:
                return None
            longest = max(longest, chunk.num_tokens)
        tokens = next((t for t in self.token_buckets if t >= longest), None)
        requests = next(b for b in self.buckets if b >= n)
        if tokens is None or requests * tokens > MAX_GRAPH_TOKENS:
            return None
        return requests, tokens

    def static_shape(self, shape: tuple[int, int]) -> StaticShape:
        """The attention plan's static shape of a padded ``(requests, tokens)`` step:
        its tables rows of one device table as tall as the largest batch."""
        return StaticShape(shape[0], self.max_blocks, shape[1], table_rows=self.buckets[-1])

    def forward(self, chunks: list[ScheduledChunk], logit_rows: list[int], shape: tuple[int, int],
                feed: InputFeed | None = None) -> torch.Tensor:
        """Logits ``[len(logit_rows), V]`` of the step, padded to ``shape`` and run from
        that shape's static buffers (a graph replay when capturing); ``feed`` writes
        the input tokens drawn on the device into the shape's input buffer first.

        A replay that fails raises: it is this step's fault (a bad input, a device
        error), not a reason to stop replaying, and running on eagerly would hide it."""
        runner = self.runner
        input_ids, positions, rows = self.prepare(chunks, logit_rows, shape)
        if feed is not None:
            tokens = shape[1]
            feed.apply(input_ids, [i * tokens for i in range(len(chunks))])  # each request padded to `tokens`
        self.num_steps += 1
        if self.capture:
            graph, hidden, logits = self._graphs[shape]
            graph.replay()
            n = len(logit_rows)
            if logits is not None and logit_rows == list(range(n)):  # a decode step's rows, in order
                # A copy: the next replay overwrites the graph's output, and a draft
                # may keep a level's logits past it.
                return logits[:n].clone()
        else:
            hidden = runner.model(input_ids, positions, runner.attention)
        return runner.model.compute_logits(hidden[rows[:len(logit_rows)]])

    def prepare(self, chunks: list[ScheduledChunk], logit_rows: list[int],
                shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad the step to ``shape``, upload its inputs to that shape's buffers and its
        attention plan (``StaticShape``); its token ids, positions and logit-row index
        (the step's rows first, then row 0 up to one per padded token)."""
        keys = [chunk.request.request_id for chunk in chunks]
        return self._prepare(host_step(chunks, logit_rows), keys, shape)

    def _prepare(self, step: HostStep, keys: list[Hashable | None],
                 shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        upload = self._uploads.get(shape)
        if upload is None:
            upload = self._uploads[shape] = StagedUpload(self.runner.device, torch.long)
        input_ids, positions, rows, plan = self.stage(step, keys, shape, upload)
        self.runner.attention.use_plan(plan)
        return input_ids, positions, rows

    def stage(self, step: HostStep, keys: Sequence[Hashable | None], shape: tuple[int, int], upload: StagedUpload,
              buffers: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
        """``step`` padded to ``shape``, its inputs uploaded through ``upload`` and its
        attention plan built in ``buffers`` (default: the backend's own), not made
        current: its token ids, positions, logit-row index and plan."""
        runner = self.runner
        requests, tokens = shape
        padded = pad_step(step, requests, tokens, runner.scratch_block, runner.block_size)
        input_ids, positions, meta, rows = upload_step(padded, upload, runner.block_size)
        # Every shape's tables are rows of one device table as tall as the largest batch.
        plan = runner.attention.build_plan(meta, self.static_shape(shape), runner.model.config.num_attention_heads,
                                           row_keys=list(keys) + [None] * (requests - len(keys)), buffers=buffers)
        return input_ids, positions, rows, plan

    # No autograd, as in every step; not inference mode, whose tensors (the static
    # buffers made here) could not be updated by a step run outside it.
    @torch.no_grad()
    def capture_all(self, log: bool = True) -> CaptureReport:
        """Prepare every shape's static buffers, largest first, and capture its graph
        when capturing: once, at start-up, before any request is served.

        A shape is captured from a step of padding requests only (its kernels and
        addresses depend on the shape alone). A capture that fails (an operation
        the device cannot capture, no memory) leaves that shape to eager steps, with
        a warning that says why; the others are still captured. The report says
        how long it took and the device memory it took (measured, on CUDA)."""
        device = self.runner.device
        measured = self.capture and device.type == "cuda"
        started = time.perf_counter()
        free_before = _free_device_memory(device) if measured else 0
        failed: list[tuple[tuple[int, int], str]] = []
        for shape in self.shapes:
            input_ids, positions, _ = self._prepare(HostStep(), [], shape)
            if not self.capture:
                continue
            try:
                self._graphs[shape] = self._capture(input_ids, positions, with_head=shape[1] == 1)
            except Exception as exc:  # noqa: BLE001 - a shape that cannot be captured runs eagerly
                failed.append((shape, f"{type(exc).__name__}: {exc}"))
                if log:
                    logger.warning("CUDA graph capture failed for steps of %d requests x %d tokens (%s); "
                                   "those steps run eagerly", shape[0], shape[1], failed[-1][1])
        memory = free_before - _free_device_memory(device) if measured else 0
        self.report = CaptureReport(len(self.shapes), len(self._graphs), time.perf_counter() - started, memory,
                                    failed)
        if log and self.capture:
            logger.info("captured %d CUDA graphs (%d batch sizes x %d token counts, at most %d padded tokens) "
                        "in %.1f s, %.0f MiB", len(self._graphs), len(self.buckets), len(self.token_buckets),
                        MAX_GRAPH_TOKENS, self.report.seconds, memory / 2**20)
        return self.report

    def side_stream(self) -> torch.cuda.Stream:
        """The one side stream every warm-up before a capture runs on."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.runner.device)
        return self._side_stream

    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 with_head: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        """A graph of the model over the prepared static step, its hidden states and,
        ``with_head``, the logits of every padded row (the LM head in the graph)."""
        runner = self.runner
        # A warm-up outside the graph compiles the kernels and allocates the plan's
        # work buffers (it writes the same keys and values the replay writes: harmless),
        # on one side stream for every shape (cuBLAS keeps a workspace per stream).
        side = self.side_stream()
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            hidden = runner.model(input_ids, positions, runner.attention)
            if with_head:
                runner.model.compute_logits(hidden)
        stream = torch.cuda.current_stream(runner.device)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        logits = None
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = runner.model(input_ids, positions, runner.attention)
                if with_head:
                    logits = runner.model.compute_logits(hidden)
        except BaseException:
            # A capture that fails inside may leave its capture stream current: the
            # eager steps that follow belong on the stream they ran on before.
            torch.cuda.set_stream(stream)
            raise
        self.pool = graph.pool()
        return graph, hidden, logits
