"""Run independent cases in worker processes, each case's crash or hang its own.

A kernel that reads out of bounds on a GPU can leave its CUDA context unusable
(an illegal address error is sticky): every later launch in that process fails. The
kernel cases therefore run in spawned worker processes (CUDA cannot be forked),
which also lets their compiles overlap. Each worker takes a fixed share of the cases
and reports when it starts and finishes each one; a worker that dies is known to
have died on the case it started last, which gets ``on_failure``'s result, and a
new worker takes over the rest of its share. A case running longer than
``timeout_s`` has its worker killed the same way.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.5


def serve(function: Callable[[Any], Any], share: list[tuple[int, Any]], results: Any) -> None:
    """A worker's loop: run ``function`` on each ``(index, case)`` of its share,
    announcing the start and sending the result of each."""
    for index, case in share:
        results.put(("start", index, None))
        results.put(("done", index, function(case)))


@dataclass(slots=True)
class Worker:
    """A worker process, the part of its share not finished yet, and the case it is on."""

    process: Any
    todo: list[tuple[int, Any]]
    current: int | None = None
    started: float = field(default_factory=time.monotonic)


class CasePool:
    """Worker processes over a list of cases (see the module docstring)."""

    def __init__(self, function: Callable[[Any], Any], cases: Sequence[Any], workers: int,
                 on_failure: Callable[[Any, str], Any], timeout_s: float,
                 on_result: Callable[[Any], None] | None = None):
        self.function = function
        self.cases = list(cases)
        self.on_failure = on_failure
        self.on_result = on_result
        self.timeout_s = timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.queue = self.context.Queue()
        self.results: dict[int, Any] = {}
        shares = [[(i, c) for i, c in enumerate(self.cases) if i % workers == w] for w in range(workers)]
        self.workers = [self._start(share) for share in shares if share]

    def _start(self, share: list[tuple[int, Any]]) -> Worker:
        process = self.context.Process(target=serve, args=(self.function, share, self.queue), daemon=True)
        process.start()
        return Worker(process, list(share))

    def run(self) -> list[Any]:
        """Every case's result, in the cases' order."""
        try:
            while self.workers:
                self._drain(timeout=POLL_S)
                for worker in list(self.workers):
                    self._watch(worker)
        finally:
            for worker in self.workers:
                worker.process.kill()
        return [self.results[i] for i in range(len(self.cases))]

    def _drain(self, timeout: float) -> None:
        """Handle the messages waiting (the first one waited for up to ``timeout``)."""
        block = True
        while True:
            try:
                kind, index, result = self.queue.get(block, timeout)
            except queue_module.Empty:
                return
            block = False
            worker = next((w for w in self.workers if any(i == index for i, _ in w.todo)), None)
            if worker is None:  # from a worker retired already: its case has a result
                continue
            if kind == "start":
                worker.current, worker.started = index, time.monotonic()
            else:
                self._finish(worker, index, result)

    def _finish(self, worker: Worker, index: int, result: Any) -> None:
        self.results[index] = result
        worker.todo = [(i, c) for i, c in worker.todo if i != index]
        worker.current = None
        if self.on_result is not None:
            self.on_result(result)

    def _watch(self, worker: Worker) -> None:
        """Retire a worker that is done; replace one that died or hangs."""
        if not worker.todo:
            worker.process.join()
            self.workers.remove(worker)
            return
        hung = worker.current is not None and time.monotonic() - worker.started > self.timeout_s
        if worker.process.is_alive() and not hung:
            return
        if hung:
            worker.process.kill()
            worker.process.join()
        else:
            self._drain(timeout=0.0)  # what it sent before it died
            if not worker.todo:
                return
        index = worker.current if worker.current is not None else worker.todo[0][0]
        why = (f"timed out after {self.timeout_s:.0f} s" if hung
               else f"worker process died (exit code {worker.process.exitcode})")
        self._finish(worker, index, self.on_failure(self.cases[index], why))
        self.workers.remove(worker)
        if worker.todo:
            self.workers.append(self._start(worker.todo))


def run_in_workers(function: Callable[[Any], Any], cases: Sequence[Any], workers: int,
                   on_failure: Callable[[Any, str], Any], timeout_s: float = 600.0,
                   on_result: Callable[[Any], None] | None = None) -> list[Any]:
    """``[function(case) for case in cases]`` in ``workers`` spawned processes;
    ``function`` and the cases must pickle (a module-level function, or a
    ``functools.partial`` of one)."""
    if not cases:
        return []
    return CasePool(function, cases, max(1, min(workers, len(cases))), on_failure, timeout_s, on_result).run()
