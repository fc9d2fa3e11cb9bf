"""Launchers for the Triton kernels, with the host-side checks that make them safe.

Each function checks shapes, dtypes, devices and index ranges before it launches,
and raises ``ValueError`` naming what is wrong: a kernel cannot report a bad index,
it reads or writes someone else's memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedtree.devices import cuda_kind, same_device
from pagedtree.kernels import launch_overlap
from pagedtree.kernels import triton_kernels as K
from pagedtree.kernels.attention_plan import KernelPlan
from pagedtree.kernels.tiles import TileShape, choose_splits, choose_tile_shape, next_power_of_2
from pagedtree.uploads import upload

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


def check_device(device: torch.device) -> None:
    """Raise when the kernels cannot run on ``device`` in this process."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and K.INTERPRETED:
        return
    if device.type == "cpu":
        raise ValueError(
            "the Triton kernels need a CUDA device, or on CPU the Triton interpreter: "
            "set TRITON_INTERPRET=1 in the environment before pagedtree is imported "
            "(e.g. `TRITON_INTERPRET=1 python ...`), or use attention_backend='torch'"
        )
    raise ValueError(f"the Triton kernels do not run on {device.type} tensors")


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """A layer's cache pair must be ``[num_blocks, block_size, H_kv, D]``, alike, dim-contiguous."""
    if key_cache.dim() != 4:
        raise ValueError(f"KV cache must be [num_blocks, block_size, H_kv, D], got shape {list(key_cache.shape)}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must have the same shape and dtype")
    if not same_device(key_cache.device, value_cache.device):
        raise ValueError("key and value caches must be on the same device")
    if key_cache.dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype must be one of {_DTYPES}, got {key_cache.dtype}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV caches must be contiguous in the head dimension")


def _check_tokens(name: str, x: torch.Tensor, num_tokens: int, heads: int | None, head_dim: int, device) -> None:
    if x.dim() != 3 or x.shape[0] != num_tokens or x.shape[2] != head_dim or (heads is not None and x.shape[1] != heads):
        want = f"[{num_tokens}, {heads if heads is not None else 'H'}, {head_dim}]"
        raise ValueError(f"{name} must have shape {want}, got {list(x.shape)}")
    if not same_device(x.device, device):
        raise ValueError(f"{name} is on {x.device}, the KV cache on {device}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} dtype must be one of {_DTYPES}, got {x.dtype}")
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    slots_checked: bool = False,
) -> None:
    """Write ``key``/``value`` ``[T, H_kv, D]`` into cache slots ``slot_mapping`` (Triton).

    ``slots_checked`` skips the range check of the slots (one device sync) when the
    caller has already done it for the step, as :func:`build_kernel_plan` does.
    """
    check_cache(key_cache, value_cache)
    check_device(key_cache.device)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be a 1-D int32/int64 tensor")
    _check_tokens("key", key, num_tokens, num_kv_heads, head_dim, key_cache.device)
    _check_tokens("value", value, num_tokens, num_kv_heads, head_dim, key_cache.device)
    if not same_device(slot_mapping.device, key_cache.device):
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the KV cache on {key_cache.device}")
    if num_tokens == 0:
        return
    if not slots_checked:
        lo, hi = (int(x) for x in torch.aminmax(slot_mapping))
        if lo < 0 or hi >= num_blocks * block_size:
            raise ValueError(f"slot_mapping has slots outside [0, {num_blocks * block_size}): min {lo}, max {hi}")
    K._store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=max(2, next_power_of_2(num_kv_heads)), HEAD_DIM_P=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, MANUAL_BF16=K.INTERPRETED, **launch_overlap.launch_options(key_cache.device),
    )


def _device_kind(device: torch.device) -> tuple[int, int]:
    """``(SMs, compute capability)`` of ``device`` (an H100's for CPU and the interpreter)."""
    if device.type == "cuda" and not K.INTERPRETED:
        return cuda_kind(device)
    return 132, 90


def _num_sms(device: torch.device) -> int:
    return _device_kind(device)[0]


def default_tile_shape(plan: KernelPlan, num_heads: int, num_kv_heads: int, device: torch.device,
                       head_dim: int = 128, kv_elem_bytes: int = 2) -> TileShape:
    """The tile shape :func:`unified_attention` uses when none is given."""
    num_sms, capability = _device_kind(device)
    return choose_tile_shape(
        plan.max_query_len, num_heads // num_kv_heads, plan.num_requests, num_kv_heads,
        plan.max_context_len, interpreted=K.INTERPRETED, num_sms=num_sms, block_size=plan.block_size,
        capability=capability, head_dim=head_dim, kv_elem_bytes=kv_elem_bytes,
    )


