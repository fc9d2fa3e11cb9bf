"""The life of tensor-parallel ranks 1..N-1: join, load their shards, follow rank 0.

A worker takes the engine's config from rank 0 (through the rendezvous store), so
``pagedtree worker`` on another machine needs no model flags. It then loads the
same models rank 0 loads, each rank its own shard, and runs rank 0's commands until
told to stop: every forward, block copy and slot copy on its own shard and cache.

A worker that fails writes its error to the store (rank 0 quotes it) and exits; a
worker whose rank 0 died or fell silent sees its sockets close and exits too.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys

from pagedtree.config import EngineConfig
from pagedtree.distributed.group import START_TIMEOUT, TensorParallelError, TensorParallelGroup, connect_store
from pagedtree.executor.commands import CommandChannel, Op, decode_step, report_values
from pagedtree.executor.ranks import RankAddress, rank_device, share_cores
from pagedtree.executor.shards import load_draft, load_draft_weights, load_target
from pagedtree.loading.resolve import resolve_config, resolve_device
from pagedtree.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedtree")


def joined_key(rank: int) -> str:
    """Set by a worker right before it joins the process groups."""
    return f"joined/{rank}"


def error_key(rank: int) -> str:
    """A worker's last words."""
    return f"error/{rank}"


def load_rank_models(config: EngineConfig, channel: CommandChannel) -> list[ModelRunner]:
    """This rank's shard of the target and of the sharded drafts, in the order rank 0 loads them."""
    resolved = resolve_config(config)
    device = channel.group.device
    drafts = []
    if resolved.parallel.draft_tensor_parallel_size > 1:  # sharded drafts: this rank holds a shard of each
        # In rank 0's order: the drafts' weights, then the target sized beside them.
        drafts = [load_draft_weights(dataclasses.replace(draft, device=device), channel)
                  for draft in resolved.drafts]
    target = load_target(dataclasses.replace(resolved.target, device=device), resolved.cache, resolved.scheduler,
                         resolved.max_model_len, resolved.speculative, channel, drafts)
    runners = [target.runner]
    for index, weights in enumerate(drafts):
        draft = load_draft(weights, index, resolved.cache, resolved.scheduler, resolved.max_tree_nodes,
                           target.num_blocks, target.max_model_len, channel)
        runners.append(draft.runner)
    return runners


def follow(channel: CommandChannel, runners: list[ModelRunner]) -> None:
    """Run rank 0's commands on this rank's shards until ``Op.SHUTDOWN``."""
    while True:
        command = channel.receive()
        if command.op == Op.SHUTDOWN:
            return
        if command.op == Op.REPORT:
            channel.group.gather_ints_to_first(report_values(runners, channel.group))
            continue
        runner = runners[command.model]
        if command.op == Op.FORWARD:
            runner.num_forward_passes += 1
            runner.run_step(decode_step(command.lists))
        elif command.op == Op.COPY_BLOCKS:
            runner.copy_blocks(*command.lists)
        elif command.op == Op.COPY_SLOTS:
            runner.copy_slots(*command.lists)


def run_worker(address: RankAddress) -> int:
    """Be rank ``address.rank`` until rank 0 says stop; the process's exit code."""
    share_cores(address)
    store = connect_store(address.host, address.port, address.rank, address.size, START_TIMEOUT,
                          serve=address.serve_store)
    try:
        config = EngineConfig.from_json(store.get("config").decode())
        device = rank_device(resolve_device(config.device), address)
        store.set(joined_key(address.rank), "1")
        group = TensorParallelGroup(store, address.rank, address.size, device,
                                    datetime.timedelta(seconds=config.distributed_timeout))
        channel = CommandChannel(group)
        runners = load_rank_models(config, channel)
        logger.info("rank %d of %d ready on %s", address.rank, address.size, device)
        follow(channel, runners)
        group.close()
        return 0
    except TensorParallelError as exc:  # rank 0 is gone or the group fell out of step
        logger.error("rank %d stops: %s", address.rank, exc)
        return 1
    except BaseException as exc:  # noqa: BLE001 - tell rank 0 why, then go
        logger.exception("rank %d failed", address.rank)
        try:
            store.set(error_key(address.rank), f"{type(exc).__name__}: {exc}"[:2000])
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass
        return 1


def spawned_worker(address: RankAddress, log_level: int = logging.WARNING) -> None:
    """Entry point of a rank the engine spawned (torch.multiprocessing, spawn); it logs
    at the level rank 0's ``pagedtree`` logger had."""
    logging.basicConfig(level=log_level, format=f"[rank {address.rank}] %(levelname)s %(name)s: %(message)s")
    exit_process(run_worker(address))


def exit_process(code: int) -> None:
    """Leave without the interpreter's teardown: process-group threads still winding
    down at teardown can abort it ("terminate called without an active exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
