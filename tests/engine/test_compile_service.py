"""The grammar compile service: identical constraints share a compile, the queue is
bounded per server and per client, deadlines count from arrival, a compile nobody
waits for is dropped or killed, and a cached constraint never waits behind compiles."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedtree import SamplingParams
from pagedtree.structured.compile_service import (CompileCancelled, CompileQueueFull, CompileService,
                                                  CompileWaitExpired)
from pagedtree.structured.compile_worker import CompileTimeout
from pagedtree.structured_params import GrammarCompileConfig, StructuredOutputsParams


class GatedWorker:
    """A worker whose compiles wait for the test to release them (``gate``), record
    what ran, and end early when interrupted."""

    instances: list[GatedWorker] = []

    def __init__(self, tokenizer_info_json: str, memory_bytes: int | None = None):
        self.started = self.interrupted = 0
        self.compiled: list[tuple] = []
        self.gate = threading.Event()
        self.running = threading.Event()
        self._alive = False
        GatedWorker.instances.append(self)

    def start(self) -> None:
        self.started += 1
        self._alive = True

    def alive(self) -> bool:
        return self._alive

    def compile(self, request: tuple, timeout_s: float) -> str:
        self.running.set()
        released = self.gate.wait(timeout_s)
        self.running.clear()
        if not self._alive:
            raise ValueError("the grammar compiler ran out of resources on this constraint")
        if not released:
            self._alive = False
            raise CompileTimeout(f"compiling took longer than {timeout_s:g} s")
        self.compiled.append(request)
        return f"compiled {request[1]}"

    def interrupt(self) -> None:
        self.interrupted += 1
        self._alive = False
        self.gate.set()

    def rss_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self._alive = False
        self.gate.set()


@pytest.fixture
def service():
    GatedWorker.instances = []
    out = CompileService("{}", GrammarCompileConfig(workers=1, max_queued=2, max_per_client=2), GatedWorker)
    yield out
    out.close()


def _submit(service: CompileService, name: str, client: str | None = None, timeout: float = 5.0):
    return service.submit(name, ("regex", name, True), timeout, lambda text: text.upper(), client)


def _running(service: CompileService) -> GatedWorker:
    deadline = time.monotonic() + 5
    while not GatedWorker.instances or not GatedWorker.instances[-1].running.is_set():
        assert time.monotonic() < deadline, "no compile started"
        time.sleep(0.005)
    return GatedWorker.instances[-1]


def test_identical_constraints_share_one_compile(service):
    first = _submit(service, "a")
    worker = _running(service)
    second = _submit(service, "a")
    assert second is first and first.waiters == 2
    worker.gate.set()
    assert first.future.result(5) == second.future.result(5) == "COMPILED A"
    assert worker.compiled == [("regex", "a", True)] and service.num_compiled == 1


def test_the_queue_is_bounded_per_server_and_per_client(service):
    running = _submit(service, "a", "x")
    worker = _running(service)
    _submit(service, "b", "x")  # x's second
    with pytest.raises(CompileQueueFull, match="this client has 2") as refused:
        _submit(service, "c", "x")
    assert refused.value.retry_after_s >= 1
    _submit(service, "d", "y")  # the queue holds b and d now
    with pytest.raises(CompileQueueFull, match="2 grammar compiles are queued"):
        _submit(service, "e", "z")
    assert _submit(service, "a", "z") is running  # joining a compile in flight costs nothing
    assert service.num_refused == 2
    worker.gate.set()


def test_the_time_limit_counts_from_arrival(service):
    """A job still queued at its deadline is refused without being compiled, as a
    busy server (retry later), not as a constraint too slow to compile."""
    _submit(service, "a")
    worker = _running(service)
    late = _submit(service, "b", timeout=0.05)
    time.sleep(0.1)
    worker.gate.set()
    with pytest.raises(CompileWaitExpired, match="busy for this constraint's whole time limit") as refused:
        late.future.result(5)
    assert refused.value.retry_after_s >= 1
    assert [r[1] for r in worker.compiled] == ["a"] and service.num_expired == 1


class SlowStartWorker(GatedWorker):
    """A worker whose process takes 0.3 s to start (a restart importing its libraries)."""

    def start(self) -> None:
        time.sleep(0.3)
        super().start()


class SlowStartOpenWorker(SlowStartWorker):
    """A slow-starting worker whose compiles finish at once."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int | None = None):
        super().__init__(tokenizer_info_json, memory_bytes)
        self.gate.set()


