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

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pagedtree.devices import same_device
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
    """How one launch cuts the work: one program per (query tile, KV head, KV split).

    A program's rows are its ``block_q`` tokens x ``group_p`` rows per token, packed
    token-major into ``block_m`` rows (the next power of two, at least 16 on a GPU
    for ``tl.dot``). ``group_p`` is the number of query heads per KV head itself
    (packed: a group of 6 takes 6 rows, not 8) or that number padded to a power of
    two. With ``root_side`` a request's first program starts at query 1 and takes
    query 0 in rows of its own (``root_m``), so a tree's root and 64 nodes cost
    what 64 nodes cost.
    """

    block_q: int  # query tokens of one request per program (main rows)
    group_p: int  # rows per token: the query heads per KV head, or that padded to a power of two
    tile_n: int  # keys per inner-loop iteration (== block size: one cache block per tile)
    num_splits: int  # KV segments per query tile (split-KV); > 1 adds a reduce kernel
    num_warps: int | None = None  # None: Triton's default
    root_side: bool = False  # query 0 of each request in side rows of its first program
    num_stages: int | None = None  # software-pipelining stages; None: Triton's default
    min_rows: int = 1  # 16 on a GPU: tl.dot's smallest tile
    max_registers: int | None = None  # per thread (Triton's ``maxnreg``); None: ptxas chooses

    @property
    def block_m(self) -> int:
        """Rows of the query tile: tokens x rows per token, to a power of two."""
        return max(self.min_rows, next_power_of_2(self.block_q * self.group_p))

    @property
    def root_m(self) -> int:
        """Rows of the root's side tile (its group's query heads), to a power of two."""
        return max(self.min_rows, next_power_of_2(self.group_p))

    def first_query(self) -> int:
        """The query the first program of a request starts at (1 with the root aside)."""
        return 1 if self.root_side else 0


# Rows of a query tile on a GPU. Decodes and token trees (query runs of at most
# MAX_TREE_QUERY tokens: a tree of 64 nodes is sent as its root and the nodes, 65
# queries) take up to MAX_ROWS rows of one request and KV head per program, the
# group's query heads packed (6 rows a token at 6 heads per KV head, not 8), the
# root in side rows when that saves a program: a root and 64 nodes at up to 4 query
# heads per KV head read the KV prefix once, at 5 to 8 twice (512 rows of fp32
# accumulators at head dim 128 are more than an SM's 256 KB of registers; the two
# programs of a request are neighbours in the grid, so the second read is mostly an
# L2 hit). The rows are spread over the warps (see _num_warps). Without warpgroup MMA
# (sm_80, sm_89, sm_120: mma.sync keeps operands in registers) 256 rows spill at
# head dim 128, so there tiles stop at 128. Longer runs (prefill chunks) take
# PREFILL_ROWS-row tiles, many programs, which a compute-bound prefill needs.
# Figures: `python -m pagedtree.kernels.cuda_compile`.
MAX_ROWS = 256
MAX_ROWS_SM80_D128 = 128
PREFILL_ROWS = 64
MAX_TREE_QUERY = 65
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


def has_warpgroup_mma(capability: int) -> bool:
    """Whether Triton's products on ``sm_<capability>`` keep the accumulator out of
    the operand registers' way (warpgroup MMA on sm_90, tensor memory on sm_100):
    then 256-row tiles fit at head dim 128. sm_80, sm_89 and the consumer sm_120
    parts use ``mma.sync``."""
    return 90 <= capability < 120


