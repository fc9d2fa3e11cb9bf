"""CUDA graphs for a whole draft: every level's forward, draw and feed in two replays.

A whole draft (``draft_levels.py``) already queues its levels back to back and reads
them back once, but each level still costs the host a plan, an upload and a graph
launch of its own, and the draws between levels a few launches each. The levels are
plain data known before the first one runs (the draft worker reserves every node's
sequence and KV slot first): only the input tokens of levels after the first depend
on the device, on the children the level before drew. So the whole draft is one
static program:

- every level is padded to a static shape (``StepGraphs.padded_shape``), with inputs
  and an attention plan in buffers of that level's own (a ``StagedUpload`` per level
  and shape, ``PlanBuffers`` per level: two levels of one shape, as in a chain, must
  not share them, since all of them are filled before the replay);
- a level's fed input tokens are gathered from the children the level before drew
  and scattered into its input buffer with index tensors fixed by the draft's shape;
- each level's rows are drawn in the groups ``draft_sampling.draw_groups`` makes
  (greedy top-k rows; coupled rows, whose Gumbel noise is copied into a bounded
  shared buffer before the replay);
- the block copies due before the first level run before the replay, those due
  before a later level (its forks' copy-on-write copies) in the graph, their block
  ids in a static buffer.

The program is two graphs: the first level, and the levels after it. The host fills
the first level's buffers and replays its graph, then fills the other levels'
buffers while the device runs the first level (a level's fill is 0.1-0.2 ms of
host time on a 2-core CPU: plan, tree mask, uploads; a 0.5B draft level runs for
over a millisecond on an H200), replays the second graph and reads every level's children back in one
copy. One graph for the whole draft would leave the device idle through every
level's fill: on an H200 a graph per level was 7% faster than that for a chain of 4
at batch 1, 18% for a 16-node tree. The graphs are keyed by the draft's shape (each
level's padded shape, its rows, draw groups and feeds), captured the first time
that shape runs (a capture synchronises the device once) and replayed after; at most
``MAX_DRAFT_GRAPHS`` shapes are kept. A shape whose capture fails drafts level by level
from then on, and after ``MAX_FAILED_CAPTURES`` failures no new shape is tried.
Drafts this cannot hold run level by level as before: random draw rules (a
request's own generator stream), levels wider than ``MAX_DRAFT_GRAPH_ROWS`` rows
(launch overhead is small next to their work), or coupled rows beyond the noise
buffer.

``capture=False`` runs the same static program eagerly: what a CPU can test. The
graphs share the step graphs' memory pool (a draft's activations are dead once it
has run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedtree.draft_sampling import DraftLevel, DrawnChildren, draw_group, draw_groups
from pagedtree.uploads import StagedUpload
from pagedtree.worker.step_inputs import host_step, last_token_rows

logger = logging.getLogger("pagedtree")

MAX_DRAFT_GRAPHS = 32  # draft shapes kept captured; further shapes run level by level
MAX_DRAFT_GRAPH_ROWS = 64  # nodes a level may feed (chunks) to be part of a graph
MAX_NOISE_ROWS = 64  # coupled rows per draft: the noise buffer is [MAX_NOISE_ROWS, V]
# Captures that may fail before no new shape is tried (a failure is usually the
# device's, not the shape's: each try costs a warm-up and a sync).
MAX_FAILED_CAPTURES = 4


@dataclass(frozen=True, slots=True)
class LevelKey:
    """What a level's part of the graph depends on: its padded ``shape`` (requests,
    tokens), its ``rows`` (chunks, one logit row each), its draw ``groups`` (group
    key, rows) and its ``feeds`` (chunk, the child rank of which chunk of the level
    before), its ``offsets`` (where each fed token sits in its chunk) and how many
    block ``copies`` (copy-on-write) come before it."""

    shape: tuple[int, int]
    rows: int
    groups: tuple[tuple[tuple, tuple[int, ...]], ...]
    feeds: tuple[tuple[int, int, int], ...]  # (chunk, source chunk, rank)
    offsets: tuple[int, ...]  # per fed chunk, its fed token's place in the chunk
    copies: int = 0  # block copies due before the level (after the first level: in the graph)


@dataclass(slots=True)
class _Level:
    """A level's static buffers and what the program left in them."""

    key: LevelKey
    index: int
    params: list[Any]  # per group, the sampling parameters it draws with
    noise_rows: list[tuple[int, int] | None]  # per group, its rows of the noise buffer
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    plan: Any = None
    feed_src: torch.Tensor | None = None
    feed_dst: torch.Tensor | None = None
    copy_ids: torch.Tensor | None = None  # [2, copies]: sources, destinations
    group_rows: list[torch.Tensor | None] = field(default_factory=list)
    drawn: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per group
    layout: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # row -> (group, index, k)


