"""Grammar compiles served to every client fairly: bounded queues, deadlines from
arrival, abandoned compiles cancelled, several worker processes.

One server's constraints compile in worker processes (``CompileWorker``: native code
that only a kill can stop). Without care, one client's slow constraints hold every
other client's: a single queue served in order, each compile up to the time limit.
Here:

- a constraint already compiled never reaches the service (``Grammars`` answers from
  its cache without waiting);
- identical constraints in flight share one compile (``CompileJob.waiters``);
- the queue is bounded per server (``max_queued``) and per client (``max_per_client``,
  a client being an API key or a connection): beyond either, ``CompileQueueFull``
  (HTTP 429 with ``Retry-After``) before anything is queued;
- the time limit counts from arrival: a job that reaches no worker by its deadline is
  refused without compiling (``CompileWaitExpired``, HTTP 429 with ``Retry-After``:
  nothing is known against the constraint), and a running one gets only what is left;
  the time a job waited for a worker process to start is not counted (starting is
  the server's cost, not the constraint's: each dispatcher starts its worker when
  the service starts, so the first constraints do not wait for it either);
- a job whose waiters have all gone is dropped from the queue, or, running, its
  worker is killed; a worker that was killed is started again by its own dispatcher
  thread before its next job, never on a request's path;
- ``workers`` dispatcher threads, each with its own worker process (by default about
  half the cores, at least one), each process's memory bounded
  (``GrammarCompileConfig.worker_memory_bytes``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedtree.structured.compile_worker import CompiledPayload, CompileTimeout, CompileWorker
from pagedtree.structured_params import GrammarCompileConfig

logger = logging.getLogger("pagedtree")


class CompileQueueFull(RuntimeError):
    """The grammar compile queue is full (for the server or for this client); retry
    after ``retry_after_s`` seconds (HTTP 429). Nothing was queued."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CompileWaitExpired(CompileQueueFull):
    """The time limit passed while the constraint waited for a compile worker (busy
    with other compiles, or starting again): it was never compiled, so it says
    nothing about the constraint; retry after ``retry_after_s`` seconds (HTTP 429)."""


class CompileCancelled(RuntimeError):
    """The compile was dropped: every request waiting for it went away."""


@dataclass(eq=False)
class CompileJob:
    """One constraint to compile, shared by the requests waiting for it."""

    key: Any
    request: tuple  # (kind, value, any_whitespace), what the worker compiles
    deadline: float  # time.monotonic() by which it must be compiled
    finish: Callable[[CompiledPayload], Any]  # the worker's reply -> the job's result (raises ValueError)
    owner: str | None = None  # the client whose request queued it (its per-client count)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: int = 1
    worker: CompileWorker | None = None  # the worker compiling it, while it runs
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)