class FailsFirstStartWorker(SlowStartOpenWorker):
    """The first worker made fails to start (the service then starts one on the next
    job's path)."""

    def start(self) -> None:
        if len(GatedWorker.instances) == 1:
            raise RuntimeError("no memory for a new process")
        super().start()


@pytest.mark.parametrize("worker", [SlowStartOpenWorker, FailsFirstStartWorker],
                         ids=["started-with-the-service", "started-on-the-job's-path"])
def test_a_job_does_not_pay_for_its_worker_starting(worker):
    """Starting a worker process is the server's cost: a job that waited for one (the
    service's first, started when the service starts, or one started on its own path
    after a failed start) has its whole time limit to compile after it, however
    short the limit."""
    GatedWorker.instances = []
    service = CompileService("{}", GrammarCompileConfig(workers=1), worker)
    try:
        job = _submit(service, "a", timeout=0.05)  # shorter than the 0.3 s start
        assert job.future.result(5) == "COMPILED A"
        assert service.num_expired == 0 and service.num_killed == 0
        assert sum(w.started for w in GatedWorker.instances) == 1
    finally:
        service.close()


def test_a_compile_nobody_waits_for_is_dropped_or_killed(service):
    running = _submit(service, "a")
    worker = _running(service)
    queued = _submit(service, "b")
    joined = _submit(service, "b")
    assert joined is queued
    service.leave(queued)  # one waiter of two leaves: it stays
    assert service.queued() == 1
    service.leave(queued)  # the last one: dropped, never compiled
    with pytest.raises(CompileCancelled):
        queued.future.result(5)
    assert service.queued() == 0
    service.leave(running)  # running: its worker is killed
    with pytest.raises(CompileCancelled):
        running.future.result(5)
    assert worker.interrupted == 1 and service.num_killed == 1
    # The dispatcher replaces the killed worker at once, before any job asks for it.
    deadline = time.monotonic() + 5
    while len(GatedWorker.instances) < 2 or not GatedWorker.instances[-1].alive():
        assert time.monotonic() < deadline, "the killed worker was not replaced"
        time.sleep(0.01)
    fresh = GatedWorker.instances[-1]
    assert fresh is not worker and fresh.started == 1
    after = _submit(service, "c")
    assert _running(service) is fresh
    fresh.gate.set()
    assert after.future.result(5) == "COMPILED C"
    assert len(GatedWorker.instances) == 2 and fresh.started == 1


def test_a_waiter_who_leaves_after_the_compile_leaves_the_worker_alone(service):
    """Its worker has compiled: a waiter that leaves while the result is read back
    (``finish``) must not kill it, or the next client's compile would meet a dying
    process and be refused for nothing."""
    in_finish, left = threading.Event(), threading.Event()

    def finish(text):
        in_finish.set()
        assert left.wait(5)
        return text.upper()

    first = service.submit("a", ("regex", "a", True), 5.0, finish)
    worker = _running(service)
    worker.gate.set()
    assert in_finish.wait(5)
    service.leave(first)
    left.set()
    assert first.future.result(5) == "COMPILED A" and worker.interrupted == 0
    worker.gate.clear()
    second = _submit(service, "b")
    assert _running(service) is worker
    worker.gate.set()
    assert second.future.result(5) == "COMPILED B" and len(GatedWorker.instances) == 1


def test_an_interrupted_worker_is_gone_at_once_and_starts_again():
    """(The real process.) A killed child still polls as running for a moment: the
    worker says it is not alive from the interrupt on, and its next compile starts a
    new child."""
    import xgrammar as xgr

    from pagedtree.structured.compile_worker import CompileWorker

    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    worker = CompileWorker(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]).serialize_json())
    try:
        worker.start()
        assert worker.alive()
        worker.interrupt()
        assert not worker.alive()
        payload, _ = worker.compile(("regex", "[a-z]{3}", True), 60.0)
        assert payload and worker.alive()
    finally:
        worker.close()


