"""Per-step plan for the Triton paged attention kernels (host side, no Triton needed).

A step's metadata (query offsets, context lengths, block tables, token-tree masks)
is validated on the host and packed into one int32 tensor that is copied to the
device in a single transfer into a reused buffer; every layer's kernel launch reads
the same views. The query-tile map (which request and which query offset each
program handles) depends on the query heads per KV head, which the backend only
learns at the first layer's call, so it is built then and cached for the step.

Tree masks are ancestor bitmasks: token ``j`` of a tree request owns
``tree_words`` int32 words whose bit ``k`` is set when node ``k`` is ``j`` or one of
its ancestors. Any tree size works (``tree_words = ceil(T / 32)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedtree.uploads import StagedUpload

if TYPE_CHECKING:  # kernels read the metadata; they never import the layers above
    from pagedtree.step_data import AttentionMetadata


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@dataclass(slots=True, frozen=True)
class TileShape:
    """How one launch cuts the work: one program per (query tile, KV head, KV split)."""

    block_q: int  # query tokens of one request per program
    group_p: int  # query heads per KV head, padded to a power of two
    tile_n: int  # keys per inner-loop iteration (== block size: one cache block per tile)
    num_splits: int  # KV segments per query tile (split-KV); > 1 adds a reduce kernel
    num_warps: int | None = None  # None: Triton's default

    @property
    def block_m(self) -> int:
        """Rows of the query tile: tokens x heads of the group."""
        return self.block_q * self.group_p


# Rows of a query tile on a GPU. Decodes and token trees (query runs of at most
# MAX_TREE_QUERY tokens) take up to MAX_ROWS rows of one request and KV head per
# program, so a 64-node tree at 4 query heads per KV head reads its KV prefix once;
# the rows are spread over the warps (16 rows each), which keeps the fp32
# accumulator at 64 registers per thread at head dim 128. On sm_80 at head dim 128
# (mma.sync keeps operands in registers) 256 rows spill, so there tiles stop at
# 128. Longer runs (prefill chunks) take PREFILL_ROWS-row tiles, many programs,
# which a compute-bound prefill needs. Figures: `python -m
# pagedtree.kernels.cuda_compile`.
MAX_ROWS = 256
MAX_ROWS_SM80_D128 = 128
PREFILL_ROWS = 64
MAX_TREE_QUERY = 64
# Keys per tile on a GPU: 16, so a tile never crosses a cache block of 16, 32, ...
# keys (one block id per tile) and its scores and mask stay small in registers.
GPU_TILE_N = 16
# Warps per tile: 16 rows each, at least 4 (so sm_90's warpgroup MMA applies).
MIN_WARPS = 4


# Split-KV: how many key segments a query tile may be cut into, and what the extra
# reduce launch costs, as the bytes the GPU could have moved meanwhile (3 us at
# the 3.35 TB/s of an H100, the launch cost benchmarks/roofline.py assumes).
SPLIT_CHOICES = (1, 2, 4, 8, 16)
MIN_SPLIT_KEYS = 256  # keys per segment at least: shorter ones are mostly prologue and epilogue
REDUCE_LAUNCH_BYTES = 10_000_000


def split_kv_cost(num_splits: int, programs: int, kv_bytes: int, partial_bytes: int, num_sms: int) -> float:
    """Relative time of a launch cut into ``num_splits`` key segments, in bytes moved
    at full bandwidth: the keys and values (``kv_bytes``, read once whatever the
    split), plus with a split the fp32 partials of every query row written and read
    back (``partial_bytes`` per segment) and the reduce launch, all over the share of
    SMs the ``programs x num_splits`` programs keep busy (one program cannot
    saturate HBM: an SM without a program leaves its share of bandwidth unused).

    A decode's partials are small next to its KV (one row per head), so a small
    batch of long contexts splits; a tree's are ``T`` rows per head and can cost more
    than the idle SMs they would fill, so a mid-sized batch of trees does not.
    """
    busy = min(1.0, programs * num_splits / num_sms)
    moved = kv_bytes + (num_splits * partial_bytes if num_splits > 1 else 0)
    return moved / busy + (REDUCE_LAUNCH_BYTES if num_splits > 1 else 0)


def choose_tile_shape(
    max_query_len: int,
    group: int,
    num_requests: int,
    num_kv_heads: int,
    max_context_len: int,
    interpreted: bool,
    num_sms: int = 132,
    block_size: int = 16,
    capability: int = 90,
    head_dim: int = 128,
    kv_elem_bytes: int = 2,
) -> TileShape:
    """A tile shape for the step, from a table of rules (no autotuning: the
    interpreter has none, and the shapes must be known to compile them ahead).

    On a GPU, ``tl.dot`` needs at least 16 rows, so short query runs (decodes, small
    trees) are padded with query-head rows rather than shrunk. In a step whose query
    runs are at most ``MAX_TREE_QUERY`` tokens (decodes, token trees), a program
    takes up to ``MAX_ROWS`` rows (tokens x query heads of one KV head) of one
    request: a tree of up to 64 nodes at 4 query heads per KV head (32 at 8) reads
    its KV prefix once, as a decode does; a bigger one once per ``MAX_ROWS`` rows.
    Steps with longer runs (prefill chunks, and the trees that share a launch with
    them) take tiles of ``PREFILL_ROWS`` rows, many programs. Key tiles of
    ``GPU_TILE_N`` keys lie inside one cache block when the block size is a multiple
    of it (one block id per tile, regular loads); other block sizes gather keys one
    by one. Split-KV (flash-decoding) is used where :func:`split_kv_cost` says it
    pays: when the step has too few programs to fill the GPU and the partials it
    writes and reads back cost less than the idle SMs. In the interpreter, cost is
    per executed op, so bigger tiles and fewer programs are faster. ``capability``
    (80 = sm_80) and ``head_dim`` decide what fits in registers.
    """
    group_p = next_power_of_2(group)
    q = next_power_of_2(max(1, max_query_len))
    if interpreted:
        block_q = max(1, min(q, 128 // group_p))
        return TileShape(block_q=block_q, group_p=group_p, tile_n=64, num_splits=1)
    tile_n = GPU_TILE_N if block_size % GPU_TILE_N == 0 else 32
    max_rows = MAX_ROWS_SM80_D128 if capability < 90 and next_power_of_2(head_dim) >= 128 else MAX_ROWS
    if q <= MAX_TREE_QUERY:
        block_q = max(1, 16 // group_p, min(q, max_rows // group_p))  # >= 16 rows for tl.dot
    else:
        block_q = max(1, max(PREFILL_ROWS, group_p) // group_p)
    num_warps = max(MIN_WARPS, block_q * group_p // 16)
    num_tiles = num_requests * max(1, cdiv(max(1, max_query_len), block_q))
    programs = num_tiles * num_kv_heads
    kv_bytes = programs * max_context_len * head_dim * 2 * kv_elem_bytes  # K and V, read once per program
    partial_bytes = num_requests * max(1, max_query_len) * group * num_kv_heads * (next_power_of_2(head_dim) + 2) * 8
    choices = [s for s in SPLIT_CHOICES if s == 1 or s * MIN_SPLIT_KEYS <= max_context_len]
    num_splits = min(choices, key=lambda s: split_kv_cost(s, programs, kv_bytes, partial_bytes, num_sms))
    return TileShape(block_q=block_q, group_p=group_p, tile_n=tile_n, num_splits=num_splits, num_warps=num_warps)


def tree_ancestor_words(parents: Sequence[int], num_words: int) -> list[list[int]]:
    """Per node, ``num_words`` int32 words of its ancestor bitmask (self included)."""
    masks: list[int] = []
    for j, p in enumerate(parents):
        if p >= j or p < -1:
            raise ValueError(f"tree node {j} has parent {p}: parents must precede children")
        masks.append((masks[p] if p >= 0 else 0) | (1 << j))
    rows = []
    for m in masks:
        words = []
        for w in range(num_words):
            v = (m >> (32 * w)) & 0xFFFFFFFF
            words.append(v - (1 << 32) if v >= 1 << 31 else v)  # as signed int32
        rows.append(words)
    return rows


@dataclass(slots=True)
class KernelPlan:
    """Device-side metadata of one step, shared by every layer's launches."""

    num_tokens: int
    num_requests: int
    block_size: int
    max_query_len: int
    max_context_len: int
    query_lens: list[int]
    query_start: torch.Tensor  # int32 [B + 1]
    context_lens: torch.Tensor  # int32 [B]
    is_tree: torch.Tensor  # int32 [B], 1 = ancestors-only mask among the new tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0 (never read: masked)
    tree_mask: torch.Tensor  # int32 [num_tokens, tree_words] (a [1, 1] dummy without trees)
    tree_words: int
    slot_mapping: torch.Tensor  # [T] as given (int64), validated
    buffers: "PlanBuffers"
    tile_cache: dict[int, tuple[torch.Tensor, torch.Tensor, int]]
    slot_tag: str = ""  # suffix of this plan's buffer slots (a static shape's own)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(tile_req, tile_q, num_tiles)``: the request and first query of each program row."""
        cached = self.tile_cache.get(block_q)
        if cached is not None:
            return cached
        tile_req: list[int] = []
        tile_q: list[int] = []
        for i, n in enumerate(self.query_lens):
            starts = range(0, n, block_q)
            tile_req.extend([i] * len(starts))
            tile_q.extend(starts)
        num_tiles = len(tile_req)
        views = _upload_sections(self.buffers, f"tiles{block_q}{self.slot_tag}", [tile_req, tile_q])
        result = (views[0], views[1], num_tiles)
        self.tile_cache[block_q] = result
        return result


