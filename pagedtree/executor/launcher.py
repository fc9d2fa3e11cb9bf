"""Rank 0's side of a tensor-parallel group: start it, watch it, report on it, stop it.

``TensorParallelGroupHandle.start(config)``:

1. finds this process's address: torch.distributed's environment when
   ``WORLD_SIZE`` is set (other machines, or torchrun), else 127.0.0.1 with a free
   port, spawning ranks 1..N-1 here (torch.multiprocessing, spawn);
2. puts the engine's config in the rendezvous store for the workers;
3. waits for every rank to join, noticing at once a spawned rank that died first
   (its error is in the store), and joins the process groups with them.

Then the engine loads rank 0's shards through ``channel`` like any model. When a
collective fails, ``describe_failure`` says which rank died (exit code, signal)
or what it reported. ``shutdown`` tells the workers to stop, waits for them, and
terminates the ones that do not go.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import time
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp
from transformers import AutoConfig

from pagedtree.config import EngineConfig
from pagedtree.distributed.group import START_TIMEOUT, TensorParallelError, TensorParallelGroup, connect_store
from pagedtree.distributed.layout import ShardLayout
from pagedtree.executor.commands import CommandChannel, Op, parse_report, report_values
from pagedtree.executor.ranks import (
    SPAWN_ENVIRONMENT, RankAddress, env_address, local_addresses, rank_device, set_threads, share_cores,
)
from pagedtree.executor.worker import error_key, joined_key, spawned_worker
from pagedtree.loading.loader import resolve_model_path
from pagedtree.loading.resolve import resolve_device
from pagedtree.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedtree")

# How long shutdown waits for workers to leave before terminating them.
SHUTDOWN_WAIT_S = 10.0


class TensorParallelGroupHandle:
    """Rank 0's handle on the group (module docstring)."""

    def __init__(self, address: RankAddress, group: TensorParallelGroup,
                 processes: dict[int, mp.Process], previous_threads: int):
        self.address = address
        self.group = group
        self.channel = CommandChannel(group)
        self.processes = processes
        self.runners: list[ModelRunner] = []  # rank 0's sharded runners, in the workers' order
        self._previous_threads = previous_threads
        self._closed = False
        group.describe_failure = self.describe_failure

    @property
    def device(self) -> torch.device:
        """Rank 0's device."""
        return self.group.device

    # ------------------------------------------------------------- start
    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallelGroupHandle:
        """Start (or join) the group of ``config.tensor_parallel_size`` ranks as rank 0."""
        size = config.tensor_parallel_size
        check_splittable(config)
        address = env_address(size)
        spawn = address is None
        if address is None:
            addresses = local_addresses(size)
            address = addresses[0]
        elif address.rank != 0:
            raise ValueError(
                f"this process is RANK={address.rank}: the engine runs on rank 0; run `pagedtree worker` on the others"
            )
        device = rank_device(resolve_device(config.device), address)
        previous_threads = share_cores(address)
        processes: dict[int, mp.Process] = {}
        try:
            store = connect_store(address.host, address.port, 0, size, START_TIMEOUT, serve=address.serve_store)
            store.set("config", config.to_json())
            if spawn:
                context = mp.get_context("spawn")
                for worker_address in addresses[1:]:
                    process = context.Process(target=spawned_worker, daemon=True,
                                              args=(worker_address, logger.getEffectiveLevel()),
                                              name=f"pagedtree-rank{worker_address.rank}")
                    with _environment(SPAWN_ENVIRONMENT):
                        process.start()
                    processes[worker_address.rank] = process
            _wait_for_ranks(store, size, processes)
            group = TensorParallelGroup(store, 0, size, device, datetime.timedelta(seconds=config.distributed_timeout))
        except BaseException:
            _stop_processes(processes, wait=0.0)
            set_threads(previous_threads)
            raise
        logger.info("tensor parallelism: %d ranks (%s), rank 0 on %s", size,
                    "spawned here" if spawn else f"rendezvous at {address.host}:{address.port}", device)
        return cls(address, group, processes, previous_threads)

    # ------------------------------------------------------------ status
    def describe_failure(self) -> str:
        """What is known of the other ranks after a collective failed."""
        parts = []
        for rank, process in self.processes.items():
            process.join(timeout=1.0)
            if process.exitcode is None:
                parts.append(f"rank {rank} (pid {process.pid}) is alive but did not answer")
            elif process.exitcode < 0:
                parts.append(f"rank {rank} (pid {process.pid}) was killed by {signal.Signals(-process.exitcode).name}")
            else:
                parts.append(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
        for rank in range(1, self.group.size):
            try:
                if self.group.store.check([error_key(rank)]):
                    parts.append(f"rank {rank} reported {self.group.store.get(error_key(rank)).decode()}")
            except Exception:  # noqa: BLE001 - the store may be gone with its agent
                break
        return "; ".join(parts)

    def report(self) -> list[dict[str, object]]:
        """Every rank's counters (forward passes, block and slot copies, cache blocks,
        weight and cache bytes per sharded model; collectives' counts, bytes and time)."""
        self.channel.send(Op.REPORT)
        rows = self.group.gather_ints_to_first(report_values(self.runners, self.group))
        assert rows is not None
        return [{"rank": rank, **parse_report(row, len(self.runners))} for rank, row in enumerate(rows)]

    # ---------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Tell every rank to stop, wait for them, terminate the ones that hang. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.group.broken:
            try:
                self.channel.send(Op.SHUTDOWN)
            except TensorParallelError as exc:
                logger.warning("tensor-parallel shutdown: %s", exc)
        else:
            # The workers may sit in any collective: closing our sockets ends it for them.
            self.group.close()
        _stop_processes(self.processes, wait=SHUTDOWN_WAIT_S)
        self.group.close()
        self.group.mark_broken("the engine was shut down")
        set_threads(self._previous_threads)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` (unless already set) while a process starts; restored after."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def check_splittable(config: EngineConfig) -> None:
    """Raise ``ValueError`` before any rank starts when a model cannot be split
    ``tensor_parallel_size`` ways (its config is all it takes to know)."""
    models = [config.model] + (list(config.draft_model or ()) if config.draft_tensor_parallel_size > 1 else [])
    for model in models:
        model_config = AutoConfig.from_pretrained(str(resolve_model_path(model)))
        for rank in range(config.tensor_parallel_size):
            ShardLayout.for_rank(model_config, rank, config.tensor_parallel_size)


def _wait_for_ranks(store, size: int, processes: dict[int, mp.Process]) -> None:
    """Block until every rank has joined; a spawned rank that died first raises at once."""
    keys = [joined_key(rank) for rank in range(1, size)]
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, process in processes.items():
            if not process.is_alive():
                reason = store.get(error_key(rank)).decode() if store.check([error_key(rank)]) else "no error reported"
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode} before joining: {reason}"
                )
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TensorParallelError(f"ranks {missing} did not join within {START_TIMEOUT}")
        time.sleep(0.05)


def _stop_processes(processes: dict[int, mp.Process], wait: float) -> None:
    """Wait up to ``wait`` seconds for the processes to exit, then terminate, then kill."""
    deadline = time.monotonic() + wait
    for process in processes.values():
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes.values():
        if process.is_alive():
            process.terminate()
            process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
