"""The launch code's tile and split-KV choices (``tiles.choose_tile_shape``),
on the shapes of benchmarks/roofline.py: a 32-head, 8-KV-head, head-dim-128 model
on an H100 (132 SMs)."""

from __future__ import annotations

import pytest

from pagedtree.kernels.tiles import (
    GPU_TILE_N,
    MAX_ROWS,
    SM90_KEY_TILES,
    SPLIT_CHOICES,
    choose_tile_shape,
    sm90_key_tile,
    split_kv_cost,
)


def _shape(tokens: int, batch: int, context: int, capability: int = 90, head_dim: int = 128):
    return choose_tile_shape(tokens, 4, batch, 8, context, interpreted=False, num_sms=132, block_size=16,
                             capability=capability, head_dim=head_dim)


@pytest.mark.parametrize("tokens,rows,warps", [(1, 16, 4), (16, 64, 4), (32, 128, 8), (64, 256, 16)])
def test_a_tree_of_up_to_64_nodes_is_one_program_with_16_rows_per_warp(tokens, rows, warps):
    tile = _shape(tokens, 32, 1024)
    assert (tile.block_m, tile.num_warps) == (rows, warps) and tile.block_m <= MAX_ROWS


def test_sm80_at_head_dim_128_stops_at_128_rows():
    assert _shape(64, 32, 1024, capability=80).block_m == 128
    assert _shape(64, 32, 1024, capability=80, head_dim=64).block_m == 256


def test_split_kv_where_idle_sms_cost_more_than_partials():
    # A lone long decode: 8 programs for 132 SMs, tiny partials -> split wide.
    assert _shape(1, 1, 4096).num_splits == 16
    # A short context: the reduce launch costs more than the idle SMs it would fill.
    assert _shape(1, 1, 300).num_splits == 1
    # A full GPU: no split.
    assert _shape(1, 64, 4096).num_splits == 1
    # Eight 64-node trees: 64 programs; the partials of 256 rows per program cost
    # more than the idle SMs (the old rule split them in 2).
    assert _shape(64, 8, 1024).num_splits == 1


@pytest.mark.parametrize("batch", [1, 2, 8, 32])
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_the_split_chosen_is_the_cheapest_allowed(batch, tokens):
    context = 4096
    tile = _shape(tokens, batch, context)
    programs = batch * 8
    kv = programs * context * 128 * 2 * 2
    partials = batch * tokens * 4 * 8 * 130 * 8
    costs = {s: split_kv_cost(s, programs, kv, partials, 132) for s in SPLIT_CHOICES}
    assert costs[tile.num_splits] == min(costs.values())


def _tree(queries: int, group: int, capability: int = 90, head_dim: int = 128):
    return choose_tile_shape(queries, group, 32, 4, 4096, interpreted=False, num_sms=132, block_size=16,
                             capability=capability, head_dim=head_dim)


@pytest.mark.parametrize("group,block_q,root_side,programs", [
    (1, 64, True, 1), (2, 64, True, 1), (3, 65, False, 1), (4, 64, True, 1),
    (5, 33, False, 2), (6, 33, False, 2), (7, 33, False, 2), (8, 32, True, 2),
])
def test_a_64_node_tree_and_its_root_take_the_fewest_programs(group, block_q, root_side, programs):
    # The engine sends a 64-node tree as 65 queries: tree tiles, the group's heads
    # packed (6 rows a token at 6 heads per KV head), the root aside where that
    # saves a program, tokens spread evenly over the programs.
    tile = _tree(65, group)
    assert (tile.block_q, tile.root_side) == (block_q, root_side)
    assert -(-(65 - tile.first_query()) // tile.block_q) == programs
    assert tile.block_q * group <= tile.block_m <= MAX_ROWS and tile.num_warps == (
        8 if tile.block_m == 256 and root_side else max(4, tile.block_m // 16))


def test_the_root_aside_also_saves_padded_rows():
    # 17 queries at 4 heads per KV head: 16 x 4 = 64 rows and 16 for the root, not 128.
    tile = _tree(17, 4)
    assert tile.root_side and tile.block_m == 64 and tile.root_m == 16


@pytest.mark.parametrize("capability", [80, 86, 89, 120])
def test_gpus_without_warpgroup_mma_stop_at_128_rows_at_head_dim_128(capability):
    assert _tree(65, 4, capability).block_m == 128 and not _tree(65, 4, capability).root_side
    assert _tree(65, 4, capability, head_dim=64).block_m == 256
    assert _tree(65, 4, 100).block_m == 256  # sm_100: tensor-memory accumulators


@pytest.mark.parametrize("group", [4, 5, 6, 7, 8])
def test_sm100_lets_eight_warp_programs_use_their_registers(group):
    # ptxas holds 8-warp programs to 128 registers on sm_100 unless told, and the
    # packed groups' 65-query tiles spilled there; other GPUs leave the limit to ptxas.
    tile = _tree(65, group, 100)
    assert tile.num_warps == 8 and tile.max_registers == 255
    assert _tree(65, group, 90).max_registers is None and _tree(65, group, 120).max_registers is None
    assert _tree(65, group, 80).max_registers is None


@pytest.mark.parametrize("tokens,batch,capability,head_dim,tile_n", [
    (1, 1, 90, 128, 64),            # one decode: 8 programs
    (1, 8, 90, 128, 64),            # 64 programs: half a wave of 132 SMs
    (16, 8, 90, 128, 32),           # 16-node trees: 64-row programs (64 keys spill at head dim 128)
    (32, 1, 90, 128, 32),           # 128-row programs
    (64, 1, 90, 128, GPU_TILE_N),   # 256-row programs: 32 keys spill at head dim 128
    (16, 8, 90, 64, 64),            # head dim 64: 64 keys up to 128 rows,
    (64, 1, 90, 64, 32),            # 32 at 256
    (1, 16, 90, 128, GPU_TILE_N),   # 128 programs: a wave
    (1, 1, 80, 128, GPU_TILE_N),    # not measured off sm_90
    (1, 1, 100, 128, GPU_TILE_N),
])
def test_sm90_takes_the_widest_key_tiles_that_do_not_spill_in_small_launches(tokens, batch, capability, head_dim,
                                                                             tile_n):
    assert _shape(tokens, batch, 1024, capability=capability, head_dim=head_dim).tile_n == tile_n


def test_the_sm90_key_tile_table_narrows_with_rows_and_head_dim():
    assert [sm90_key_tile(rows, 128) for rows in (16, 32, 64, 128, 256)] == [64, 32, 32, 32, GPU_TILE_N]
    assert [sm90_key_tile(rows, 64) for rows in (16, 128, 256)] == [64, 64, 32]
    assert sm90_key_tile(16, 80) == 64 and sm90_key_tile(16, 256) == GPU_TILE_N  # padded head dims
    for _, limits in SM90_KEY_TILES:  # each a narrower tile for more rows
        assert [rows for rows, _ in limits] == sorted(rows for rows, _ in limits)
        assert [keys for _, keys in limits] == sorted((keys for _, keys in limits), reverse=True)


def test_a_short_decode_splits_into_segments_of_two_wide_tiles():
    # One request over 1,024 keys on sm_90: 8 segments of 128 keys (8 programs unsplit).
    tile = _shape(1, 1, 1024)
    assert (tile.tile_n, tile.num_splits) == (64, 8)