class PlanBuffers:
    """Reused device buffers for the step metadata (grown by doubling, never shrunk).

    Reusing one allocation per kind keeps the per-step cost to one host-to-device
    copy and keeps addresses stable between steps of similar size, which is what a
    CUDA graph capture of the attention launches needs.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._uploads: dict[str, StagedUpload] = {}

    def scratch(self, slot: str, numel: int) -> torch.Tensor:
        """A reused fp32 work buffer of at least ``numel`` elements (contents undefined)."""
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(next_power_of_2(max(numel, 256)), dtype=torch.float32, device=self.device)
            self._buffers[slot] = buf
        return buf[:numel]

    def upload(self, host: torch.Tensor, slot: str) -> torch.Tensor:
        """The int32 ``host`` tensor on the device through the reused staging of
        ``slot`` (one non-blocking copy from pinned memory); returns the filled view."""
        staging = self._uploads.get(slot)
        if staging is None:
            staging = self._uploads[slot] = StagedUpload(self.device, torch.int32)
        return staging(host)


def validate_step(
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    tree_parents: Sequence[Sequence[int] | None],
    block_size: int,
    num_blocks: int,
) -> list[int]:
    """Check the step's metadata against the cache; returns the query lengths.

    Every index the kernels will read through is checked here, since an
    out-of-range block id would read (or, for the store, write) foreign memory.
    """
    num_requests = len(context_lens)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if len(query_start_loc) != num_requests + 1:
        raise ValueError(
            f"query_start_loc has {len(query_start_loc)} entries, expected {num_requests + 1} "
            "(one more than context_lens)"
        )
    if len(block_tables) != num_requests or len(tree_parents) != num_requests:
        raise ValueError("block_tables, tree_parents and context_lens must have one entry per request")
    if query_start_loc and query_start_loc[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {query_start_loc[0]}")
    query_lens = []
    for i in range(num_requests):
        q_len = query_start_loc[i + 1] - query_start_loc[i]
        ctx = context_lens[i]
        if q_len < 0:
            raise ValueError(f"request {i}: query_start_loc decreases ({query_start_loc[i]} -> {query_start_loc[i + 1]})")
        if ctx < q_len:
            raise ValueError(f"request {i}: context_len {ctx} shorter than its {q_len} queries")
        table = block_tables[i]
        if len(table) * block_size < ctx:
            raise ValueError(
                f"request {i}: block table too short for context_len {ctx} "
                f"({len(table)} blocks of {block_size})"
            )
        if table and (min(table) < 0 or max(table) >= num_blocks):
            raise ValueError(f"request {i}: block table has ids outside [0, {num_blocks}): {list(table)}")
        parents = tree_parents[i]
        if parents is not None and len(parents) != q_len:
            raise ValueError(f"request {i}: {len(parents)} tree parents for {q_len} tokens")
        query_lens.append(q_len)
    return query_lens


@dataclass(frozen=True, slots=True)
class StaticShape:
    """A step padded to a fixed shape, whose plan must sit at the same addresses and
    pick the same kernels every time (a CUDA graph replays its launches): ``bucket``
    requests of ``tokens`` new tokens each (the caller pads the step), block tables
    ``max_blocks`` wide, a tree-mask section for every token when ``tokens > 1``
    (whether or not the step has trees), and every buffer in slots of its own shape."""

    bucket: int
    max_blocks: int
    tokens: int = 1

    @property
    def tag(self) -> str:
        """Suffix of this shape's buffer slots."""
        return f":b{self.bucket}t{self.tokens}"