def step_split_count(plan: KernelPlan, tile: TileShape, group: int, num_kv_heads: int, device: torch.device,
                     head_dim: int, kv_elem_bytes: int) -> torch.Tensor | None:
    """The device scalar of KV segments the kernel uses this step (None when the
    tile does not split). A static plan's grid has the split of its widest context
    (a CUDA graph freezes the grid); the step uses the split its real longest
    context calls for, at most the grid's. Static steps call this before a graph
    captures or replays, so the launches themselves upload nothing."""
    if tile.num_splits == 1:
        return None
    used = tile.num_splits
    if plan.real_max_context_len < plan.max_context_len:
        used = min(used, choose_splits(tile, plan.max_query_len, group, plan.num_requests, num_kv_heads,
                                       plan.real_max_context_len, _num_sms(device), head_dim, kv_elem_bytes))
    return plan.split_count(used)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: KernelPlan,
    scale: float,
    tile: TileShape | None = None,
    out: torch.Tensor | None = None,
    dot_fp32: bool | None = None,
    kv_loads: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[T, H, D]`` over the paged cache in one launch; ``[T, H, D]``.

    The new tokens' keys and values must already be stored. ``tile`` overrides the
    tile shape (tests use it to reach multi-tile and split-KV paths on small inputs).
    ``dot_fp32`` chooses the products: fp32 (``input_precision="ieee"``) or the
    inputs' own 16-bit ``tl.dot`` (tensor cores on a GPU). By default a GPU takes the
    16-bit path for 16-bit inputs and the interpreter takes fp32; tests force the
    16-bit path there. ``kv_loads`` (int32 ``[num_requests]``, zeroed), when given,
    counts the K/V tiles loaded per request (over heads, query tiles and splits).
    """
    check_cache(key_cache, value_cache)
    device = key_cache.device
    check_device(device)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if plan.block_size != block_size:
        raise ValueError(f"plan was built for block_size {plan.block_size}, the cache has {block_size}")
    if query.dim() != 3:
        raise ValueError(f"query must be [T, H, D], got shape {list(query.shape)}")
    num_heads = query.shape[1]
    _check_tokens("query", query, plan.num_tokens, None, head_dim, device)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if not same_device(plan.query_start.device, device):
        raise ValueError(f"plan is on {plan.query_start.device}, the KV cache on {device}")
    group = num_heads // num_kv_heads
    tile = tile or default_tile_shape(plan, num_heads, num_kv_heads, device, head_dim, key_cache.element_size())
    if tile.group_p != group and (tile.group_p < group or tile.group_p & (tile.group_p - 1)):
        raise ValueError(f"tile group_p {tile.group_p} must be {group} or a power of two above it")
    for name in ("block_q", "tile_n", "num_splits"):
        if getattr(tile, name) < 1:
            raise ValueError(f"tile {name} must be >= 1")
    if tile.tile_n & (tile.tile_n - 1) or tile.tile_n < 16:
        raise ValueError("tile tile_n must be a power of two >= 16")
    if tile.block_m < 16 and not K.INTERPRETED:
        raise ValueError(f"tile has {tile.block_m} rows; compiled tl.dot needs at least 16")
    if kv_loads is not None and (kv_loads.dtype != torch.int32 or kv_loads.shape != (plan.num_requests,)
                                 or not same_device(kv_loads.device, device)):
        raise ValueError(f"kv_loads must be an int32 [{plan.num_requests}] tensor on {device}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or not same_device(out.device, device) or out.stride(-1) != 1:
        raise ValueError("out must be like query")
    if plan.num_tokens == 0:
        return out
    tile_req, tile_q, num_tiles = plan.tiles(tile.block_q, tile.first_query())
    head_dim_p = max(16, next_power_of_2(head_dim))
    mixed = query.dtype == torch.float32 or query.dtype != key_cache.dtype
    if dot_fp32 is None:
        dot_fp32 = K.INTERPRETED or mixed
    elif not dot_fp32 and mixed:
        raise ValueError(f"16-bit products need 16-bit query and cache of one dtype, got {query.dtype} "
                         f"and {key_cache.dtype}")
    splits = tile.num_splits
    split_count = step_split_count(plan, tile, group, num_kv_heads, device, head_dim, key_cache.element_size())
    if split_count is None:
        split_count = tile_req  # never read: the kernel reads the count only when NUM_SPLITS > 1
    if splits > 1:
        # Reused by every layer of the step (launches are stream-ordered).
        part_acc = plan.buffers.scratch("part_acc" + plan.slot_tag, splits * plan.num_tokens * num_heads * head_dim_p)
        part_ml = plan.buffers.scratch("part_ml" + plan.slot_tag, splits * plan.num_tokens * num_heads * 2)
    else:  # never touched: the kernel writes partials only when NUM_SPLITS > 1
        part_acc = part_ml = out
    overlap = launch_overlap.launch_options(device)
    K._unified_attention_kernel[(num_tiles, num_kv_heads, splits)](
        out, query, key_cache, value_cache,
        plan.block_tables, plan.query_start, plan.context_lens, plan.is_tree, plan.tree_mask,
        tile_req, tile_q, part_acc, part_ml, kv_loads if kv_loads is not None else tile_req, split_count,
        scale * _LOG2E, plan.num_tokens, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        plan.block_tables.stride(0), plan.tree_words,
        GROUP=group, GROUP_P=tile.group_p, BLOCK_Q=tile.block_q, BLOCK_M=tile.block_m,
        ROOT_SIDE=tile.root_side, ROOT_M=tile.root_m,
        HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
        TILE_N=tile.tile_n, NUM_SPLITS=splits, DOT_FP32=dot_fp32, MANUAL_BF16=K.INTERPRETED,
        COUNT_LOADS=kv_loads is not None, **({"num_warps": tile.num_warps} if tile.num_warps else {}),
        **({"num_stages": tile.num_stages} if tile.num_stages else {}),
        **({"maxnreg": tile.max_registers} if tile.max_registers else {}), **overlap,
    )
    if splits > 1:
        K._reduce_splits_kernel[(plan.num_tokens, num_heads)](
            out, part_acc, part_ml, split_count, plan.num_tokens, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=splits, SPLITS_P=next_power_of_2(splits),
            MANUAL_BF16=K.INTERPRETED, **overlap,
        )
    return out


_TL_DTYPES = {torch.float16: K.tl.float16, torch.bfloat16: K.tl.bfloat16, torch.float32: K.tl.float32}


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 base addresses of ``tensors`` on ``device``, for :func:`copy_rows`."""
    return upload([t.data_ptr() for t in tensors], torch.int64, device)


