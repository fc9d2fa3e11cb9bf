"""The Triton kernels equal the torch reference (compiled on a GPU, interpreted on CPU).

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when no GPU is present, before
any kernel is defined. Shapes are kept small because the interpreter executes every
program in Python; the bigger cases are marked slow.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from pagedtree.attention import torch_backend as reference  # noqa: E402
from pagedtree.step_data import AttentionMetadata  # noqa: E402
from pagedtree.kernels import triton_ops  # noqa: E402
from pagedtree.kernels.attention_plan import PlanBuffers, build_kernel_plan  # noqa: E402
from pagedtree.kernels.tiles import TileShape, choose_tile_shape  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _parents(kind: str, n: int, rng: random.Random) -> list[int] | None:
    if kind in ("prefill", "decode"):
        return None
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    return [-1] + [rng.randrange(-1, j) for j in range(1, n)]  # random tree


class Batch:
    """A random paged cache and a step of requests ``(kind, new tokens, prefix length)``."""

    def __init__(self, kinds, block_size, heads, kv_heads, head_dim, dtype, seed=0, spare_blocks=8):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        need = sum(-(-(p + n) // block_size) for _, n, p in kinds)
        self.num_blocks = need + spare_blocks
        shape = (self.num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
        free = list(range(self.num_blocks))
        rng.shuffle(free)  # non-contiguous block tables
        self.qsl, self.ctx, self.tables, self.parents = [0], [], [], []
        for kind, n, prefix in kinds:
            self.tables.append([free.pop() for _ in range(-(-(prefix + n) // block_size))])
            self.ctx.append(prefix + n)
            self.qsl.append(self.qsl[-1] + n)
            self.parents.append(_parents(kind, n, rng))
        self.query = torch.randn(self.qsl[-1], heads, head_dim, generator=gen).to(dtype).to(DEVICE)
        self.block_size = block_size
        self.scale = head_dim**-0.5
        # Slots of the new tokens (the store kernel is tested on its own).
        slots = []
        for table, ctx, (_, n, _p) in zip(self.tables, self.ctx, kinds):
            slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(ctx - n, ctx)]
        self.slots = torch.tensor(slots, dtype=torch.long, device=DEVICE)

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(self.block_size, self.slots, self.qsl, self.ctx, self.tables, self.parents)

    def plan(self):
        return build_kernel_plan(self.meta(), self.num_blocks, PlanBuffers(DEVICE))

    def expected(self) -> torch.Tensor:
        """The torch reference on fp32 copies of the inputs (the kernels compute in fp32)."""
        ref_plan = reference.build_reference_plan(self.meta())
        return reference.paged_attention(
            self.query.float(), self.k_cache.float(), self.v_cache.float(), ref_plan, self.scale
        )

    def check(self, tile: TileShape | None = None) -> None:
        out = triton_ops.unified_attention(self.query, self.k_cache, self.v_cache, self.plan(), self.scale, tile=tile)
        assert out.dtype == self.query.dtype and out.shape == self.query.shape
        tol = TOL[self.query.dtype]
        torch.testing.assert_close(out.float(), self.expected(), atol=tol, rtol=tol)


def mixed(block_size: int) -> list[tuple[str, int, int]]:
    """Prefill chunks, decodes and trees; prefixes 0, ragged, and ending on a block boundary."""
    return [
        ("prefill", 20, 0), ("prefill", 9, block_size), ("decode", 1, 0), ("decode", 1, 5),
        ("decode", 1, 2 * block_size), ("chain", 6, 3), ("star", 5, block_size),
        ("tree", 9, 0), ("tree", 17, 11),
    ]


@pytest.mark.parametrize(
    "block_size,dtype,heads,kv_heads,head_dim",
    [
        (16, torch.float32, 4, 2, 64),
        (32, torch.float32, 8, 2, 128),
        (16, torch.float16, 4, 4, 128),
        (32, torch.bfloat16, 8, 1, 64),
        (1, torch.float32, 4, 2, 16),  # the engine tests' block size and head dim
        (8, torch.bfloat16, 6, 2, 32),  # 3 query heads per KV head: padded group
        (16, torch.float16, 2, 1, 80),  # head dim that is not a power of two
    ],
)
def test_mixed_batch_matches_reference(block_size, dtype, heads, kv_heads, head_dim):
    Batch(mixed(block_size), block_size, heads, kv_heads, head_dim, dtype, seed=block_size).check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_shapes_in_one_launch(dtype):
    rng = random.Random(3)
    kinds = [("tree", 1, 0), ("chain", 2, 16), ("star", 3, 5)]
    kinds += [(rng.choice(["chain", "star", "tree"]), rng.randint(4, 40), rng.choice([0, 16, 31, 32])) for _ in range(3)]
    kinds += [("chain", 64, 16), ("star", 64, 0), ("tree", 64, 7)]
    Batch(kinds, 16, 4, 2, 64, dtype, seed=4).check()


@pytest.mark.parametrize(
    "tile",
    [
        # At least 16 rows each, so that the same shapes compile on a GPU.
        TileShape(block_q=8, group_p=2, tile_n=16, num_splits=1),  # several query tiles per request
        TileShape(block_q=8, group_p=4, tile_n=32, num_splits=3),  # padded group, split-KV
        TileShape(block_q=1, group_p=16, tile_n=16, num_splits=2),  # one token per program
        TileShape(block_q=16, group_p=4, tile_n=16, num_splits=1),  # 64 rows: a whole tree per program
        TileShape(block_q=64, group_p=4, tile_n=16, num_splits=2),  # 256 rows with split-KV
    ],
    ids=["multi-tile", "padded-group-split", "one-token-split", "whole-tree", "256-rows-split"],
)
def test_tile_shapes_match_reference(tile):
    kinds = [("prefill", 11, 16), ("decode", 1, 40), ("tree", 7, 16), ("star", 4, 0)]
    Batch(kinds, 16, 4, 2, 32, torch.float32, seed=5).check(tile)


@pytest.mark.parametrize("block_size,tile_n", [(16, 16), (32, 32), (16, 32)], ids=["aligned16", "aligned32", "gather"])
def test_block_aligned_key_tiles(block_size, tile_n):
    """Key tiles of exactly one cache block (one block id per tile) and gathered ones."""
    kinds = [("prefill", 13, 2 * block_size), ("decode", 1, block_size - 1), ("tree", 12, block_size + 3)]
    Batch(kinds, block_size, 4, 2, 32, torch.float32, seed=7).check(
        TileShape(block_q=16, group_p=2, tile_n=tile_n, num_splits=1))


def _kv_loads(kinds, tile: TileShape, kv_heads: int = 2, group: int = 4) -> list[int]:
    batch = Batch(kinds, 16, group * kv_heads, kv_heads, 16, torch.float32, seed=8)
    loads = torch.zeros(len(kinds), dtype=torch.int32, device=DEVICE)
    out = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, batch.plan(), batch.scale,
                                       tile=tile, kv_loads=loads)
    torch.testing.assert_close(out.float(), batch.expected(), atol=1e-4, rtol=1e-4)
    return loads.tolist()


# The default suite runs the largest tree of each kind (one program of up to 256 rows
# at 4 and at 8 query heads per KV head, two programs at 8); the smaller trees at 4
# (the same single program, fewer rows) run under -m slow.
@pytest.mark.parametrize("nodes,group,reads", [
    pytest.param(16, 4, 1, marks=pytest.mark.slow), pytest.param(32, 4, 1, marks=pytest.mark.slow),
    (64, 4, 1), (32, 8, 1), (64, 8, 2),
])
def test_a_tree_reads_its_kv_once_like_a_decode(nodes, group, reads):
    """With the tile shape a GPU gets, a tree of up to 64 nodes and its root (the
    engine sends both) at 4 query heads per KV head (32 at 8: up to 256 rows in one
    program, the root aside) loads as many K/V tiles as a decode at the same KV
    length; a 64-node tree at 8, in two programs, about twice as many (512-row
    programs would not fit the registers: see choose_tile_shape)."""
    length = 100
    queries = nodes + 1
    tree = [("tree", queries, length - queries)] * 2
    decode = [("decode", 1, length - 1)] * 2
    shape = lambda kinds: choose_tile_shape(max(n for _, n, _ in kinds), group, len(kinds), 2, length,  # noqa: E731
                                            interpreted=False, block_size=16)
    assert shape(tree).block_m == min(256, nodes * group) and shape(tree).root_side
    tree_loads = _kv_loads(tree, shape(tree), group=group)
    # A decode with the tree's key tiles (a lone decode may take wider ones on sm_90).
    tile_n = shape(tree).tile_n
    decode_loads = _kv_loads(decode, replace(shape(decode), tile_n=tile_n), group=group)
    assert decode_loads == [2 * -(-length // tile_n)] * 2  # KV heads x key tiles
    if reads == 1:
        assert tree_loads == decode_loads
    else:  # the second program reads up to its own last query only
        assert all(d < t <= reads * d for t, d in zip(tree_loads, decode_loads))
    # The counter counts: query tiles of 16 tokens re-read the prefix once per tile.
    per_tile = _kv_loads(tree, TileShape(block_q=16, group_p=group, tile_n=16, num_splits=1), group=group)
    assert all(a > t for a, t in zip(per_tile, tree_loads))


# (arch, head dim): the tile a GPU of that kind picks; the kernel runs here at head
# dim 16 (what it loads does not depend on the head dim, only the tile does).
_ARCH_DIMS = [(90, 64), (90, 128), (80, 64), (80, 128)]
_GROUPS = [3, 4, 5, 6, 7, 8]
_FAST = [(90, 128, 4), (90, 128, 6)]


@pytest.mark.parametrize("arch,head_dim,group", [
    pytest.param(a, d, g, marks=[] if (a, d, g) in _FAST else pytest.mark.slow)
    for a, d in _ARCH_DIMS for g in _GROUPS
])
def test_a_64_node_tree_and_its_root_read_the_prefix_the_fewest_times(arch, head_dim, group):
    """A 64-node tree is 65 queries. Each program of a request walks the whole KV
    prefix, so the prefix is read once per program; the programs are the fewest that
    hold 64 tokens of G rows of fp32 accumulators (256 rows, 128 without warpgroup
    MMA at head dim 128), the root's G rows aside on sm_90: once at up to 4 query
    heads per KV head there, twice at 5 to 8."""
    from pagedtree.kernels.tiles import MAX_ROWS, MAX_ROWS_SM80_D128

    length, queries, kv_heads = 48 + 65, 65, 2
    tree = [("tree", queries, length - queries)] * 2
    tile = choose_tile_shape(queries, group, 2, kv_heads, length, interpreted=False, block_size=16,
                             capability=arch, head_dim=head_dim)
    max_rows = MAX_ROWS if arch == 90 or head_dim < 128 else MAX_ROWS_SM80_D128
    # Whole tokens per program; the root aside only with warpgroup MMA (mma.sync
    # has no registers for its rows at head dim 128: sm_80 spills).
    fewest = -(-(queries - (arch == 90)) // (max_rows // group))
    programs = -(-(queries - tile.first_query()) // tile.block_q)
    assert programs == fewest and tile.block_m <= max_rows and tile.block_m >= tile.block_q * group
    if arch == 90:
        assert programs == (1 if group <= 4 else 2)
    loads = _kv_loads(tree, tile, group=group)
    prefix_tiles = kv_heads * (length - queries) // 16  # whole 16-key tiles before the tree
    # Every program reads the prefix once, and the keys of the tree up to its own last query.
    assert all(programs * prefix_tiles <= n <= programs * kv_heads * -(-length // 16) for n in loads)
    # 64-row tiles (what runs above 64 queries took): more programs, more reads.
    old = _kv_loads(tree, TileShape(block_q=max(1, 64 // group), group_p=group, tile_n=16, num_splits=1,
                                    min_rows=16), group=group)
    assert all(o > n for o, n in zip(old, loads))


def test_split_kv_long_prefix():
    kinds = [("decode", 1, 200), ("tree", 8, 130), ("decode", 1, 3)]
    Batch(kinds, 32, 4, 2, 64, torch.float16, seed=6).check(TileShape(block_q=8, group_p=2, tile_n=32, num_splits=4))


def test_empty_step_and_zero_query_request():
    batch = Batch([("decode", 1, 4), ("prefill", 0, 4)], 16, 2, 1, 16, torch.float32)
    batch.check()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_big_mixed_batch(dtype, block_size):
    rng = random.Random(block_size)
    kinds = [("prefill", 150, 0), ("prefill", 64, 3 * block_size)]
    kinds += [("decode", 1, rng.randint(0, 600)) for _ in range(6)]
    kinds += [(k, rng.randint(16, 96), rng.randint(0, 300)) for k in ("chain", "star", "tree", "tree")]
    Batch(kinds, block_size, 8, 2, 128, dtype, seed=block_size).check()


# ---------------------------------------------------------------- store and copies
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_matches_reference(cache_dtype):
    gen = torch.Generator().manual_seed(0)
    shape = (6, 8, 2, 16)
    caches = [torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE) for _ in range(2)]
    expected = [c.clone() for c in caches]
    # Key and value as views of one projection output (rows strided), fp32 into any cache dtype.
    kv = torch.randn(7, 2, 2, 16, generator=gen).to(DEVICE)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.tensor([0, 47, 8, 9, 23, 1, 40], device=DEVICE)
    triton_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv_reference(key, value, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def _layers(num_layers, shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=gen).to(dtype).to(DEVICE), torch.randn(shape, generator=gen).to(dtype).to(DEVICE))
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "src,dst", [([0, 3, 5], [7, 2, 6]), ([1, 2, 3], [0, 1, 2]), ([4, 6], [6, 4])], ids=["disjoint", "slide", "swap"]
)
def test_copy_blocks_matches_reference(dtype, src, dst):
    from pagedtree.attention.triton_backend import TritonPagedAttention

    caches = _layers(3, (8, 4, 2, 16), dtype, seed=1)
    expected = [(k.clone(), v.clone()) for k, v in caches]
    TritonPagedAttention(caches, 1.0).copy_blocks(src, dst)
    reference.copy_blocks(expected, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    for (k, v), (ek, ev) in zip(caches, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "src,dst",
    [([9, 12, 14, 15], [8, 9, 10, 11]), ([3, 30], [20, 21]), ([5, 6], [6, 5])],
    ids=["compact-path", "disjoint", "swap"],
)
def test_copy_slots_matches_reference(dtype, src, dst):
    from pagedtree.attention.triton_backend import TritonPagedAttention

    caches = _layers(2, (8, 4, 2, 16), dtype, seed=2)
    expected = [(k.clone(), v.clone()) for k, v in caches]
    TritonPagedAttention(caches, 1.0).copy_slots(src, dst)
    reference.copy_slots(expected, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    for (k, v), (ek, ev) in zip(caches, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)


# ---------------------------------------------------------------- host-side validation
def _plan(qsl, ctx, tables, parents, block_size=4, num_blocks=8, slots=None):
    if slots is None:
        slots = torch.zeros(qsl[-1], dtype=torch.long)
    meta = AttentionMetadata(block_size, slots.to(DEVICE), qsl, ctx, tables, parents)
    return build_kernel_plan(meta, num_blocks, PlanBuffers(DEVICE))


@pytest.mark.parametrize(
    "args,match",
    [
        (([0, 3], [9], [[0]], [None]), "block table too short"),
        (([0, 3], [9], [[0, 1, 8]], [None]), "block table has ids outside"),
        (([0, 3], [2], [[0]], [None]), "shorter than its 3 queries"),
        (([0, 3], [3], [[0]], [[-1, 2, 0]]), "parents must precede"),
        (([0, 3], [3], [[0]], [[-1, 0]]), "2 tree parents for 3 tokens"),
        (([0, 3, 2], [3, 1], [[0], [1]], [None, None]), "decreases"),
        (([0, 3], [3, 1], [[0], [1]], [None, None]), "one more than context_lens"),
        (([1, 3], [3], [[0]], [None]), "must start at 0"),
    ],
)
def test_plan_rejects_bad_metadata(args, match):
    with pytest.raises(ValueError, match=match):
        _plan(*args)


def test_plan_rejects_bad_slots():
    with pytest.raises(ValueError, match="slots outside"):
        _plan([0, 2], [2], [[0]], [None], slots=torch.tensor([1, 32]))
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        _plan([0, 2], [2], [[0]], [None], slots=torch.tensor([1]))


def test_attention_rejects_bad_shapes():
    plan = _plan([0, 2], [2], [[0]], [None])
    cache = torch.zeros(8, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="query must have shape"):
        triton_ops.unified_attention(torch.zeros(3, 4, 16, device=DEVICE), cache, cache, plan, 1.0)
    with pytest.raises(ValueError, match="not a multiple of 2 KV heads"):
        triton_ops.unified_attention(torch.zeros(2, 3, 16, device=DEVICE), cache, cache, plan, 1.0)
    with pytest.raises(ValueError, match="block_size 4, the cache has 8"):
        triton_ops.unified_attention(
            torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(8, 8, 2, 16, device=DEVICE),
            torch.zeros(8, 8, 2, 16, device=DEVICE), plan, 1.0,
        )
    with pytest.raises(ValueError, match="KV cache must be"):
        triton_ops.unified_attention(torch.zeros(2, 4, 16, device=DEVICE), cache[0], cache[0], plan, 1.0)
    with pytest.raises(ValueError, match="key must have shape"):
        triton_ops.store_kv(torch.zeros(2, 3, 16, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE),
                            cache, cache.clone(), torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="slots outside"):
        triton_ops.store_kv(torch.zeros(2, 2, 16, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE),
                            cache, cache.clone(), torch.tensor([0, -1], device=DEVICE))


def test_copies_reject_bad_indices():
    from pagedtree.attention.triton_backend import TritonPagedAttention

    backend = TritonPagedAttention(_layers(1, (4, 2, 1, 16), torch.float32, seed=0), 1.0)
    with pytest.raises(ValueError, match="same length"):
        backend.copy_blocks([0, 1], [2])
    with pytest.raises(ValueError, match=r"dst has indices outside \[0, 4\)"):
        backend.copy_blocks([0], [4])
    with pytest.raises(ValueError, match=r"src has indices outside \[0, 8\)"):
        backend.copy_slots([8], [0])
    with pytest.raises(ValueError, match="repeated"):
        backend.copy_slots([0, 1], [2, 2])


@pytest.mark.parametrize("count", [None, 1, 3])
def test_a_static_grid_uses_the_split_its_real_context_calls_for(count, monkeypatch):
    """A CUDA graph freezes the grid's split count (its widest context's); the kernel
    uses the first ``count`` segments, the count the step's real context calls for
    (None: the cost model's own choice, here 4 segments of 150 keys)."""
    if count is not None:
        monkeypatch.setattr(triton_ops, "choose_splits", lambda *args, **kwargs: count)
    batch = Batch([("decode", 1, 600), ("tree", 9, 300), ("chain", 4, 40)], 16, 4, 2, 32, torch.float32, seed=12)
    plan = batch.plan()
    plan.max_context_len = 16 * 1024  # the width of a static plan's tables
    tile = TileShape(block_q=16, group_p=2, tile_n=16, num_splits=8, min_rows=16)
    out = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, plan, batch.scale, tile=tile)
    torch.testing.assert_close(out.float(), batch.expected(), atol=1e-4, rtol=1e-4)
    assert plan.split_value == (count if count is not None else 4)


def test_one_plan_launched_with_several_split_counts_gives_each_launch_its_count():
    """Tiles of different split counts over one plan (the tile sweep does this): each
    launch reads the count it asked for, always at the one address a graph captures."""
    batch = Batch([("decode", 1, 300), ("tree", 9, 200)], 16, 4, 2, 32, torch.float32, seed=3)
    plan = batch.plan()
    addresses = set()
    for splits in (4, 8, 4, 2, 8):
        tile = TileShape(block_q=16, group_p=2, tile_n=16 if splits == 8 else 32, num_splits=splits, min_rows=16)
        out = triton_ops.unified_attention(batch.query, batch.k_cache, batch.v_cache, plan, batch.scale, tile=tile)
        torch.testing.assert_close(out.float(), batch.expected(), atol=1e-4, rtol=1e-4)
        assert int(plan.split_tensor[0]) == splits
        addresses.add(plan.split_tensor.data_ptr())
    assert len(addresses) == 1
