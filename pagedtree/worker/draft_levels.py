"""A whole draft run on the worker: every tree level queued back to back, no readback.

The draft worker reserves every node's KV slot on the host first, then hands the
levels here as plain data: each level's chunks (its fed nodes), the block copies due
before it, how each fed node draws its children, and which child of the level
before gives each fed node its input token. Each level's children are drawn on the
device (``draft_sampling.draw_level``: rows drawn alike in one batched op) and
the next level takes its input tokens from there (an ``InputFeed``), so the levels
queue one after another, and every level's children come back in one copy: one sync
a draft, not one a level.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedtree.draft_sampling import DraftLevel, DrawnChildren, draw_level, read_drawn
from pagedtree.step_data import BlockCopy, ScheduledChunk
from pagedtree.worker.step_inputs import InputFeed, last_token_rows


class ForwardTimer:
    """The seconds one forward took, measured without a sync of its own.

    On a CPU the forward has run when the call returns: the clock around the call.
    On CUDA the call only queues the forward, and the clock would time the queueing:
    a pair of CUDA events around the call instead, read once the draft's one
    readback has waited for everything queued before it. An explicit synchronize
    would give each level a second sync.
    """

    def __init__(self, device: torch.device | None):
        self.cuda = device is not None and device.type == "cuda"
        self._started = 0.0
        self._seconds = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            assert self._events is not None
            self._events[1].record()
        else:
            self._seconds = time.perf_counter() - self._started

    def seconds(self) -> float | None:
        """The forward's seconds; on CUDA, None while the end event has not been
        reached (read it after a sync)."""
        if not self.cuda:
            return self._seconds
        assert self._events is not None
        start, end = self._events
        if not end.query():
            return None
        return start.elapsed_time(end) / 1000.0


@dataclass(slots=True)
class DrawnLevel:
    """What a level left on the device: per chunk its drawn children (None where it
    drew none), and the timer of its forward (read after the readback), of which
    ``share`` is this level's."""

    children: list[DrawnChildren | None]
    timer: ForwardTimer
    num_tokens: int
    share: float = 1.0  # of the timer's seconds (levels of one graph replay share its timer; 0: unmeasured)


@dataclass(slots=True)
class HostChildren:
    """One fed node's children on the host: tokens in drawing order and their score
    increments (tokens the rule could not draw left out), and for the random rules
    the distribution they were drawn from (on the device)."""

    tokens: list[int]
    increments: list[float]
    probs: torch.Tensor | None = None


@dataclass(slots=True)
class DraftRun:
    """A whole draft on the host: per level, per chunk, its children (None where it
    drew none); and each level's forward as (tokens fed, seconds) where measured."""

    children: list[list[HostChildren | None]]
    forwards: list[tuple[int, float]]


def run_draft_levels(runner, levels: Sequence[DraftLevel]) -> DraftRun:
    """Run every level of a draft on ``runner`` (a ``ModelRunner``) in order, each
    level's input tokens taken on the device from the children the level before
    drew, then read every level's children back in one copy (``read_drawn``; a NaN
    draft distribution raises ``ValueError``).

    A runner with step graphs runs the whole draft as one program where it can
    (``draft_graphs.py``: two CUDA graph replays when capturing, the first level
    and the rest); its levels then share the program's time, each taking an equal
    part of it."""
    drawn = _whole_graph(runner, levels)
    if drawn is None:
        drawn = queue_draft_levels(runner, levels)
    flat = [children for level in drawn for children in level.children if children is not None]
    host = iter(read_drawn(flat))
    out = DraftRun(children=[], forwards=[])
    for level in drawn:
        row = []
        for children in level.children:
            if children is None:
                row.append(None)
            else:
                tokens, increments = next(host)
                row.append(HostChildren(tokens, increments, children.probs))
        out.children.append(row)
        seconds = level.timer.seconds()  # after the readback: on CUDA every level has run
        if seconds is not None and level.share > 0:
            out.forwards.append((level.num_tokens, seconds * level.share))
    return out


def _whole_graph(runner, levels: Sequence[DraftLevel]) -> list[DrawnLevel] | None:
    """The draft's levels run as one program by the runner's draft graphs, None
    where it has none or they cannot run this draft."""
    graphs = getattr(runner, "graphs", None)
    drafts = getattr(graphs, "drafts", None)
    if drafts is None or not levels:
        return None
    timer = ForwardTimer(getattr(runner, "device", None))
    timer.start()
    children = drafts.queue(levels)
    timer.stop()
    if children is None:
        return None
    # A draft that captured its graph ran twice and captured: not a replay's time.
    share = 0.0 if drafts.captured_last else 1.0 / len(levels)
    return [DrawnLevel(row, timer, sum(c.num_tokens for c in level.chunks), share)
            for row, level in zip(children, levels)]


def queue_draft_levels(runner, levels: Sequence[DraftLevel]) -> list[DrawnLevel]:
    """Queue every level of a draft on ``runner``, each level's input tokens taken on
    the device from the children the level before drew; nothing is read back."""
    drawn: list[DrawnLevel] = []
    for level in levels:
        logits, timer = draft_forward(runner, level.chunks, level.copies, _feed(level, drawn[-1] if drawn else None))
        children = draw_level(logits, level.rules)
        drawn.append(DrawnLevel(children, timer, sum(c.num_tokens for c in level.chunks)))
    return drawn


def draft_forward(runner, chunks: Sequence[ScheduledChunk], copies: Sequence[BlockCopy],
                  feed: InputFeed | None = None) -> tuple[torch.Tensor, ForwardTimer]:
    """One draft level: the block copies due before it and one forward over ``chunks``
    (input tokens taken on the device where ``feed`` says); the logits of each chunk's
    last token, and the forward's timer (read after the readback)."""
    timer = ForwardTimer(getattr(runner, "device", None))  # none: a host-side stand-in
    timer.start()
    runner.copy_blocks([c.src for c in copies], [c.dst for c in copies])
    rows = last_token_rows(chunks)
    logits = runner.forward(list(chunks), rows) if feed is None else runner.forward(list(chunks), rows, feed=feed)
    timer.stop()
    return logits, timer


def _feed(level: DraftLevel, before: DrawnLevel | None) -> InputFeed | None:
    """The level's input tokens from the children drawn the level before: one flat
    source (every chunk's children one after another), one row a fed chunk."""
    fed = [(j, source) for j, source in enumerate(level.feeds) if source is not None]
    if not fed:
        return None
    if before is None:
        raise ValueError("the first level of a draft has no children to take its tokens from")
    starts, parts, offset = {}, [], 0
    for i, children in enumerate(before.children):
        if children is not None:
            starts[i] = offset
            parts.append(children.tokens)
            offset += children.tokens.numel()
    for _, (i, rank) in fed:
        drawn = before.children[i]
        if drawn is None or rank >= drawn.tokens.numel():  # (a shape wider than the vocabulary)
            raise ValueError(f"a draft node takes child {rank} of a node that drew "
                             f"{0 if drawn is None else drawn.tokens.numel()}")
    flat = torch.cat(parts)
    return InputFeed(
        chunks=[j for j, _ in fed],
        offsets=[level.chunks[j].num_tokens - 1 for j, _ in fed],
        sources=[flat] * len(fed),
        rows=[starts[i] + rank for _, (i, rank) in fed],
    )