def check_copy(rows_per_tensor: int, src: Sequence[int], dst: Sequence[int]) -> None:
    """Refuse a row copy ``src[i] -> dst[i]`` whose indices leave ``[0, rows_per_tensor)``
    or repeat a destination (the result would be undefined)."""
    if len(src) != len(dst):
        raise ValueError(f"src and dst must have the same length, got {len(src)} and {len(dst)}")
    if not src:
        return
    for name, idx in (("src", src), ("dst", dst)):
        if min(idx) < 0 or max(idx) >= rows_per_tensor:
            raise ValueError(f"{name} has indices outside [0, {rows_per_tensor}): {list(idx)}")
    if len(set(dst)) != len(dst):
        raise ValueError(f"dst has repeated indices (the result would be undefined): {list(dst)}")


def copy_rows(
    tensors: Sequence[torch.Tensor],
    table: torch.Tensor,
    rows_per_tensor: int,
    row_elems: int,
    src: Sequence[int],
    dst: Sequence[int],
) -> None:
    """Copy rows ``src[i] -> dst[i]`` of ``row_elems`` elements in every tensor, reading first.

    ``tensors`` are contiguous, of one dtype, each viewed as ``[rows_per_tensor,
    row_elems]``, and ``table`` is their :func:`pointer_table`. As in the torch
    reference, every source is read before any destination is written; when a
    destination is also a source (an accepted tree path sliding onto rejected slots)
    the rows go through a scratch buffer in two launches, else one launch copies.
    """
    check_copy(rows_per_tensor, src, dst)
    if not src:
        return
    first = tensors[0]
    device = first.device
    check_device(device)
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or not same_device(t.device, device)
                or t.numel() != rows_per_tensor * row_elems):
            raise ValueError("copy_rows needs contiguous tensors of one dtype, device and size")
    n = len(src)
    src_t = upload(src, torch.int64, device)
    dst_t = upload(dst, torch.int64, device)
    if set(src).isdisjoint(dst):
        copy_rows_on_device(tensors, table, row_elems, src_t, dst_t)
        return
    dtype = _TL_DTYPES[first.dtype]
    block_e = min(1024, next_power_of_2(row_elems))
    grid = (n, len(tensors), math.ceil(row_elems / block_e))
    scratch = torch.empty(len(tensors), n, row_elems, dtype=first.dtype, device=device)
    scratch_table = pointer_table(list(scratch), device)
    order = torch.arange(n, dtype=torch.int64, device=device)
    # Two launches on one stream: the gather finishes before the scatter starts.
    K._copy_rows_kernel[grid](table, scratch_table, src_t, order, row_elems, DTYPE=dtype, BLOCK_E=block_e)
    K._copy_rows_kernel[grid](scratch_table, table, order, dst_t, row_elems, DTYPE=dtype, BLOCK_E=block_e)


def copy_rows_on_device(tensors: Sequence[torch.Tensor], table: torch.Tensor, row_elems: int,
                        src: torch.Tensor, dst: torch.Tensor) -> None:
    """``copy_rows`` for indices already on the device (int64 ``[n]``), sources and
    destinations disjoint and checked by the caller (``check_copy``): one launch of
    fixed shape, nothing read or uploaded (a CUDA graph can hold it)."""
    if src.numel() == 0:
        return
    dtype = _TL_DTYPES[tensors[0].dtype]
    block_e = min(1024, next_power_of_2(row_elems))
    grid = (src.numel(), len(tensors), math.ceil(row_elems / block_e))
    K._copy_rows_kernel[grid](table, table, src, dst, row_elems, DTYPE=dtype, BLOCK_E=block_e)