@dataclass(slots=True)
class _Entry:
    """One draft shape: its levels, the parts its program runs in (``[start, stop)``
    level ranges: the first level, then the rest) and, when capturing, a graph a part."""

    levels: list[_Level]
    parts: list[tuple[int, int]] = field(default_factory=list)
    graphs: list[Any] = field(default_factory=list)  # per part, once captured


class DraftGraphs:
    """Whole drafts of one model runner (with step graphs) as one static program each,
    captured as a CUDA graph when ``graphs.capture``."""

    def __init__(self, graphs):
        self.graphs = graphs  # the runner's ``StepGraphs``
        self.runner = graphs.runner
        self.capture = graphs.capture  # capture CUDA graphs, or run the programs uncaptured
        self._entries: dict[tuple[LevelKey, ...], _Entry] = {}
        self._uploads: dict[tuple, StagedUpload] = {}
        self._buffers: list[Any] = []  # PlanBuffers per level index
        self._noise: torch.Tensor | None = None
        self.num_drafts = 0  # drafts run through a draft graph
        self.num_captures = 0  # graphs captured (a draft of several levels takes two)
        self.captured_last = False  # whether the last draft captured its graph (its time is not a replay's)
        self.fill_seconds = 0.0  # host time spent filling levels' buffers (plans, inputs, uploads)
        self.levels_filled = 0
        self.failed: list[str] = []  # why captures failed (those shapes run level by level)
        self._refused: set[tuple[LevelKey, ...]] = set()

    # ------------------------------------------------------------------ keys
    def key_for(self, levels: Sequence[DraftLevel]) -> tuple[LevelKey, ...] | None:
        """The draft's shape, or None where this cannot run it (module docstring)."""
        if not levels:
            return None
        keys = []
        noise_rows = 0
        for index, level in enumerate(levels):
            if len(level.chunks) > MAX_DRAFT_GRAPH_ROWS:
                return None
            shape = self.graphs.padded_shape(level.chunks)
            if shape is None:
                return None
            groups, alone = draw_groups(level.rules)
            if alone:
                return None
            noise_rows += sum(len(rows) for key, rows in groups.items() if key[0] == "coupled")
            fed = [(j, source) for j, source in enumerate(level.feeds) if source is not None]
            if fed and not index:
                raise ValueError("the first level of a draft has no children to take its tokens from")
            keys.append(LevelKey(
                shape=shape, rows=len(level.chunks),
                groups=tuple((key, tuple(rows)) for key, rows in groups.items()),
                feeds=tuple((j, i, rank) for j, (i, rank) in fed),
                offsets=tuple(level.chunks[j].num_tokens - 1 for j, _ in fed),
                copies=len(level.copies) if index else 0))
        if noise_rows > MAX_NOISE_ROWS:
            return None
        return tuple(keys)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def queue(self, levels: Sequence[DraftLevel]) -> list[list[DrawnChildren | None]] | None:
        """Run the draft's levels as one program (two graph replays when capturing);
        per level, per chunk, its children on the device (None where it drew none).
        None when this cannot run the draft: the caller runs it level by level."""
        key = self.key_for(levels)
        if key is None or key in self._refused:
            return None
        if self.capture and key not in self._entries and len(self._refused) >= MAX_FAILED_CAPTURES:
            return None
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= MAX_DRAFT_GRAPHS:
                return None
            entry = self._new_entry(key, levels)
        runner = self.runner
        self.captured_last = False
        if levels[0].copies:
            runner.copy_blocks([c.src for c in levels[0].copies], [c.dst for c in levels[0].copies])
        # Each part's buffers are filled just before it runs: the later levels' fill
        # while the device runs the first level.
        for part, (start, stop) in enumerate(entry.parts):
            self._prepare(entry, levels, start, stop)
            if not self.capture:
                self._program(entry, start, stop)
            elif part == len(entry.graphs):
                if not self._capture(key, entry, start, stop):
                    return None
            else:
                entry.graphs[part].replay()
        self.num_drafts += 1
        runner.num_forward_passes += len(levels)
        self.graphs.num_steps += len(levels)  # each level is a padded static step
        return [self._children(level) for level in entry.levels]

    def _new_entry(self, key: tuple[LevelKey, ...], levels: Sequence[DraftLevel]) -> _Entry:
        noise_offset = 0
        out = []
        for index, (level_key, level) in enumerate(zip(key, levels)):
            params, noise_rows = [], []
            for group_key, rows in level_key.groups:
                params.append(level.rules[rows[0]].params)
                if group_key[0] == "coupled":
                    noise_rows.append((noise_offset, noise_offset + len(rows)))
                    noise_offset += len(rows)
                else:
                    noise_rows.append(None)
            while len(self._buffers) <= index:
                self._buffers.append(self.runner.attention.plan_buffers())
            out.append(_Level(level_key, index, params, noise_rows))
        parts = [(0, 1)] + ([(1, len(out))] if len(out) > 1 else [])
        entry = self._entries[key] = _Entry(out, parts)
        return entry

    def _prepare(self, entry: _Entry, levels: Sequence[DraftLevel], start: int, stop: int) -> None:
        """Levels ``[start, stop)``: each one's inputs and attention plan into its own
        static buffers, the coupled rows' noise into theirs (queued on the device, no
        host read)."""
        runner = self.runner
        started = time.perf_counter()
        for level, data in zip(entry.levels[start:stop], levels[start:stop]):
            chunks = data.chunks
            input_ids, positions, row_index, level.plan = self.graphs.stage(
                host_step(chunks, last_token_rows(chunks)), [chunk.request.request_id for chunk in chunks],
                level.key.shape, self._upload((level.index, level.key.shape)), self._buffers[level.index])
            if level.input_ids is not None and input_ids.data_ptr() != level.input_ids.data_ptr():
                raise RuntimeError("a draft graph's input buffer moved")  # cannot happen: fixed sizes
            level.input_ids, level.positions, level.rows = input_ids, positions, row_index
            if level.key.copies:
                src, dst = [c.src for c in data.copies], [c.dst for c in data.copies]
                runner.attention.check_block_copy(src, dst)
                copy_upload = self._upload((level.index, ("copies", len(src))))
                level.copy_ids = copy_upload(torch.tensor(src + dst, dtype=torch.long)).view(2, -1)
                runner.num_block_copies += len(src)
            for (group_key, group), span in zip(level.key.groups, level.noise_rows):
                if span is not None:
                    noise = self._noise_buffer(data.rules[group[0]].noise)
                    torch.stack([data.rules[i].noise for i in group], out=noise[span[0]:span[1]])
        self.fill_seconds += time.perf_counter() - started
        self.levels_filled += stop - start

    def _upload(self, key: tuple) -> StagedUpload:
        """The staging of ``key`` (a level and what it uploads): reused, so its device
        buffer keeps its address for the level's graph."""
        upload = self._uploads.get(key)
        if upload is None:
            upload = self._uploads[key] = StagedUpload(self.runner.device, torch.long)
        return upload

    def _noise_buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self._noise is None:
            self._noise = torch.empty((MAX_NOISE_ROWS, like.shape[-1]), dtype=like.dtype, device=like.device)
        return self._noise

    def _program(self, entry: _Entry, start: int, stop: int) -> None:
        """Levels ``[start, stop)`` of the draft over the prepared buffers: per level
        the feed from the level before (its draws left in that level's tensors, by
        the part before when ``start`` > 0), the forward with the level's plan, its
        logit rows, its draws."""
        runner = self.runner
        previous = _flat_draws(entry.levels[start - 1]) if start else None
        for level in entry.levels[start:stop]:
            key = level.key
            if key.copies:  # copy-on-write copies of the blocks this level's forks append to
                runner.attention.copy_blocks_on_device(level.copy_ids[0], level.copy_ids[1])
            if key.feeds:
                if level.feed_src is None:  # first run: fixed by the shape, made once
                    self._make_feed(level, entry.levels[level.index - 1])
                level.input_ids[level.feed_dst] = previous[level.feed_src].to(level.input_ids.dtype)
            runner.attention.use_plan(level.plan)
            hidden = runner.model(level.input_ids, level.positions, runner.attention)
            logits = runner.model.compute_logits(hidden[level.rows[:key.rows]])
            if not level.group_rows:
                level.group_rows = [None if len(rows) == key.rows else
                                    torch.tensor(rows, dtype=torch.long, device=logits.device)
                                    for _, rows in key.groups]
            level.drawn = []
            for (group_key, _), index, params, span in zip(key.groups, level.group_rows, level.params,
                                                           level.noise_rows):
                picked = logits if index is None else logits[index]
                noise = None if span is None else self._noise[span[0]:span[1]]
                level.drawn.append(draw_group(picked, group_key, params, noise))
            if not level.layout:
                for g, ((_, rows), (tokens, _)) in enumerate(zip(key.groups, level.drawn)):
                    for j, row in enumerate(rows):
                        level.layout[row] = (g, j, tokens.shape[-1])
            previous = _flat_draws(level)

    def _make_feed(self, level: _Level, before: _Level) -> None:
        """The fixed gather (children of the level before, flattened group by group)
        and scatter (the fed tokens' places in the padded input) of ``level``."""
        starts, offset = [], 0
        for tokens, _ in before.drawn:
            starts.append(offset)
            offset += tokens.numel()
        tokens_per_request = level.key.shape[1]
        src, dst = [], []
        for (chunk, source, rank), place in zip(level.key.feeds, level.key.offsets):
            found = before.layout.get(source)
            if found is None or rank >= found[2]:
                raise ValueError(f"a draft node takes child {rank} of a node that drew "
                                 f"{0 if found is None else found[2]}")
            group, index, k = found
            src.append(starts[group] + index * k + rank)
            dst.append(chunk * tokens_per_request + place)
        device = level.input_ids.device
        level.feed_src = torch.tensor(src, dtype=torch.long, device=device)
        level.feed_dst = torch.tensor(dst, dtype=torch.long, device=device)

    def _capture(self, key: tuple[LevelKey, ...], entry: _Entry, start: int, stop: int) -> bool:
        """Run levels ``[start, stop)`` once (this draft's result, and the compiles and
        index tensors the graph needs), capture them, and replay the graph. A failed
        capture leaves the shape to level-by-level drafts, with a warning; False then
        (the draft runs again level by level: the same slots, the same draws)."""
        runner = self.runner
        graphs = self.graphs
        side = graphs.side_stream()
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):
            self._program(entry, start, stop)
        stream = torch.cuda.current_stream(runner.device)
        stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=graphs.pool):
                self._program(entry, start, stop)
        except Exception as exc:  # noqa: BLE001 - that shape drafts level by level
            torch.cuda.set_stream(stream)
            del self._entries[key]
            self._refused.add(key)
            self.failed.append(f"{type(exc).__name__}: {exc}")
            logger.warning("CUDA graph capture failed for a draft of %d levels (%s); such drafts run level by "
                           "level", len(key), self.failed[-1])
            return False
        graphs.pool = graph.pool()
        entry.graphs.append(graph)
        self.num_captures += 1
        self.captured_last = True
        logger.info("captured a whole-draft CUDA graph: levels %d-%d of %d, %s (%d draft shapes of at most %d)",
                    start, stop - 1, len(key), "/".join(f"{k.shape[0]}x{k.shape[1]}" for k in key[start:stop]),
                    len(self._entries), MAX_DRAFT_GRAPHS)
        graph.replay()
        return True

    @staticmethod
    def _children(level: _Level) -> list[DrawnChildren | None]:
        out: list[DrawnChildren | None] = [None] * level.key.rows
        for row, (group, index, _) in level.layout.items():
            tokens, increments = level.drawn[group]
            out[row] = DrawnChildren(tokens[index], increments[index])
        return out


def _flat_draws(level: _Level) -> torch.Tensor | None:
    """Every child a level drew, its groups' tokens one after another (None: no draws)."""
    return torch.cat([tokens.reshape(-1) for tokens, _ in level.drawn]) if level.drawn else None
