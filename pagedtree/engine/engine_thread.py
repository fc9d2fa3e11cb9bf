"""The dedicated thread that owns an ``LLMEngine``.

Every engine call (load, add, abort, step, stats) happens on this one thread, so the
engine needs no locks. Other threads talk to it through a FIFO command queue; each
command carries a ``concurrent.futures.Future`` for its answer. Step outputs go back
to each request's event loop with one ``call_soon_threadsafe`` per loop per step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedtree.config import EngineConfig
from pagedtree.distributed.group import TensorParallelError
from pagedtree.engine.errors import EngineStoppedError, InvalidRequestError
from pagedtree.engine.input_processor import PromptType
from pagedtree.engine.llm_engine import LLMEngine
from pagedtree.engine.warm_up import warm_up
from pagedtree.outputs import RequestOutput
from pagedtree.sampling_params import SamplingParams
from pagedtree.host_memory import IDLE_TRIM_DELAY, HeapTrimmer

logger = logging.getLogger("pagedtree.async")

STATS_INTERVAL_S = 0.05  # how stale AsyncEngine.stats() may get while the engine is busy
STEP_FAILED_MESSAGE = "internal engine error (details are in the server log)"


class OutputSink(Protocol):
    """Where a request's outputs go (``RequestStream``); its methods run on ``loop``."""

    request_id: str
    loop: Any

    def push(self, output: RequestOutput, stamp: float) -> None: ...

    def fail(self, message: str, stamp: float) -> None: ...


@dataclass(slots=True)
class NewRequest:
    """One request of an ``AddCommand``."""

    request_id: str
    prompt: PromptType  # token ids already (AsyncEngine tokenizes text before queueing)
    params: SamplingParams | None
    sink: OutputSink


