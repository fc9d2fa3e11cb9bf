"""GPU time of a CUDA graph's replay: how the diagnostics time short launches without
the host's launch overhead (a Triton launch from Python costs tens of microseconds,
more than many kernels run)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_replay_seconds(record: Callable[[], object], device: torch.device, replays: int = 5) -> float:
    """Median seconds of one replay of a CUDA graph of the launches ``record()`` makes.

    ``record()`` runs once on a side stream first (workspaces, compiles, lazily built
    buffers), then under capture; raises what the capture raises (a call that syncs
    cannot be captured)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        record()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        record()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return statistics.median(times)
