"""Where a tensor-parallel rank is: its address in the group, its device, its threads.

Ranks find each other through torch.distributed's environment variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, and ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` as torchrun sets them), or, when the engine spawns its ranks
itself on one machine, through a free port on 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

logger = logging.getLogger("pagedtree")

# What ranks spawned on a machine shared with other ranks start with (see
# ``sleeping_thread_pools``).
SPAWN_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}
# Whether this process started with it (read when this module is first imported).
_PASSIVE_AT_START = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"

@dataclass(frozen=True, slots=True)
class RankAddress:
    """How one rank joins the group."""

    host: str
    port: int
    rank: int
    size: int
    local_rank: int = 0  # its index among the ranks on its machine (its GPU)
    local_size: int = 1  # ranks on its machine (they share its cores)
    serve_store: bool = False  # whether this process runs the rendezvous store (rank 0 unless torchrun's agent does)


def env_address(size: int, environ: Mapping[str, str] = os.environ) -> RankAddress | None:
    """This process's address from torch.distributed's environment, or None when
    ``WORLD_SIZE`` is not set; raises ``ValueError`` for an incomplete or
    inconsistent one."""
    if "WORLD_SIZE" not in environ:
        return None
    try:
        world, rank = int(environ["WORLD_SIZE"]), int(environ.get("RANK", "-1"))
        port = int(environ.get("MASTER_PORT", "-1"))
        local_rank = int(environ.get("LOCAL_RANK", "0"))
        local_size = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ValueError(f"torch.distributed environment: {exc}") from exc
    if world != size:
        raise ValueError(f"WORLD_SIZE={world} but tensor_parallel_size is {size}: they must be equal")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be set to a rank in [0, {world}) when WORLD_SIZE is set, got {rank}")
    if not 0 < port < 65536 or "MASTER_ADDR" not in environ:
        raise ValueError("MASTER_ADDR and MASTER_PORT must name rank 0's machine and a free port on it")
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return RankAddress(environ["MASTER_ADDR"], port, rank, world, local_rank, max(1, local_size),
                       serve_store=rank == 0 and not agent_store)


def local_addresses(size: int) -> list[RankAddress]:
    """Addresses of ``size`` ranks spawned on this machine (rank 0 serves the store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    first = RankAddress("127.0.0.1", port, 0, size, 0, size, serve_store=True)
    return [replace(first, rank=r, local_rank=r, serve_store=r == 0) for r in range(size)]


def rank_device(device: torch.device, address: RankAddress) -> torch.device:
    """The rank's device: its own GPU (by local rank) on CUDA."""
    if device.type != "cuda":
        return device
    if address.local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"rank {address.rank} is local rank {address.local_rank} but this machine has "
            f"{torch.cuda.device_count()} GPUs"
        )
    cuda = torch.device("cuda", address.local_rank)
    torch.cuda.set_device(cuda)
    return cuda


def share_cores(address: RankAddress) -> int:
    """Give this rank its share of the machine's cores (torch's and numba's threads);
    returns the torch thread count it had, to restore."""
    previous = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // address.local_size)
    if address.local_size > 1:
        sleeping_thread_pools()  # before set_threads: numba's set_num_threads starts its pool
    set_threads(threads)
    return previous


def sleeping_thread_pools() -> None:
    """Thread pools whose idle threads sleep, for ranks that share a machine's cores.

    libgomp's idle threads (numba's default pool) spin for a while after each
    parallel region; with two ranks on two cores the spinning took the core the
    other rank computes on (a two-rank SmolLM2 decode step: 237 ms spinning;
    benchmarks/RESULTS.md, "Tensor parallelism"). ``OMP_WAIT_POLICY=PASSIVE``
    makes them sleep, but libgomp reads it once, when it loads: so the ranks the
    engine spawns start with it (``SPAWN_ENVIRONMENT``) and keep numba's OpenMP
    pool, and a process that did not start with it (rank 0 inside an application)
    moves numba to its workqueue pool instead, if numba has not started a pool yet. (The workqueue pool costs about 0.1 ms a kernel launch
    here, against a few microseconds for OpenMP's; it takes kernels from one
    thread at a time, which is how the engine runs them.)
    """
    if _PASSIVE_AT_START:
        return  # this process started with it: its libgomp already sleeps
    try:
        import numba
        from numba.np.ufunc import parallel
    except ImportError:  # numba is optional
        return
    if not parallel._is_initialized:
        numba.config.THREADING_LAYER = "workqueue"
    elif numba.threading_layer() == "omp":
        logger.warning("numba's OpenMP pool already runs in this process; its idle threads spin and slow "
                       "the other ranks (start with OMP_WAIT_POLICY=PASSIVE, or start tensor parallelism "
                       "before running a model)")


def set_threads(threads: int) -> None:
    """torch's intra-op threads and numba's (the CPU kernels') to ``threads``."""
    torch.set_num_threads(threads)
    try:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    except ImportError:  # numba is optional
        pass