async def _until(condition, limit_s: float = 30.0) -> None:
    """Wait for ``condition`` (polled); fail past ``limit_s``, a bound on a hang."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("storm_size, max_queued", [
    (6, 3),
    pytest.param(20, 16, marks=pytest.mark.slow, id="the-full-storm"),
])
def test_a_cached_constraint_never_waits_behind_a_storm_of_compiles(tiny_text_model, storm_size, max_queued):
    """Slow compiles from many clients fill the one worker (the first killed at the
    time limit, a 400; the queued ones refused at theirs, counted from arrival,
    without compiling, as a busy server: 429); a constrained request whose grammar is cached is accepted while the
    first slow compile still runs (no compile has ended then: the time limit, 5 s,
    is the margin, not a measured time); the compile queue's bound refuses the
    excess with 429 at once."""
    from pagedtree.engine.async_engine import AsyncEngine
    from tests.engine.test_structured_outputs import slow_regex

    async def main():
        engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256,
                             structured_output_limits={"compile_timeout_s": 5.0},
                             grammar_compile={"workers": 1, "max_queued": max_queued, "max_per_client": 1})
        try:
            cached = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
            await engine.add_request("Hello", cached)  # compiled now: cached from here on
            storm = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                regex=slow_regex() + f"|{i}")) for i in range(storm_size)]
            tasks = [asyncio.create_task(engine.add_request("Hello", storm[0], client="c0"))]
            # Polled, not slept for (a loaded machine is slow): the first compile is
            # running before the rest arrive, so the queue's bound meets all the others.
            await _until(lambda: engine.grammars.stats()["grammar_compiles_running"] == 1)
            tasks += [asyncio.create_task(engine.add_request("Hello", p, client=f"c{i}"))
                      for i, p in enumerate(storm[1:], start=1)]
            await _until(lambda: engine.grammars.stats()["grammar_compiles_refused"] == refused
                         and engine.grammars.stats()["grammar_compile_queue"] == max_queued)
            stream = await engine.add_request("Hello", cached, client="c0")
            queued_at = engine.grammars.stats()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            async for _ in stream:
                pass
            return queued_at, results
        finally:
            await engine.shutdown()

    refused = storm_size - 1 - max_queued
    queued_at, results = asyncio.run(main())
    # When the cached request was accepted, no compile of the storm had ended.
    assert queued_at["grammar_compiles_killed"] == 0 and queued_at["grammar_compile_queue"] == max_queued
    expired = [r for r in results if isinstance(r, CompileWaitExpired)]
    full = [r for r in results if isinstance(r, CompileQueueFull) and r not in expired]
    slow = [r for r in results if isinstance(r, ValueError) and "took longer than 5 s" in str(r)]
    assert len(full) == refused and len(expired) == max_queued and len(slow) == 1


def test_a_request_that_goes_away_kills_its_compile(tiny_text_model):
    """The caller of a slow compile is cancelled (its client disconnected): the
    compile is killed well before its time limit, and the next constraint compiles
    on a fresh worker."""
    from pagedtree.engine.async_engine import AsyncEngine
    from tests.engine.test_structured_outputs import slow_regex

    async def main():
        engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256,
                             structured_output_limits={"compile_timeout_s": 60.0},
                             grammar_compile={"workers": 1})
        try:
            slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex=slow_regex()))
            task = asyncio.create_task(engine.add_request("Hello", slow))
            while engine.grammars.stats()["grammar_compiles_running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while engine.grammars.stats()["grammar_compiles_killed"] == 0:
                await asyncio.sleep(0.01)  # killed, not run to its 60 s limit (the test's own timeout would end it)
            quick = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
            stream = await engine.add_request("Hello", quick)
            async for out in stream:
                pass
            return out, engine.grammars.stats()
        finally:
            await engine.shutdown()

    out, stats = asyncio.run(main())
    assert out.finished and stats["grammar_compiles_killed"] == 1 and stats["grammars_compiled"] >= 1


def test_a_workers_memory_bound_counts_from_its_loaded_compiler():
    """(The real process.) The bound is what a compile may add to the child's data
    once xgrammar and the vocabulary are loaded (a CUDA build of torch alone holds 810
    MB of data there): at the smallest bound, 256 MiB, a plain constraint compiles and
    a constraint whose automaton needs gigabytes fails in the child, within seconds,
    as a refusal; the next compile starts a fresh child."""
    import xgrammar as xgr

    from pagedtree.structured.compile_worker import CompileWorker, data_bytes

    # slow_regex()'s first 300 alternatives: about 0.6 s to a failed allocation at 256 MiB.
    hungry = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 300)) + ")"
    assert data_bytes() > 0  # read from /proc, as the child reads its own
    vocab = [chr(c) for c in range(32, 127)] + ["</s>"]
    worker = CompileWorker(xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1]).serialize_json(),
                           memory_bytes=2**28)
    try:
        payload, _ = worker.compile(("regex", "[a-z]{3}", True), 60.0)
        assert payload
        started = time.monotonic()
        with pytest.raises(ValueError, match="failed on this constraint"):
            worker.compile(("regex", hungry, True), 60.0)
        assert time.monotonic() - started < 30  # the bound ended it, not a time limit
        payload, _ = worker.compile(("regex", "[0-9]+", True), 60.0)
        assert payload
    finally:
        worker.close()