def _tree_tile(queries: int, group: int, max_rows: int, allow_root_side: bool) -> tuple[int, bool]:
    """``(block_q, root_side)`` for runs of up to ``queries`` tokens: the fewest
    programs per request, then the fewest rows per program (main and side rows).

    Tokens are spread evenly over the programs (65 queries at 6 heads per KV head:
    two programs of 33, not 42 and 23), and the root goes aside when that saves a
    program (65 queries at 4 heads per KV head: one program of 64 + the root, not
    two) or rows (17 queries at 4: 64 + 16 rows, not 128).
    """
    per_program = max(1, max_rows // group)  # tokens whose packed rows fit a program
    best: tuple[tuple[int, int], int, bool] | None = None
    for root_side in (False, True) if queries > 1 and allow_root_side else (False,):
        main = queries - 1 if root_side else queries
        programs = cdiv(main, per_program)
        block_q = cdiv(main, programs)
        if not group & (group - 1):  # a power-of-two group: a power-of-two token count, unpacked rows
            block_q = min(per_program, next_power_of_2(block_q))
        rows = max(16, next_power_of_2(block_q * group)) + (max(16, next_power_of_2(group)) if root_side else 0)
        if best is None or (programs, rows) < best[0]:
            best = ((programs, rows), block_q, root_side)
    return best[1], best[2]


def _num_warps(block_m: int, root_side: bool, capability: int) -> int:
    """Warps of a program: 16 rows each (at least ``MIN_WARPS``). 256 rows over 16
    warps sit at the 128-register cap of 512 threads (120-128 registers at head dim
    128 on sm_90, with ``BIG_TILE_STAGES``); with the root's side rows (31 spill
    stores) and on sm_100 (4) they take 8 warps instead (220-255 registers, none
    spilled; one program per SM either way). Figures from ``cuda_compile``."""
    warps = max(MIN_WARPS, block_m // 16)
    if warps > 8 and (root_side or capability >= 100):
        return 8
    return warps


# Pipelining stages of 256-row tiles: Triton's default (3 on sm_90) holds one more
# stage of keys, values and mask words in registers than these tiles can spare (and
# with the root's side rows, one stage: 2 spill 11 stores at 8 query heads per KV head).
BIG_TILE_STAGES = 2


# On sm_100, ptxas holds 8-warp attention programs to 128 registers a thread unless
# told otherwise, and the packed groups' tree tiles (5-7 query heads per KV head at
# 65 queries) then spill 1-3 stores; 256 threads may use up to 255 each (one
# program per SM, as on sm_90). Figures from ``cuda_compile``.
SM100_MAX_REGISTERS = 255


def _caps_registers(capability: int, num_warps: int) -> bool:
    """Whether a program of ``num_warps`` warps on ``sm_<capability>`` needs its
    register limit set (``SM100_MAX_REGISTERS``)."""
    return 100 <= capability < 120 and num_warps == 8


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
    if interpreted:
        group_p = next_power_of_2(group)
        q = next_power_of_2(max(1, max_query_len))
        block_q = max(1, min(q, 128 // group_p))
        return TileShape(block_q=block_q, group_p=group_p, tile_n=64, num_splits=1)
    tile_n = GPU_TILE_N if block_size % GPU_TILE_N == 0 else 32
    max_rows = MAX_ROWS if has_warpgroup_mma(capability) or next_power_of_2(head_dim) < 128 else MAX_ROWS_SM80_D128
    args = (max_query_len, group, num_requests, num_kv_heads, max_context_len, num_sms, capability, head_dim,
            kv_elem_bytes, tile_n)
    tile = _gpu_tile(max_rows, *args)
    if tile.block_m > 128 and group & (group - 1) and tile.num_splits > 1:
        # 256 rows of a packed group (3, 5, 6, 7 heads a token) writing split-KV
        # partials spill 8-36 stores at either warp count: where a split pays, take
        # 128-row tiles (more programs) and split those.
        tile = _gpu_tile(128, *args)
    return tile


def _gpu_tile(max_rows: int, max_query_len: int, group: int, num_requests: int, num_kv_heads: int,
              max_context_len: int, num_sms: int, capability: int, head_dim: int, kv_elem_bytes: int,
              tile_n: int) -> TileShape:
    """:func:`choose_tile_shape` on a GPU, with programs of up to ``max_rows`` rows."""
    queries = max(1, max_query_len)
    root_side = False
    if queries <= MAX_TREE_QUERY:
        # The root's side rows cost registers that mma.sync at head dim 128 does not
        # have (sm_80/sm_120 spill), and at head dim 64 its tiles already hold 256 rows.
        block_q, root_side = _tree_tile(queries, group, max_rows, has_warpgroup_mma(capability))
    else:
        block_q = max(1, PREFILL_ROWS // group)
    block_m = max(16, next_power_of_2(block_q * group))
    num_warps = _num_warps(block_m, root_side, capability)
    num_stages = None
    if block_m > 128:
        num_stages = 1 if root_side else BIG_TILE_STAGES
    elif block_m == 128 and not has_warpgroup_mma(capability):
        num_stages = BIG_TILE_STAGES  # mma.sync's 128-row tiles: 3 stages spill a store at head dim 64
    tile = TileShape(block_q=block_q, group_p=group, tile_n=tile_n, num_splits=1, num_warps=num_warps,
                     root_side=root_side, num_stages=num_stages, min_rows=16,
                     max_registers=SM100_MAX_REGISTERS if _caps_registers(capability, num_warps) else None)
    num_splits = choose_splits(tile, max_query_len, group, num_requests, num_kv_heads, max_context_len, num_sms,
                               head_dim, kv_elem_bytes)
    return replace(tile, num_splits=num_splits)


def choose_splits(tile: TileShape, max_query_len: int, group: int, num_requests: int, num_kv_heads: int,
                  max_context_len: int, num_sms: int, head_dim: int, kv_elem_bytes: int) -> int:
    """The split-KV count :func:`split_kv_cost` finds cheapest for ``tile``'s programs
    at a context of ``max_context_len`` keys (segments of at least ``MIN_SPLIT_KEYS``)."""
    main_queries = max(1, max_query_len) - tile.first_query()
    num_tiles = num_requests * max(1, cdiv(main_queries, tile.block_q))
    programs = num_tiles * num_kv_heads
    kv_bytes = programs * max_context_len * head_dim * 2 * kv_elem_bytes  # K and V, read once per program
    partial_bytes = num_requests * max(1, max_query_len) * group * num_kv_heads * (next_power_of_2(head_dim) + 2) * 8
    choices = [s for s in SPLIT_CHOICES if s == 1 or s * MIN_SPLIT_KEYS <= max_context_len]
    return min(choices, key=lambda s: split_kv_cost(s, programs, kv_bytes, partial_bytes, num_sms))


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
    # int32 [B, max_blocks]; entries past a request's real length are never read (the
    # kernel masks by context length) but are valid block ids: 0, or (static plans,
    # ``DeviceBlockTables``) ids a row held before.
    block_tables: torch.Tensor
    tree_mask: torch.Tensor  # int32 [num_tokens, tree_words] (a [1, 1] dummy without trees)
    tree_words: int
    slot_mapping: torch.Tensor  # [T] as given (int64), validated
    buffers: "PlanBuffers"
    tile_cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]]
    slot_tag: str = ""  # suffix of this plan's buffer slots (a static shape's own)
    real_max_context_len: int = 0  # the longest real context (static plans: below max_context_len)
    split_cache: dict[int, torch.Tensor] = field(default_factory=dict)

    def split_count(self, count: int) -> torch.Tensor:
        """int32 ``[1]`` on the device holding ``count``: how many KV segments the
        kernel uses this step. A static plan's launch grid has the split count of
        its widest context (a CUDA graph freezes it); the kernel reads the count
        the step's real context calls for from here, so a graph replays with the
        right split. Uploaded once per plan (before a capture or replay)."""
        cached = self.split_cache.get(count)
        if cached is None:
            cached = self.split_cache[count] = _upload_sections(self.buffers, f"splits{self.slot_tag}", [[count]])[0]
        return cached

    def tiles(self, block_q: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(tile_req, tile_q, num_tiles)``: the request and first query of each
        program row, tiles of ``block_q`` queries from query ``first`` on (1 when the
        kernel takes query 0 aside in the first program; a request with one query
        still gets that program)."""
        key = (block_q, first)
        cached = self.tile_cache.get(key)
        if cached is not None:
            return cached
        tile_req: list[int] = []
        tile_q: list[int] = []
        for i, n in enumerate(self.query_lens):
            starts = range(first, max(n, first + 1), block_q) if n else ()
            tile_req.extend([i] * len(starts))
            tile_q.extend(starts)
        num_tiles = len(tile_req)
        views = _upload_sections(self.buffers, f"tiles{block_q}:{first}{self.slot_tag}", [tile_req, tile_q])
        result = (views[0], views[1], num_tiles)
        self.tile_cache[key] = result
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
        self._tables: dict[int, DeviceBlockTables] = {}  # by width

    def block_tables(self, rows: int, width: int) -> DeviceBlockTables:
        """The persistent device block table ``width`` entries wide, with at least
        ``rows`` rows, that every static shape of that width views (its first rows).

        It is made anew (another address) only when a shape asks for more rows than
        it has; static shapes name the largest batch up front (``StaticShape.table_rows``),
        so once a graph is captured the table never moves."""
        tables = self._tables.get(width)
        if tables is None or tables.rows < rows:
            tables = self._tables[width] = DeviceBlockTables(rows, width, self.device)
        return tables

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
    check_block_ids: bool = True,
) -> list[int]:
    """Check the step's metadata against the cache; returns the query lengths.

    Every index the kernels will read through is checked here, since an
    out-of-range block id would read (or, for the store, write) foreign memory.
    ``check_block_ids=False`` leaves the block ids to the caller: a static plan
    checks only the ids it uploads (``DeviceBlockTables.update``), the rest are on
    the device already, checked when they went up.
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
        if check_block_ids and table and (min(table) < 0 or max(table) >= num_blocks):
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
    (whether or not the step has trees), and every buffer in slots of its own shape
    but the block tables: the first ``bucket`` rows of one persistent device table
    of ``table_rows`` rows (the largest bucket; 0: ``bucket``) shared by every shape
    of that width (``DeviceBlockTables``)."""

    bucket: int
    max_blocks: int
    tokens: int = 1
    table_rows: int = 0

    @property
    def tag(self) -> str:
        """Suffix of this shape's buffer slots."""
        return f":b{self.bucket}t{self.tokens}"


class DeviceBlockTables:
    """Block tables that stay on the device from one static step to the next.

    One int32 ``[rows, width]`` tensor (``width`` covers ``max_model_len``) whose
    first rows every static shape of that width views, and a host mirror of it: per
    row, the block ids its leading entries hold on the device, and the key (request
    id) of the table it last received. Row ``i`` holds the ``i``-th request of the
    step. A step sends only what changed, so the host work follows the tables' real
    lengths and never the width:

    - a row whose key another row held (the batch moved up when a request ended) is
      first copied on the device from that row (one gather for all such rows);
    - each row is compared with its mirror over the request's real length (a list
      comparison, at C speed); where it differs (a copy-on-write swap, a recompute,
      a new owner) chunk by chunk, so only differing chunks go up; entries appended
      since (new blocks) go up;
    - entries past a request's real length are left as they are: the kernel masks
      them by context length, and they stay valid block ids (0, or an id the row
      held before, checked when it went up).

    All of a step's new entries go up in one int32 copy (row moves, values, flat
    positions) and land through one scatter. Keys only save copies: every row is
    compared whatever its key, so a wrong or repeated key costs uploads, never
    correctness.
    """

    CHUNK = 64  # entries compared (and re-sent) together where a row changed in place

    def __init__(self, rows: int, width: int, device: torch.device):
        if rows < 1 or width < 1:
            raise ValueError(f"a block table needs rows and width >= 1, got {rows} x {width}")
        self.rows = rows
        self.width = width
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._held: list[list[int]] = [[] for _ in range(rows)]  # the device's leading entries, per row
        self._keys: list[Hashable | None] = [None] * rows
        self._staging = StagedUpload(device, torch.int32)
        self.last_upload = 0  # int32 elements the last update sent (for tests and stats)

    def held(self, row: int) -> list[int]:
        """The leading entries of ``row`` as the mirror knows them (a copy)."""
        return list(self._held[row])

    def update(self, tables: Sequence[Sequence[int]], keys: Sequence[Hashable | None] | None,
               num_blocks: int) -> torch.Tensor:
        """Bring rows ``0 .. len(tables) - 1`` up to ``tables`` (``keys``: who owns each,
        None = nobody to follow, e.g. a padding request); returns their view
        ``[len(tables), width]``. Raises ``ValueError`` (with the table and the mirror
        unchanged) if a table is too wide or has an id outside ``[0, num_blocks)``."""
        n = len(tables)
        keys = [None] * n if keys is None else list(keys)
        if n > self.rows or len(keys) != n:
            raise ValueError(f"{n} tables and {len(keys)} keys for a table of {self.rows} rows")
        moves = self._moves(keys)
        source = {dst: src for src, dst in moves}
        values: list[int] = []
        positions: list[int] = []
        spans: list[list[tuple[int, int]]] = []
        for i, table in enumerate(tables):
            table = table if isinstance(table, list) else list(table)
            if len(table) > self.width:
                raise ValueError(f"row {i}: a block table of {len(table)} entries, wider than {self.width}")
            row_spans = _changed_spans(self._held[source.get(i, i)], table, self.CHUNK)
            spans.append(row_spans)
            base = i * self.width
            for start, end in row_spans:
                values.extend(table[start:end])
                positions.extend(range(base + start, base + end))
        if values and (min(values) < 0 or max(values) >= num_blocks):
            raise ValueError(f"block tables have ids outside [0, {num_blocks}): min {min(values)}, max {max(values)}")
        self._send(moves, values, positions)
        self._remember(tables, keys, moves, spans)
        return self.table[:n]

    def _moves(self, keys: list[Hashable | None]) -> list[tuple[int, int]]:
        """``(source row, row)`` for rows whose key held another row before."""
        if all(key is None or key == self._keys[i] for i, key in enumerate(keys)):
            return []  # the usual step: every row keeps its owner
        where: dict[Hashable, int] = {}
        for row, key in enumerate(self._keys):
            if key is not None:
                where.setdefault(key, row)
        moves = []
        for i, key in enumerate(keys):
            if key is None or key == self._keys[i]:
                continue
            src = where.get(key)
            if src is not None and src != i:
                moves.append((src, i))
        return moves

    def _send(self, moves: list[tuple[int, int]], values: list[int], positions: list[int]) -> None:
        """One upload: row moves (gathered first, so a row may be source and
        destination), then the new entries scattered to their flat positions."""
        self.last_upload = 2 * len(moves) + len(values) + len(positions)
        if not self.last_upload:
            return
        flat = [src for src, _ in moves] + [dst for _, dst in moves] + values + positions
        dev = self._staging(torch.tensor(flat, dtype=torch.int32))
        m, k = len(moves), len(values)
        if m:
            self.table[dev[m:2 * m].long()] = self.table[dev[:m].long()]
        if k:
            self.table.view(-1).index_copy_(0, dev[2 * m + k:].long(), dev[2 * m:2 * m + k])

    def _remember(self, tables: Sequence[Sequence[int]], keys: list[Hashable | None],
                  moves: list[tuple[int, int]], spans: list[list[tuple[int, int]]]) -> None:
        """The mirror after ``_send``: moved rows copied, changed spans written, keys set
        (a key now in the first rows is dropped from the rows past them)."""
        copies = {dst: list(self._held[src]) for src, dst in moves}  # from the rows as they were
        for dst, held in copies.items():
            self._held[dst] = held
        for i, row_spans in enumerate(spans):
            held, table = self._held[i], tables[i]
            for start, end in row_spans:
                held[start:end] = table[start:end]
        self._keys[:len(keys)] = keys
        current = set(keys)
        for row in range(len(keys), self.rows):
            if self._keys[row] in current:
                self._keys[row] = None


def _changed_spans(held: list[int], table: list[int], chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``table`` that differ from ``held`` (the device's
    leading entries) or lie past it: nothing, or the appended tail, when ``held``
    agrees with ``table`` over their common length; else the differing chunks too."""
    n, k = len(table), len(held)
    if k == n:
        same = held == table
    else:
        same = held[:n] == table if k > n else held == table[:k]
    if same:
        return [(k, n)] if n > k else []
    common = min(k, n)
    bounds = [(s, min(s + chunk, common)) for s in range(0, common, chunk)]
    spans = [(s, e) for s, e in bounds if held[s:e] != table[s:e]]
    if n > k:
        spans.append((k, n))
    return spans


def build_kernel_plan(meta: AttentionMetadata, num_blocks: int, buffers: PlanBuffers,
                      static: StaticShape | None = None,
                      row_keys: Sequence[Hashable | None] | None = None) -> KernelPlan:
    """Validate the step's metadata and upload it in one host-to-device copy.

    With ``static``, the plan has that fixed shape: the context cap standing in for
    the longest context (so the tile and split choices depend on the bucket alone;
    the kernel reads each request's real length), its own buffers, and the block
    tables in the first rows of the persistent device table of its width, brought
    up to date by sending only what changed (``DeviceBlockTables``; ``row_keys``
    names each row's owner, so a batch that moved up is copied on the device).
    """
    query_start_loc, context_lens = meta.query_start_loc, meta.context_lens
    block_tables, tree_parents, block_size = meta.block_tables, meta.tree_parents, meta.block_size
    slot_mapping = meta.slot_mapping
    query_lens = validate_step(query_start_loc, context_lens, block_tables, tree_parents, block_size, num_blocks,
                               check_block_ids=static is None)
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
    if static is not None:  # the tables stay on the device: only their changes go up
        device_tables = buffers.block_tables(max(static.table_rows, static.bucket), static.max_blocks)
        static_tables = device_tables.update(block_tables, row_keys, num_blocks)
        flat_tables: list[int] = []
    else:
        flat_tables = [b for t in block_tables for b in list(t) + [0] * (max_blocks - len(t))]
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
        tree_flat,
        flat_tables,
    ]
    views = _upload_sections(buffers, "step" + tag, sections)
    if static is not None:
        tables_view = static_tables
    else:
        tables_view = views[4].view(num_requests, max_blocks) if num_requests else views[4].view(0, 1)
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
        block_tables=tables_view,
        tree_mask=views[3].view(-1, tree_words) if with_mask else views[3].view(1, 1),
        tree_words=tree_words,
        slot_mapping=slot_mapping,
        buffers=buffers,
        tile_cache={},
        slot_tag=tag,
        real_max_context_len=max(context_lens, default=0),
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
    if not same_device(slot_mapping.device, device):
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
