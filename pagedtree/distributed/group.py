"""The ranks of a tensor-parallel engine and the collectives between them.

Everything goes through torch.distributed: a ``TCPStore`` for the rendezvous and
start-up messages, a gloo process group for the commands rank 0 sends (always CPU
tensors) and, on CPU, for the model's all-reduces and logit gathers; on CUDA those
go through an NCCL group. The groups are this engine's own (not torch's default
group), so several engines, or an application's own torch.distributed use, can live
in one process.

A collective that fails (a rank died: its sockets close, gloo fails at once) or that
waits past ``timeout`` (a rank hangs) raises ``TensorParallelError``, whose message
adds what is known of the other ranks (``describe_failure``); from then on every
call raises it again: the ranks are out of step and the engine cannot go on.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Workers wait this long for rank 0's next command (an idle engine sends none).
COMMAND_WAIT = datetime.timedelta(days=365)
# Start-up (joining, loading shards) may take long on big models; a rank that dies
# meanwhile is still noticed at once (its sockets close).
START_TIMEOUT = datetime.timedelta(minutes=30)
# The tag of the all-reduce's point-to-point messages (gloo matches them per peer, in order).
_SUM_TAG = 17
# Prefix of this engine's keys in a store it may share (torchrun's agent store).
STORE_PREFIX = "pagedtree"


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died, hung or fell out of step; the engine
    cannot continue (every later step raises it too)."""


@dataclass(slots=True)
class CommStats:
    """Time and traffic of one rank's model collectives (commands not counted)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    gathers: int = 0
    gather_bytes: int = 0
    seconds: float = 0.0  # host time waiting in them (meaningful on CPU, where they block)


def connect_store(host: str, port: int, rank: int, size: int, timeout: datetime.timedelta,
                  serve: bool) -> dist.Store:
    """This engine's view of the rendezvous store at ``host:port``; ``serve`` makes
    this process the store's server (rank 0 unless an agent such as torchrun runs it)."""
    store = dist.TCPStore(host, port, size, serve, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(STORE_PREFIX, store)


class TensorParallelGroup:
    """One rank's membership of the group: its rank, the store, the process groups."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device,
                 timeout: datetime.timedelta):
        self.store = store
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timeout
        self.stats = CommStats()
        self.describe_failure: Callable[[], str] = lambda: ""
        self._broken: TensorParallelError | None = None
        self._commands = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._compute = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
        else:
            self._compute = self._commands

    # ------------------------------------------------------------- errors
    def _fail(self, exc: BaseException, what: str) -> TensorParallelError:
        if self._broken is None:
            detail = self.describe_failure()
            message = f"tensor-parallel rank {self.rank} of {self.size}: {what} failed ({exc})"
            if detail:
                message += f"; {detail}"
            self._broken = TensorParallelError(message)
        return self._broken

    def _run(self, what: str, start: Callable[[], object]) -> None:
        if self._broken is not None:
            raise self._broken
        try:
            start().wait()  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError and DistBackendError
            raise self._fail(exc, what) from exc

    def mark_broken(self, reason: str) -> TensorParallelError:
        """Declare the group out of step (rank 0 after a step failed half-way)."""
        if self._broken is None:
            self._broken = TensorParallelError(f"tensor-parallel group out of step: {reason}")
        return self._broken

    @property
    def broken(self) -> bool:
        """Whether a collective has failed (nothing more can run)."""
        return self._broken is not None

    # -------------------------------------------------------- model collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (the row-parallel layers' partial sums).

        NCCL runs its all-reduce. Over gloo, every rank sends its tensor to every other
        and adds what it receives in rank order (so all ranks hold the same bits): one
        exchange of point-to-point messages, where gloo's ring all-reduce takes
        several rounds (0.6 ms against 1.5 ms an all-reduce inside a two-rank SmolLM2
        decode step on the 2-core machine; ``benchmarks/RESULTS.md``). The traffic is
        ``N - 1`` tensors a rank instead of the ring's ``2 (N - 1) / N``: right for the
        few ranks and small activations of CPU serving."""
        started = time.perf_counter()
        if self._compute is self._commands:
            self._exchange_sum(tensor)
        else:
            self._run("all-reduce", lambda: self._compute.allreduce([tensor], dist.AllreduceOptions()))
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += tensor.numel() * tensor.element_size()
        self.stats.seconds += time.perf_counter() - started
        return tensor

    def _exchange_sum(self, tensor: torch.Tensor) -> None:
        if self._broken is not None:
            raise self._broken
        mine = tensor.contiguous()
        parts: list[torch.Tensor] = []
        works = []
        try:
            for peer in range(self.size):
                if peer == self.rank:
                    parts.append(mine)
                    continue
                works.append(self._commands.send([mine], peer, _SUM_TAG))
                received = torch.empty_like(mine)
                works.append(self._commands.recv([received], peer, _SUM_TAG))
                parts.append(received)
            for work in works:
                work.wait()
        except Exception as exc:  # noqa: BLE001 - as in _run
            raise self._fail(exc, "all-reduce") from exc
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape on all) on rank 0, in rank order; None elsewhere."""
        started = time.perf_counter()
        tensor = tensor.contiguous()
        gathered = self._gather(self._compute, tensor, "logit gather")
        self.stats.gathers += 1
        self.stats.gather_bytes += tensor.numel() * tensor.element_size() * (self.size - 1)
        self.stats.seconds += time.perf_counter() - started
        return gathered

    def _gather(self, group: dist.ProcessGroup, tensor: torch.Tensor, what: str) -> list[torch.Tensor] | None:
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self._run(what, lambda: group.gather(outputs, [tensor], options))
        return outputs[0] if self.rank == 0 else None

    def all_reduce_ints(self, values: list[int], op: dist.ReduceOp = dist.ReduceOp.MIN,
                        timeout: datetime.timedelta | None = None) -> list[int]:
        """Reduce a few integers over the ranks on the CPU group (start-up agreements)."""
        tensor = torch.tensor(values, dtype=torch.long)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        if timeout is not None:
            options.timeout = timeout
        self._run("start-up agreement", lambda: self._commands.allreduce([tensor], options))
        return tensor.tolist()

    def gather_ints_to_first(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's integers (as many on each) on rank 0, over the CPU group (reports)."""
        gathered = self._gather(self._commands, torch.tensor(values, dtype=torch.long), "report gather")
        return [t.tolist() for t in gathered] if gathered is not None else None

    # ------------------------------------------------------------ commands
    def broadcast_command(self, tensor: torch.Tensor, wait: datetime.timedelta | None = None) -> None:
        """Broadcast an int64 CPU ``tensor`` from rank 0 (rank 0 sends, the others fill it)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        if wait is not None:
            options.timeout = wait
        self._run("command broadcast", lambda: self._commands.broadcast([tensor], options))

    def close(self) -> None:
        """Drop the process groups (their sockets close)."""
        for pg in {id(self._commands): self._commands, id(self._compute): self._compute}.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - closing a broken group may fail; nothing to do
                    pass