def build_kernel_plan(meta: AttentionMetadata, num_blocks: int, buffers: PlanBuffers,
                      static: StaticShape | None = None) -> KernelPlan:
    """Validate the step's metadata and upload it in one host-to-device copy.

    With ``static``, the plan has that fixed shape: tables padded to its width, the
    context cap standing in for the longest context (so the tile and split choices
    depend on the bucket alone; the kernel reads each request's real length), and
    its own buffers.
    """
    query_start_loc, context_lens = meta.query_start_loc, meta.context_lens
    block_tables, tree_parents, block_size = meta.block_tables, meta.tree_parents, meta.block_size
    slot_mapping = meta.slot_mapping
    query_lens = validate_step(query_start_loc, context_lens, block_tables, tree_parents, block_size, num_blocks)
    num_requests = len(context_lens)
    num_tokens = query_start_loc[-1] if query_start_loc else 0
    _validate_slots(slot_mapping, num_tokens, num_blocks * block_size, buffers.device, meta.slot_bounds)

    tree_sizes = [len(p) for p in tree_parents if p is not None]
    tree_words = max(1, cdiv(max(tree_sizes, default=1), 32))
    with_mask = bool(tree_sizes)  # a tree-mask section of a word row per token
    max_blocks = max(1, max((len(t) for t in block_tables), default=1))
    max_context_len = max(context_lens, default=0)
    tag = ""
    if static is not None:
        if (num_requests != static.bucket or any(n != static.tokens for n in query_lens)
                or (tree_sizes and static.tokens == 1) or max_blocks > static.max_blocks):
            raise ValueError(f"a static plan needs {static.bucket} requests of {static.tokens} tokens "
                             f"{'(no trees) ' if static.tokens == 1 else ''}and tables of at most "
                             f"{static.max_blocks} blocks; got query lengths {query_lens}, "
                             f"{len(tree_sizes)} trees, {max_blocks} blocks")
        max_blocks, max_context_len, tag = static.max_blocks, static.max_blocks * block_size, static.tag
        if static.tokens > 1:  # the mask section has the same size whatever the trees
            tree_words, with_mask = cdiv(static.tokens, 32), True
    if num_tokens * tree_words >= 2**31:  # the kernel indexes mask words in int32
        raise ValueError(f"{num_tokens} tokens x {tree_words} tree-mask words exceed 2**31")
    tables = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
    # Non-tree tokens' rows are never read (the kernel masks the load by is_tree).
    if with_mask:
        tree_rows = [[0] * tree_words for _ in range(num_tokens)]
        for i, parents in enumerate(tree_parents):
            if parents is not None:
                start = query_start_loc[i]
                tree_rows[start : start + len(parents)] = tree_ancestor_words(parents, tree_words)
        tree_flat = [w for row in tree_rows for w in row]
    else:
        tree_flat = [0]
    sections = [
        list(query_start_loc),
        list(context_lens),
        [int(p is not None) for p in tree_parents],
        [b for t in tables for b in t],
        tree_flat,
    ]
    views = _upload_sections(buffers, "step" + tag, sections)
    return KernelPlan(
        num_tokens=num_tokens,
        num_requests=num_requests,
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_context_len=max_context_len,
        query_lens=query_lens,
        query_start=views[0],
        context_lens=views[1],
        is_tree=views[2],
        block_tables=views[3].view(num_requests, max_blocks) if num_requests else views[3].view(0, 1),
        tree_mask=views[4].view(-1, tree_words) if with_mask else views[4].view(1, 1),
        tree_words=tree_words,
        slot_mapping=slot_mapping,
        buffers=buffers,
        tile_cache={},
        slot_tag=tag,
    )


