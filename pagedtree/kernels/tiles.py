"""Tile and split-KV choices of the Triton paged attention kernels (host side, no
Triton needed): how many query rows a program takes (a tree's queries times the
query heads per KV head), its warps and pipeline stages per GPU generation, and into
how many key segments a step with too few programs for the GPU splits."""

from __future__ import annotations

from dataclasses import dataclass, replace


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
# On sm_90, wider key tiles (block ids gathered key by key across blocks of 16): more
# loads in flight per iteration. Timed in CUDA graphs on an H200 (32/8 heads, D=128,
# bf16, blocks of 16), at the same split count 64 keys took 1.35-1.8x less time than
# 16 in every workload swept (decodes of 1 and 8 requests over 256-4,096 keys, trees
# of 16 and 64 queries with the root among them, not yet the engine's root + 16 or 64
# in side rows), 32 keys 1.3-1.9x less (``benchmarks/attention_sweep.py``).
# A program takes the widest that ptxas keeps in registers without spilling, by head
# dim and program rows (``cuda_compile`` over every case, bf16): at head dim 64, 64
# keys up to 128 rows and 32 at 256; at head dim 128, 64 keys at 16 rows (decodes),
# 32 up to 128 rows (at 32-64 rows 64 keys spilled 9-89 stores, at 128 rows 14-37, at
# 256 rows 32 keys 1-26; root side rows and 64 keys at 256 rows: 1,153), 16 beyond;
# larger head dims keep 16. The 16-query trees of the sweep (64 rows) took 10% less
# time with 64 keys, spills and all, than with 32:
# the rule gives that up to spill nowhere. And only in launches of at most half a
# wave of programs (where few programs must keep many loads in flight): in the engine
# on the H200 64-key tiles made plain decoding's CUDA graph 5-7% faster at batch 1, 16
# and 64, but the batch-64 step (128 programs) took 0.8-1.1 ms more outside its graph
# replay, unexplained, so it keeps 16 keys (``gpu_bench.py --sections tiles`` times
# the rules side by side).
# (largest head dim, ((most program rows, keys a tile), ...)), in order.
SM90_KEY_TILES: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = (
    (64, ((128, 64), (256, 32))),
    (128, ((16, 64), (128, 32))),
)
SM90_WIDE_WAVE = 0.5  # launches of at most this share of a wave of programs (one per SM)
# Warps per tile: 16 rows each, at least 4 (so sm_90's warpgroup MMA applies).
MIN_WARPS = 4


# Split-KV: how many key segments a query tile may be cut into, and what the extra
# reduce launch costs, as the bytes the GPU could have moved meanwhile (3 us at
# the 3.35 TB/s of an H100, the launch cost benchmarks/roofline.py assumes).
SPLIT_CHOICES = (1, 2, 4, 8, 16)
# Keys per segment at least: shorter ones are mostly prologue and epilogue. At 128
# (two 64-key tiles), one request's decode over 1,024 keys took 11.3 us in 8 segments
# against 15.3 us in 4 on the H200 (8 KV heads: 8 programs unsplit).
MIN_SPLIT_KEYS = 128
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
    by one, as sm_90's wider tiles (``sm90_key_tile``, in small launches) do in
    blocks of 16. Split-KV
    (flash-decoding) is used where :func:`split_kv_cost` says it pays: when the
    step has too few programs to fill the GPU and the partials it
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
    if capability == 90 and launch_programs(tile, max_query_len, num_requests, num_kv_heads) <= \
            SM90_WIDE_WAVE * num_sms:
        tile = replace(tile, tile_n=max(tile_n, sm90_key_tile(block_m, head_dim)))
    num_splits = choose_splits(tile, max_query_len, group, num_requests, num_kv_heads, max_context_len, num_sms,
                               head_dim, kv_elem_bytes)
    return replace(tile, num_splits=num_splits)


def sm90_key_tile(block_m: int, head_dim: int) -> int:
    """Keys a tile of a ``block_m``-row program at ``head_dim`` takes on sm_90 in a small
    launch: the widest of ``SM90_KEY_TILES`` that does not spill (``GPU_TILE_N``
    where none is listed)."""
    padded = next_power_of_2(head_dim)
    for largest_head_dim, limits in SM90_KEY_TILES:
        if padded <= largest_head_dim:
            return next((keys for rows, keys in limits if block_m <= rows), GPU_TILE_N)
    return GPU_TILE_N


def launch_programs(tile: TileShape, max_query_len: int, num_requests: int, num_kv_heads: int) -> int:
    """Programs of an unsplit launch of ``tile``: per request its query tiles (the root
    aside when ``tile.root_side``), per KV head."""
    main_queries = max(1, max_query_len) - tile.first_query()
    return num_requests * max(1, cdiv(main_queries, tile.block_q)) * num_kv_heads


def choose_splits(tile: TileShape, max_query_len: int, group: int, num_requests: int, num_kv_heads: int,
                  max_context_len: int, num_sms: int, head_dim: int, kv_elem_bytes: int) -> int:
    """The split-KV count :func:`split_kv_cost` finds cheapest for ``tile``'s programs
    at a context of ``max_context_len`` keys (segments of at least ``MIN_SPLIT_KEYS``)."""
    programs = launch_programs(tile, max_query_len, num_requests, num_kv_heads)
    kv_bytes = programs * max_context_len * head_dim * 2 * kv_elem_bytes  # K and V, read once per program
    partial_bytes = num_requests * max(1, max_query_len) * group * num_kv_heads * (next_power_of_2(head_dim) + 2) * 8
    choices = [s for s in SPLIT_CHOICES if s == 1 or s * MIN_SPLIT_KEYS <= max_context_len]
    return min(choices, key=lambda s: split_kv_cost(s, programs, kv_bytes, partial_bytes, num_sms))
