"""The launch code's tile and split-KV choices (``attention_plan.choose_tile_shape``),
on the shapes of benchmarks/roofline.py: a 32-head, 8-KV-head, head-dim-128 model
on an H100 (132 SMs)."""

from __future__ import annotations

import pytest

from pagedtree.kernels.attention_plan import (
    MAX_ROWS,
    SPLIT_CHOICES,
    choose_tile_shape,
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
    # Short contexts: segments of fewer than 256 keys are not worth a split.
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