class CompileService:
    """Worker processes of one vocabulary and the queue that feeds them (see module docstring)."""

    def __init__(self, tokenizer_info_json: str, config: GrammarCompileConfig,
                 worker_factory: Callable[..., CompileWorker] = CompileWorker):
        self.config = config
        self.key = ""  # its vocabulary's digest, when shared (``shared_service``)
        self._make_worker = lambda: worker_factory(tokenizer_info_json, memory_bytes=config.worker_memory_bytes)
        self._lock = threading.Condition()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._by_key: dict[Any, CompileJob] = {}  # queued or running
        self._per_client: collections.Counter = collections.Counter()  # jobs queued or running a client asked for
        self._workers: list[CompileWorker | None] = [None] * config.workers
        # Per dispatcher, when its last worker start began and ended: a job that waited
        # through it gets that time back (``_credit_start``).
        self._starts: list[tuple[float, float]] = [(0.0, 0.0)] * config.workers
        self._closed = False
        self.num_compiled = 0
        self.num_killed = 0  # past their deadline, or abandoned
        self.num_refused = 0  # CompileQueueFull
        self.num_expired = 0  # refused at their deadline without compiling
        self._mean_seconds = 1.0  # a compile's time, smoothed: the Retry-After estimate
        self._threads = [threading.Thread(target=self._dispatch, args=(i,), name=f"pagedtree-grammar-{i}",
                                          daemon=True) for i in range(config.workers)]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ requests
    def submit(self, key: Any, request: tuple, timeout_s: float, finish: Callable[[CompiledPayload], Any],
               client: str | None = None) -> CompileJob:
        """The job compiling ``request`` (``key`` identifies it): joined when the same
        constraint is already queued or running, else queued with a deadline of now +
        ``timeout_s``. ``CompileQueueFull`` when the server's or the client's queue is
        full. Wait on ``job.future``; call ``leave(job)`` when giving up."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            job = self._by_key.get(key)
            if job is not None and not job.cancelled:
                job.waiters += 1
                return job
            if len(self._queue) >= self.config.max_queued:
                self.num_refused += 1
                raise CompileQueueFull(f"{len(self._queue)} grammar compiles are queued on this server; retry "
                                       "later", self._retry_after(len(self._queue)))
            if client is not None and self._per_client[client] >= self.config.max_per_client:
                self.num_refused += 1
                raise CompileQueueFull(f"this client has {self._per_client[client]} grammar compiles in flight "
                                       f"(at most {self.config.max_per_client}); retry once they are done",
                                       self._retry_after(self._per_client[client]))
            job = CompileJob(key, request, time.monotonic() + timeout_s, finish, owner=client)
            if client is not None:
                self._per_client[client] += 1
            self._by_key[key] = job
            self._queue.append(job)
            self._lock.notify()
            return job

    def leave(self, job: CompileJob) -> None:
        """A waiter of ``job`` gave up (its request was cancelled): the last one to go
        drops the job from the queue, or kills the worker that runs it (under the lock,
        while that worker is still on this job: its dispatcher sees the kill, settles
        the job and starts a new worker before its next one)."""
        with self._lock:
            if job.future.done() or job.cancelled:
                return
            job.waiters -= 1
            if job.waiters > 0:
                return
            job.cancelled = True
            if job in self._queue:
                self._queue.remove(job)
                self._forget(job)
                job.future.set_exception(CompileCancelled("every request waiting for this compile went away"))
            elif job.worker is not None:
                job.worker.interrupt()

    def queued(self) -> int:
        """Jobs waiting for a worker."""
        with self._lock:
            return len(self._queue)

    def running(self) -> int:
        """Jobs compiling on a worker now."""
        with self._lock:
            return sum(job.worker is not None for job in self._by_key.values())

    def worker_rss_bytes(self) -> int:
        """Resident memory of the worker processes (Linux; 0 elsewhere)."""
        with self._lock:
            workers = [w for w in self._workers if w is not None]
        return sum(w.rss_bytes() for w in workers)

    def close(self) -> None:
        """Stop the dispatchers and the worker processes; queued jobs are refused."""
        with self._lock:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            workers = [w for w in self._workers if w is not None]
            self._lock.notify_all()
        for job in pending:
            self._forget(job)
            if not job.future.done():
                job.future.set_exception(RuntimeError("the grammar compiler is shut down"))
        for worker in workers:
            worker.close()

    # --------------------------------------------------------- dispatchers
    def _dispatch(self, index: int) -> None:
        """One dispatcher: its worker started at once, then the next job to it,
        within the job's deadline."""
        self._replace_dead_worker(index, first=True)
        while True:
            self._replace_dead_worker(index)
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._credit_start(job, index)
                if self._expire_if_late(job):
                    continue
                worker = self._workers[index]
            if worker is None or not worker.alive():
                began = time.monotonic()
                try:
                    worker = self._make_worker()
                    worker.start()
                except Exception as exc:  # noqa: BLE001 - this job fails; the next one tries again
                    self._settle(job, exception=RuntimeError(f"the grammar compiler could not start: {exc}"))
                    continue
                finally:
                    self._starts[index] = (began, time.monotonic())
                with self._lock:
                    self._credit_start(job, index)  # its wait for the start is not its time
                    if self._closed:  # shut down while it started
                        worker.close()
                        self._settle(job, exception=RuntimeError("the grammar compiler is shut down"))
                        return
                    self._workers[index] = worker
            with self._lock:
                if job.cancelled:  # abandoned while its worker started
                    self._forget(job)
                    continue
                if self._expire_if_late(job):
                    continue
                job.worker = worker
                remaining = job.deadline - time.monotonic()
            started = time.monotonic()
            try:
                compiled = worker.compile(job.request, max(remaining, 0.001))
            except CompileTimeout as exc:
                self._count_kill(job)
                self._settle(job, exception=exc)
                continue
            except (ValueError, RuntimeError) as exc:
                if job.cancelled:  # killed because nobody waits any more
                    self._count_kill(job)
                    self._settle(job, exception=CompileCancelled("every request waiting for this compile went away"))
                else:
                    self._settle(job, exception=exc)
                continue
            with self._lock:
                # Done with the worker: a waiter who leaves now must not kill it (it
                # may be on another client's job by then).
                job.worker = None
            self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - started)
            try:
                result = job.finish(compiled)
            except Exception as exc:  # noqa: BLE001 - the job's own error (a ValueError naming the field)
                self._settle(job, exception=exc)
                continue
            with self._lock:
                self.num_compiled += 1
            self._settle(job, result=result)

    def _replace_dead_worker(self, index: int, first: bool = False) -> None:
        """A worker that died on its last job (killed at its time limit, abandoned, out
        of memory) is replaced now, between jobs, so that the next constraint does not
        wait for a process start; ``first``: the dispatcher's first worker, started
        before any job comes. A failed start leaves the slot empty: the next job
        starts one (and fails alone if that fails too)."""
        with self._lock:
            worker = self._workers[index]
            if self._closed or (not first and worker is None) or (worker is not None and worker.alive()):
                return
            self._workers[index] = None
        fresh = self._make_worker()
        began = time.monotonic()
        try:
            fresh.start()
        except Exception:  # noqa: BLE001 - the next job tries again
            logger.warning("a grammar compile worker failed to start; the next compile tries again")
            return
        finally:
            self._starts[index] = (began, time.monotonic())
        with self._lock:
            if not self._closed:
                self._workers[index] = fresh
                return
        fresh.close()

    def _credit_start(self, job: CompileJob, index: int) -> None:
        """Give ``job`` back (under the lock) the part of its wait that this
        dispatcher spent starting its worker."""
        began, ended = self._starts[index]
        overlap = min(ended, time.monotonic()) - max(began, job.arrived)
        if overlap > 0:
            job.deadline += overlap

    def _expire_if_late(self, job: CompileJob) -> bool:
        """Refuse ``job`` (under the lock) if its deadline passed before it reached a
        worker: retryable, since the constraint itself was never tried."""
        if job.deadline - time.monotonic() > 0:
            return False
        self._forget(job)
        self.num_expired += 1
        job.future.set_exception(CompileWaitExpired(
            "the grammar compilers were busy for this constraint's whole time limit; retry later",
            self._retry_after(len(self._queue))))
        return True

    def _count_kill(self, job: CompileJob) -> None:
        with self._lock:
            self.num_killed += 1

    def _settle(self, job: CompileJob, result: Any = None, exception: BaseException | None = None) -> None:
        with self._lock:
            self._forget(job)
            job.worker = None
        try:
            if exception is not None:
                job.future.set_exception(exception)
            else:
                job.future.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass  # settled already (the service shut down meanwhile)

    def _forget(self, job: CompileJob) -> None:
        """Drop the job's bookkeeping (under the lock, or from the only thread using it)."""
        if self._by_key.get(job.key) is job:
            del self._by_key[job.key]
        if job.owner is not None and self._per_client.get(job.owner):
            self._per_client[job.owner] -= 1
            if self._per_client[job.owner] <= 0:
                del self._per_client[job.owner]
            job.owner = None  # counted off once

    def _retry_after(self, ahead: int) -> float:
        """Seconds until ``ahead`` compiles are likely done, at least one."""
        return max(1.0, math.ceil(self._mean_seconds * (ahead + 1) / max(1, self.config.workers)))


# Engines of one process with the same vocabulary and compile settings share one
# service (its processes cost seconds to start and about 330 MiB each):
# digest -> (service, users).
_SHARED: dict[str, tuple[CompileService, int]] = {}
_SHARED_LOCK = threading.Lock()


def shared_service(tokenizer_info_json: str, config: GrammarCompileConfig) -> CompileService:
    """The process's compile service for this vocabulary and ``config`` (made on first
    use); give it back with ``release_service``."""
    key = hashlib.sha256(tokenizer_info_json.encode() + repr(config).encode()).hexdigest()
    with _SHARED_LOCK:
        service, users = _SHARED.get(key, (None, 0))
        if service is None:
            service = CompileService(tokenizer_info_json, config)
            service.key = key
        _SHARED[key] = (service, users + 1)
        return service


def release_service(service: CompileService) -> None:
    """One user fewer; the last one stops the service's workers."""
    with _SHARED_LOCK:
        _, users = _SHARED.get(service.key, (service, 1))
        if users > 1:
            _SHARED[service.key] = (service, users - 1)
            return
        _SHARED.pop(service.key, None)
    service.close()