@dataclass(slots=True)
class AddCommand:
    """Validate and queue requests, all or none; the answer is each one's prompt length.

    A batch is one command so that a client's prompt list joins the running batch in
    one engine step, like as many concurrent clients.
    """

    requests: list[NewRequest]
    check_context: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class AbortCommand:
    """Abort a request; the answer says whether it was still running."""

    request_id: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class CallCommand:
    """Run ``fn(engine)`` on the engine thread; the answer is its result."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class StopCommand:
    """Abort whatever still runs and end the thread."""

    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


Command = AddCommand | AbortCommand | CallCommand | StopCommand


class EngineThread(threading.Thread):
    """Loads the engine, then loops: run queued commands, step while there is work, repeat."""

    def __init__(self, config: EngineConfig, name: str = "pagedtree-engine", warm_up: bool = False):
        super().__init__(name=name, daemon=True)
        self._config = config
        self._warm_up = warm_up
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._sinks: dict[str, OutputSink] = {}
        self._closed = False
        self._close_lock = threading.Lock()
        self._stopping = False
        self.engine: LLMEngine | None = None
        # Free heap back to the OS when idle (and now and then when busy); see host_allocator.
        self.trimmer = HeapTrimmer()
        # Replaced (never mutated) after every loop turn, so readers on other threads
        # always see a consistent dict without a lock.
        self.stats_snapshot: dict[str, Any] = {}
        self.error: BaseException | None = None

    # ------------------------------------------------------ other threads
    def start_and_wait(self) -> LLMEngine:
        """Start the thread and block until the model is loaded (re-raising a load error)."""
        self.start()
        return self._ready.result()

    def submit(self, command: Command) -> concurrent.futures.Future:
        """Queue a command; raises ``EngineStoppedError`` once the thread has ended."""
        with self._close_lock:
            if self._closed:
                raise EngineStoppedError(self._stopped_message())
            self._commands.put(command)
        return command.future

    @property
    def closed(self) -> bool:
        """Whether the thread accepts no more commands."""
        return self._closed

    def _stopped_message(self) -> str:
        if self.error is not None:
            return "the engine thread died (details are in the server log)"
        return "the engine is shut down"

    # --------------------------------------------------------- the thread
    def run(self) -> None:
        try:
            engine = LLMEngine(self._config)
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self.error = exc
            self._ready.set_exception(exc)
            self._close()
            return
        if self._warm_up:
            try:
                report = warm_up(engine)
            except BaseException as exc:  # noqa: BLE001 - an engine that cannot run a step cannot serve
                self.error = exc
                self._ready.set_exception(exc)
                self._close()
                engine.shutdown()
                return
            logger.info("warmed up in %.1fs (%d requests, %d steps)", report.seconds, report.num_requests,
                        report.num_steps)
        self.engine = engine
        self.stats_snapshot = self._stats(engine)
        self._ready.set_result(engine)
        try:
            stats_time = 0.0
            while not self._stopping:
                if engine.has_unfinished_requests():
                    self._run_commands(block=False)
                elif not self._run_commands(block=True, timeout=IDLE_TRIM_DELAY):
                    # Idle for a while: hand the free heap of the last burst back to the OS.
                    self.trimmer.idle()
                    self.stats_snapshot = self._stats(engine)
                    self._run_commands(block=True)
                if not self._stopping and engine.has_unfinished_requests():
                    self._step(engine)
                    self.trimmer.worked()
                now = time.monotonic()
                # stats() copies lists (speculation histories): refresh it at a bounded
                # rate while stepping, and always before sleeping on the queue.
                if not engine.has_unfinished_requests() or now - stats_time >= STATS_INTERVAL_S:
                    self.stats_snapshot = self._stats(engine)
                    stats_time = now
        except BaseException as exc:  # noqa: BLE001 - the engine is unusable; fail everyone
            logger.exception("the engine thread died")
            self.error = exc
            self._post([(sink, None) for sink in self._sinks.values()], fail_message=STEP_FAILED_MESSAGE)
            self._sinks.clear()
        finally:
            self._close()
            engine.shutdown()  # the tensor-parallel ranks stop with the thread

    def _stats(self, engine: LLMEngine) -> dict[str, Any]:
        return engine.stats() | {"num_heap_trims": self.trimmer.num_trims}

    def _close(self) -> None:
        """Refuse new commands, and answer the ones still queued so no caller waits forever."""
        with self._close_lock:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, StopCommand):
                command.future.set_result(None)
            elif command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineStoppedError(self._stopped_message()))

    def _run_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run the queued commands; whether there were any. When idle, sleep on the
        queue (up to ``timeout`` seconds) instead of spinning; when busy, only drain it."""
        try:
            command = self._commands.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return False
        while True:
            self._run_command(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _run_command(self, command: Command) -> None:
        engine = self.engine
        assert engine is not None
        if isinstance(command, StopCommand):
            self._stopping = True
            for request_id in list(self._sinks):
                self._abort(engine, request_id)
            command.future.set_result(None)
            return
        if not command.future.set_running_or_notify_cancel():
            # The caller gave up before we got here: skip an add, still run an abort.
            if isinstance(command, AbortCommand):
                self._abort(engine, command.request_id)
            return
        try:
            if isinstance(command, AddCommand):
                command.future.set_result(self._add(engine, command))
            elif isinstance(command, AbortCommand):
                command.future.set_result(self._abort(engine, command.request_id))
            else:
                command.future.set_result(command.fn(engine))
        except InvalidRequestError as exc:
            # A client's mistake, which the message says in full. Passed on without its
            # traceback, it does not hold this frame, whose command's future holds the
            # exception: that cycle kept each refused prompt (its token ids and text)
            # alive until the next full garbage collection.
            exc.__cause__ = exc.__context__ = None
            command.future.set_exception(exc.with_traceback(None))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            command.future.set_exception(exc)

    def _add(self, engine: LLMEngine, command: AddCommand) -> list[int]:
        parents = []
        for index, new in enumerate(command.requests):
            try:
                if new.request_id in self._sinks or any(p.request_id == new.request_id for p in parents):
                    raise ValueError(f"request_id {new.request_id!r} is already in use")
                parent = engine.input_processor.make_requests(new.request_id, new.prompt, new.params)
                params = parent.children[0].params
                num_prompt = len(parent.prompt_token_ids)
                if command.check_context and params.max_tokens is not None:
                    if num_prompt + params.max_tokens > engine.max_model_len:
                        raise ValueError(
                            f"max_tokens: the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) "
                            f"exceeds the model's context of {engine.max_model_len} tokens"
                        )
            except ValueError as exc:
                raise InvalidRequestError(index, str(exc)) from exc
            parents.append(parent)
        for parent, new in zip(parents, command.requests):
            engine.add_parent(parent)
            self._sinks[new.request_id] = new.sink
        return [len(p.prompt_token_ids) for p in parents]

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        output = engine.abort_request(request_id)
        if output is None:
            return False
        self._deliver([output])
        return True

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except TensorParallelError:
            raise  # a rank is gone: nothing can run any more; the thread ends and fails everyone
        except Exception:  # noqa: BLE001 - fail the requests in flight, keep serving
            # Which request broke the step is unknown, so all in flight end; the
            # details (which may quote any request) go to the log, not to clients.
            logger.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            outputs = []
            for request_id in list(self._sinks):
                try:
                    output = engine.abort_request(request_id)
                except Exception:  # noqa: BLE001 - recovery must not kill the thread
                    logger.exception("aborting request %s after a failed step failed too", request_id)
                    output = None
                if output is not None:
                    outputs.append(_as_error(output, STEP_FAILED_MESSAGE))
                else:
                    sink = self._sinks.pop(request_id)
                    self._post([(sink, None)], fail_message=STEP_FAILED_MESSAGE)
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            items.append((sink, output))
        self._post(items)

    def _post(self, items: list[tuple[OutputSink, RequestOutput | None]], fail_message: str = "") -> None:
        """One ``call_soon_threadsafe`` per event loop for all of this step's outputs."""
        if not items:
            return
        stamp = time.monotonic()
        by_loop: dict[int, list] = {}
        for sink, output in items:
            by_loop.setdefault(id(sink.loop), []).append((sink, output))
        for batch in by_loop.values():
            loop = batch[0][0].loop
            try:
                loop.call_soon_threadsafe(_push_batch, batch, stamp, fail_message)
            except RuntimeError:
                # The consumer's loop is closed: nobody will read these; stop the work.
                logger.warning("event loop closed; aborting its %d requests", len(batch))
                if self.engine is not None and self.error is None:
                    for sink, _ in batch:
                        self._sinks.pop(sink.request_id, None)
                        self.engine.abort_request(sink.request_id)


def _push_batch(batch: list, stamp: float, fail_message: str) -> None:
    """Runs on the consumer's event loop."""
    for sink, output in batch:
        try:
            if output is None:
                sink.fail(fail_message, stamp)
            else:
                sink.push(output, stamp)
        except Exception:  # noqa: BLE001 - one broken consumer must not starve the others
            logger.exception("delivering an output failed")


def _as_error(output: RequestOutput, message: str) -> RequestOutput:
    """The aborted output of a request that failed with the whole step, marked as an error."""
    outputs = [
        dataclasses.replace(c, finish_reason="error") if c.finish_reason in (None, "abort") else c
        for c in output.outputs
    ]
    return dataclasses.replace(output, outputs=outputs, error=message)