# Sections start on 64-byte boundaries: every pointer a kernel gets is then equally
# aligned in every step, so Triton's alignment specialisation never changes with the
# batch (a change would mean a new compile in the middle of serving).
_SECTION_ALIGN = 16  # int32 elements


def _upload_sections(buffers: PlanBuffers, slot: str, sections: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Upload int32 ``sections`` in one copy, each at an aligned offset; their views."""
    flat: list[int] = []
    spans = []
    for section in sections:
        spans.append((len(flat), len(section)))
        flat.extend(section)
        flat.extend([0] * (-len(flat) % _SECTION_ALIGN))
    dev = buffers.upload(torch.tensor(flat, dtype=torch.int32), slot=slot)
    return [dev[start:start + n] for start, n in spans]


def _validate_slots(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int, device: torch.device,
                    bounds: tuple[int, int] | None) -> None:
    if slot_mapping.dim() != 1 or slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping must have shape [{num_tokens}], got {list(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the KV cache on {device}")
    if num_tokens:
        if bounds is None:
            # A device sync (once per step, not per layer): callers that built the
            # slots on the host pass their bounds instead.
            lo_t, hi_t = torch.aminmax(slot_mapping)
            bounds = int(lo_t), int(hi_t)
        lo, hi = bounds
        # A bad slot would be a silent out-of-bounds write in the store kernel.
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"slot_mapping has slots outside [0, {num_slots}): min {lo}, max {hi}")
