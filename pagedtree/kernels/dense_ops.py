"""Launchers for the batch-invariant dense kernels (``dense_kernels``), with their checks.

``MatmulConfig`` fixes, per layer and from the layer's shape alone, everything a
row's arithmetic depends on: the tile, the K-group width and the instruction (the
dtype's ``tl.dot``). The launch then only chooses how the work is spread (one program
per output tile walking every K-group, or one program per tile and K-group with the
groups added in order by the tile's last program), which never changes a bit: a
token's result is the same in a batch of 1 and of 2,080 rows.

Each launcher checks shapes, dtypes and devices and raises ``ValueError`` naming what
is wrong before anything is launched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedtree.devices import cuda_kind, same_device
from pagedtree.kernels import dense_kernels as D
from pagedtree.kernels import launch_overlap
from pagedtree.kernels.tiles import next_power_of_2
from pagedtree.kernels.triton_kernels import INTERPRETED

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Output tile and K step of every product: 64 rows (one Hopper warpgroup MMA, and a
# tensor-core tile on any GPU), 64 columns (the gated MLP keeps two accumulators
# pairs in registers without spilling), 64 input features. A q/k/v projection that
# rotates in its epilogue takes one head a column tile instead (up to ROTARY_MAX_N
# columns: at 128, one accumulator pair, the gated layer's register count).
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64
ROTARY_MAX_N = 128
# A small batch spreads its K-groups over programs while the tiles alone would not
# fill twice the GPU's SMs, up to this many rows: each group's fp32 sums go through
# memory, ``2 * rows / GROUP_K`` of the weights' bytes, cheap at decode sizes.
SPLIT_MAX_ROWS = 256
# One arrival counter per output tile of a split launch, reset by the launch itself.
COUNTER_SLOTS = 1 << 16
# A split tile's last program adds the groups' sums for this many rows at a time
# (of BLOCK_N columns; fewer rows in wider tiles, ``reduce_rows``; divides BLOCK_M;
# 8 rows x 64 columns is one 16-byte load a thread a group, so
# ptxas issues a decode's 12-20 group loads before the first add: one L2 round trip,
# where one a group cost 12 in sequence), this many groups per unrolled pass (fewer
# for a gated layer, which loads two sums a group). The launch's speed only: the
# adds are the same, in group order, whatever the chunk.
REDUCE_M = 8
REDUCE_UNROLL = 16
REDUCE_UNROLL_GATED = 8
# Under overlapping launches a split program prefetches up to this many bytes of its
# weight slice into L2 before it waits for the kernel before it (a wave of programs'
# prefetches, about 13-26 MB, stays well inside an H100's 50 MB of L2).
PREFETCH_BYTES = 32 << 10


@dataclass(frozen=True, slots=True)
class MatmulConfig:
    """A layer's fixed product shape: ``n_out`` outputs (each half of a gated
    layer's), ``k`` inputs, summed in ``num_groups`` K-groups of ``group_k``."""

    n_out: int
    k: int
    group_k: int
    num_groups: int
    gated: bool
    num_warps: int = 4
    num_stages: int = 4
    block_n: int = BLOCK_N  # columns of an output tile (a head's width for a rotating q/k/v product)

    @property
    def tiles_n(self) -> int:
        """Column tiles of the output."""
        return -(-self.n_out // self.block_n)


@dataclass(frozen=True, slots=True)
class RotaryEpilogue:
    """What a q/k/v product's epilogue needs to do the rotary kernel's work
    (``rotary_store``): each row's position, the ``[cos | sin]`` table, the heads and,
    to store keys and values, each row's cache slot (range-checked by the caller,
    once a step) and the layer's caches."""

    positions: torch.Tensor  # [T] int32/int64
    cos_sin: torch.Tensor  # [P, 2 * head_dim], the model's dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    slot_mapping: torch.Tensor | None = None  # [T]; None: rotate only
    key_cache: torch.Tensor | None = None  # [blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor | None = None

    @property
    def stores(self) -> bool:
        """Whether the keys and values go to the caches."""
        return self.key_cache is not None


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H100's 132 for CPU tensors, which
    stand in for one under the interpreter)."""
    return device_kind(device)[0]


def device_kind(device: torch.device) -> tuple[int, int]:
    """``(SMs, compute capability)`` of ``device``, e.g. ``(132, 90)`` for an H100 (and
    for CPU tensors, which stand in for one under the interpreter)."""
    if device.type == "cuda" and not INTERPRETED:
        return cuda_kind(device)
    return 132, 90


def matmul_config(n_out: int, k: int, gated: bool, dtype: torch.dtype, num_sms: int,
                  capability: int = 90, block_n: int = BLOCK_N) -> MatmulConfig:
    """The product shape of a layer of ``n_out`` outputs (per half when ``gated``) over
    ``k`` inputs on a GPU of ``num_sms`` SMs and compute ``capability``: K-groups as
    wide as possible while a one-row product still has about two programs per SM
    (tiles x groups), so a decode streams the weights from every SM (at least
    ``2 * num_sms`` programs where the K steps allow). ``block_n``: columns a tile
    (a power of two from 16 to ``ROTARY_MAX_N``; a rotating q/k/v product's head
    dim). Depends on the layer and the GPU only."""
    if n_out < 1 or k < 1:
        raise ValueError(f"a product needs n_out >= 1 and k >= 1, got {n_out} and {k}")
    if block_n & (block_n - 1) or not 16 <= block_n <= ROTARY_MAX_N or (gated and block_n > BLOCK_N):
        raise ValueError(f"a tile of {block_n} columns{' (gated)' if gated else ''}: expected a power of two from "
                         f"16 to {BLOCK_N if gated else ROTARY_MAX_N}")
    tiles_n = -(-n_out // block_n)
    steps = -(-k // BLOCK_K)
    wanted = min(steps, max(1, -(-2 * num_sms // tiles_n)))
    steps_per_group = max(1, steps // wanted)
    fp32 = dtype == torch.float32
    # fp32 operands (no tensor-core dot: the products live in registers) spread over 8
    # warps, and so do a gated layer's two accumulator pairs before sm_90 (4 warps
    # spill there); Hopper's warpgroup MMA keeps them in 4 warps, which stream 1.2x
    # faster at one row (measured on an H100: 27.7 against 33.1 us for the 1.5B's
    # gate/up). A 128-column tile takes 8 warps wherever products use mma.sync
    # (sm_80, sm_89, sm_120: 4 warps spill its epilogue there; ``dense_compile``).
    wide = fp32 or (gated and capability < 90) or (block_n > BLOCK_N and not 90 <= capability < 120)
    return MatmulConfig(n_out=n_out, k=k, group_k=steps_per_group * BLOCK_K,
                        num_groups=-(-steps // steps_per_group), gated=gated,
                        num_warps=8 if wide else 4, num_stages=2 if wide else 4, block_n=block_n)


def rotates_in_epilogue(head_dim: int) -> bool:
    """Whether a q/k/v product of heads of ``head_dim`` can rotate (and store) in its
    epilogue: one head a column tile, a power of two the tile allows."""
    return not head_dim & (head_dim - 1) and 16 <= head_dim <= ROTARY_MAX_N


def qkv_config(num_heads: int, num_kv_heads: int, head_dim: int, k: int, dtype: torch.dtype, num_sms: int,
               capability: int = 90) -> MatmulConfig:
    """The q/k/v projection's product shape: one head a column tile where the epilogue
    can rotate (``rotates_in_epilogue``), else the usual tiles."""
    n_out = (num_heads + 2 * num_kv_heads) * head_dim
    block_n = head_dim if rotates_in_epilogue(head_dim) else BLOCK_N
    return matmul_config(n_out, k, False, dtype, num_sms, capability, block_n)


def _counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters (zeros between launches; each split launch puts
    its own back to zero). Launches on one stream run one after another, so every
    launch may use the same counters."""
    key = (device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return counters


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def check_kernel_device(device: torch.device) -> None:
    """Raise when the dense kernels cannot run on ``device`` in this process."""
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        return
    raise ValueError(f"the dense Triton kernels need a CUDA device or, on CPU, the Triton interpreter "
                     f"(TRITON_INTERPRET=1 before pagedtree is imported); got {device}")


def uses_split(rows: int, config: MatmulConfig, num_sms: int) -> bool:
    """Whether a product of ``rows`` rows spreads its K-groups over programs (the
    same bits either way; only the speed differs)."""
    tiles = -(-rows // BLOCK_M) * config.tiles_n
    return config.num_groups > 1 and rows <= SPLIT_MAX_ROWS and tiles < 2 * num_sms and tiles <= COUNTER_SLOTS


def reduce_unroll(num_groups: int, gated: bool) -> int:
    """Groups whose sums a split tile's last program loads together."""
    return max(1, min(num_groups, REDUCE_UNROLL_GATED if gated else REDUCE_UNROLL))


def reduce_rows(block_n: int) -> int:
    """Rows a split tile's last program adds at a time in tiles of ``block_n`` columns
    (``REDUCE_M`` at ``BLOCK_N``: the same elements a thread a load in wider tiles)."""
    return max(1, REDUCE_M * BLOCK_N // block_n)


def prefetch_steps(config: MatmulConfig, element_size: int) -> int:
    """K steps of weights a split program prefetches while it waits to start."""
    step_bytes = config.block_n * BLOCK_K * element_size * (2 if config.gated else 1)
    return max(1, min(config.group_k // BLOCK_K, PREFETCH_BYTES // step_bytes))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: MatmulConfig,
                     split: bool | None = None, rotary: RotaryEpilogue | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``gated``: ``SiLU(x @ gate.T) * (x @ up.T)`` with ``weight``
    the gate rows then the up rows) over ``x [..., k]``, with every row's bits
    independent of the rows beside it. ``split`` forces the launch mode (tests);
    None chooses by the row count. ``rotary`` (a q/k/v projection whose config takes
    one head a column tile, ``qkv_config``): the output's query and key heads come
    out rotated and, with caches, keys and values are stored, the bits
    ``rotary_store`` gives on the plain product's output."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or weight.shape[1] != config.k:
        raise ValueError(f"input [..., {x.shape[-1]}] and weight {list(weight.shape)} do not fit a product over "
                         f"{config.k} inputs")
    halves = 2 if config.gated else 1
    if weight.shape[0] != halves * config.n_out:
        raise ValueError(f"weight has {weight.shape[0]} rows, the layer {halves} x {config.n_out}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"input and weight must share one of {_DTYPES}, got {x.dtype} and {weight.dtype}")
    if not same_device(x.device, weight.device):
        raise ValueError(f"input is on {x.device}, the weight on {weight.device}")
    check_kernel_device(x.device)
    if weight.stride(1) != 1:
        raise ValueError("the weight must be contiguous in its input dimension")
    if bias is not None and (bias.shape != (halves * config.n_out,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{halves * config.n_out}] vector, got {list(bias.shape)}")
    rows = x.reshape(-1, config.k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if rotary is not None:
        if config.gated or config.block_n != rotary.head_dim or \
                config.n_out != (rotary.num_heads + 2 * rotary.num_kv_heads) * rotary.head_dim:
            raise ValueError(f"a rotating product needs a q/k/v config of {rotary.num_heads}/{rotary.num_kv_heads} "
                             f"heads of {rotary.head_dim} columns a tile (qkv_config); got {config.n_out} outputs in "
                             f"tiles of {config.block_n}{', gated' if config.gated else ''}")
        check_rotary(rotary, m, x.dtype, x.device)
    out = torch.empty(m, config.n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], config.n_out)
    num_sms = device_sms(x.device)
    if split is None:
        split = uses_split(m, config, num_sms)
    tiles = -(-m // BLOCK_M) * config.tiles_n
    if split and tiles > COUNTER_SLOTS:
        raise ValueError(f"a split product of {tiles} tiles exceeds the {COUNTER_SLOTS} arrival counters")
    parts = (torch.empty(config.num_groups, halves, m, config.n_out, dtype=torch.float32, device=x.device)
             if split else out)
    counters = _counters(x.device) if split else out
    overlap = launch_overlap.launch_options(x.device)
    D._invariant_matmul_kernel[(tiles, config.num_groups if split else 1)](
        rows, weight, bias if bias is not None else out, out, parts, counters,
        m, config.k, config.n_out, rows.stride(0), weight.stride(0), out.stride(0),
        *epilogue_args(rotary, out),
        NUM_GROUPS=config.num_groups, GROUP_K=config.group_k,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=BLOCK_K,
        REDUCE_M=reduce_rows(config.block_n), REDUCE_UNROLL=reduce_unroll(config.num_groups, config.gated),
        SPLIT=split, GATED=config.gated, HAS_BIAS=bias is not None,
        DOT_FP32=INTERPRETED or x.dtype == torch.float32, ROW_EXACT_DOT=INTERPRETED, MANUAL_BF16=INTERPRETED,
        PREFETCH_STEPS=prefetch_steps(config, x.element_size()) if split and overlap["PDL"] else 0,
        num_warps=config.num_warps, num_stages=config.num_stages, **overlap, **epilogue_options(rotary),
    )
    return out.view(*x.shape[:-1], config.n_out)


def epilogue_args(rotary: RotaryEpilogue | None, out: torch.Tensor) -> tuple:
    """The product kernel's rotary arguments (positions, table, slots, caches, their
    sizes and strides); stand-ins the kernel never reads without ``rotary``."""
    if rotary is None:
        return (out, out, out, out, out, 0, 0, 0, 0, 0)
    cache = rotary.key_cache
    slots = rotary.slot_mapping if rotary.stores else rotary.positions
    return (rotary.positions, rotary.cos_sin, slots, cache if cache is not None else out,
            rotary.value_cache if cache is not None else out, rotary.cos_sin.shape[0], rotary.cos_sin.stride(0),
            *((cache.stride(0), cache.stride(1), cache.stride(2)) if cache is not None else (0, 0, 0)))


def epilogue_options(rotary: RotaryEpilogue | None) -> dict:
    """The product kernel's rotary switches (none without ``rotary``: its defaults)."""
    if rotary is None:
        return {}
    return dict(ROTARY=True, STORE=rotary.stores, NUM_HEADS=rotary.num_heads, NUM_KV_HEADS=rotary.num_kv_heads,
                CACHE_BLOCK=rotary.key_cache.shape[1] if rotary.stores else 1)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * rmsnorm(x)`` per row of ``x [T, n]``; with ``residual`` (``[T, n]``,
    updated in place to ``residual + x``) the norm of that sum. One program a row."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm takes x [T, n] and weight [n], got {list(x.shape)} and {list(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of {_DTYPES}, got {x.dtype} and {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.stride(-1) != 1 or not same_device(residual.device, x.device)):
        raise ValueError(f"residual must be a {list(x.shape)} {x.dtype} tensor beside x, contiguous in its rows")
    check_kernel_device(x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    t, n = x.shape
    if t == 0:
        return out
    block = next_power_of_2(n)
    D._add_rms_norm_kernel[(t,)](
        x, residual if residual is not None else x, weight, out, n, float(eps),
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_N=block, MANUAL_BF16=INTERPRETED,
        num_warps=min(16, max(4, block // 512)), **launch_overlap.launch_options(x.device),
    )
    return out


def check_rotary(rotary: RotaryEpilogue, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse rotary work on ``tokens`` rows of ``dtype`` on ``device`` that the
    kernels cannot do or that would read or write outside its tensors."""
    head_dim = rotary.head_dim
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the fused rotary kernel needs a power-of-two head dim >= 16, got {head_dim}")
    if rotary.num_heads < 1 or rotary.num_kv_heads < 1:
        raise ValueError(f"rotary needs >= 1 query and KV head, got {rotary.num_heads} and {rotary.num_kv_heads}")
    positions, cos_sin = rotary.positions, rotary.cos_sin
    if positions.shape != (tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be [{tokens}] int32/int64, got {list(positions.shape)} {positions.dtype}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != 2 * head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"cos_sin must be [P, {2 * head_dim}], got {list(cos_sin.shape)}")
    if dtype not in _DTYPES:
        raise ValueError(f"qkv dtype must be one of {_DTYPES}, got {dtype}")
    key_cache, value_cache, slot_mapping = rotary.key_cache, rotary.value_cache, rotary.slot_mapping
    if key_cache is not None or value_cache is not None or slot_mapping is not None:
        if key_cache is None or value_cache is None or slot_mapping is None or slot_mapping.shape != (tokens,):
            raise ValueError("storing needs both caches and a slot per token")
        if slot_mapping.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
        if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or \
                key_cache.shape[2:] != (rotary.num_kv_heads, head_dim):
            raise ValueError(f"caches must be [blocks, block_size, {rotary.num_kv_heads}, {head_dim}] alike")
        if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
            raise ValueError("the key and value caches must share strides, contiguous in the head dim")
    for name, tensor in (("positions", positions), ("cos_sin", cos_sin), ("slot_mapping", slot_mapping),
                         ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor is not None and not same_device(tensor.device, device):
            raise ValueError(f"{name} is on {tensor.device}, qkv on {device}")


def rotary_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, slot_mapping: torch.Tensor | None = None,
                 key_cache: torch.Tensor | None = None, value_cache: torch.Tensor | None = None) -> None:
    """Rotate the query and key heads of ``qkv [T, (H + 2 H_kv) * D]`` in place by the
    rows ``positions`` of ``cos_sin [P, 2 D]`` (cos then sin, the model's dtype); with
    caches, write each token's rotated keys and its values to ``slot_mapping[t]``
    (slots range-checked by the caller, once a step). A q/k/v product can do the same
    in its epilogue (``invariant_linear``'s ``rotary``) without this launch."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] contiguous in its rows, got {list(qkv.shape)}")
    rotary = RotaryEpilogue(positions, cos_sin, num_heads, num_kv_heads, head_dim, slot_mapping, key_cache,
                            value_cache)
    t = qkv.shape[0]
    check_rotary(rotary, t, qkv.dtype, qkv.device)
    check_kernel_device(qkv.device)
    if t == 0:
        return
    store = rotary.stores
    D._rotary_store_kernel[(t,)](
        qkv, positions, cos_sin, slot_mapping if store else positions,
        key_cache if store else qkv, value_cache if store else qkv,
        cos_sin.shape[0], qkv.stride(0), cos_sin.stride(0),
        key_cache.stride(0) if store else 0, key_cache.stride(1) if store else 0,
        key_cache.stride(2) if store else 0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=max(2, next_power_of_2(num_heads)), KV_HEADS_P=max(2, next_power_of_2(num_kv_heads)),
        BLOCK_SIZE=key_cache.shape[1] if store else 1, STORE=store, MANUAL_BF16=INTERPRETED,
        num_warps=4, **launch_overlap.launch_options(qkv.device),
    )
