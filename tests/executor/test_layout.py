"""Tensor parallelism's plain parts: the shard layout, the command encoding, the
rank addresses from the environment, the config's hand-over to the workers."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedtree.config import EngineConfig
from pagedtree.loading.resolve import resolve_config
from pagedtree.distributed.layout import ShardLayout, split_evenly
from pagedtree.executor.commands import decode_step, encode_step, pack_lists, unpack_lists
from pagedtree.executor.ranks import env_address
from pagedtree.worker.step_inputs import HostStep


def config(heads=4, kv_heads=2, inner=128, vocab=256):
    return LlamaConfig(hidden_size=64 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=inner, vocab_size=vocab)


def test_split_evenly_covers_the_range_in_order():
    for total in (1, 7, 9, 1536):
        for parts in (1, 2, 3, 4):
            runs = [split_evenly(total, parts, i) for i in range(parts)]
            assert [x for run in runs for x in run] == list(range(total))
            assert max(map(len, runs)) - min(map(len, runs)) <= 1


@pytest.mark.parametrize("size", [1, 2, 3])
def test_smollm2_shapes_split_by_kv_head_groups(size):
    # SmolLM2-135M: 9 query heads, 3 KV heads, 1536 MLP features, 49152 tokens.
    cfg = config(heads=9, kv_heads=3, inner=1536, vocab=49152)
    layouts = [ShardLayout.for_rank(cfg, r, size) for r in range(size)]
    assert [h for lay in layouts for h in lay.kv_heads] == [0, 1, 2]
    assert [h for lay in layouts for h in lay.q_heads] == list(range(9))
    for lay in layouts:  # a rank's query heads are those of its KV heads
        assert all(q // 3 in lay.kv_heads for q in lay.q_heads)
    assert [t for lay in layouts for t in lay.vocab] == list(range(49152))
    assert [f for lay in layouts for f in lay.intermediate] == list(range(1536))
    if size == 2:
        assert (len(layouts[0].q_heads), len(layouts[1].q_heads)) == (6, 3)


def test_more_ranks_than_kv_heads_replicate_them():
    cfg = config(heads=8, kv_heads=2)
    layouts = [ShardLayout.for_rank(cfg, r, 4) for r in range(4)]
    assert [list(lay.kv_heads) for lay in layouts] == [[0], [0], [1], [1]]
    assert [list(lay.q_heads) for lay in layouts] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_vocabulary_splits_in_equal_padded_slices():
    layouts = [ShardLayout.for_rank(config(vocab=301), r, 2) for r in range(2)]
    assert layouts[0].vocab == range(0, 151) and layouts[1].vocab == range(151, 301)
    assert {lay.vocab_rows for lay in layouts} == {151}


@pytest.mark.parametrize("size, message", [(3, "divide the model's 2 KV heads"), (8, "exceeds the model's 4 attention heads")])
def test_splits_that_cannot_work_say_why(size, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout.for_rank(config(), 0, size)


def test_packed_lists_round_trip():
    lists = [[1, 2, 3], [], [-1, 2**40], [7]]
    assert unpack_lists(pack_lists(lists)) == lists
    with pytest.raises(ValueError, match="past its lists"):
        unpack_lists(torch.cat([pack_lists(lists), torch.tensor([9])]))


def test_a_step_round_trips_with_trees_and_plain_chunks():
    step = HostStep(logit_rows=[2, 3, 4])
    step.add_request([5, 6], [0, 1], [16, 17], 2, [1], None)  # prefill chunk
    step.add_request([7, 8, 9], [4, 5, 5], [40, 41, 42], 6, [2, 3], [-1, 0, 0])  # a tree
    step.add_request([1], [30], [99], 31, [4, 5], None)  # decode
    assert decode_step(encode_step(step)) == step


def test_env_address_reads_torchrun_variables():
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    address = env_address(2, env)
    assert (address.host, address.port, address.rank, address.size, address.serve_store) == ("10.0.0.1", 29500, 1, 2, False)
    assert env_address(2, {**env, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}).serve_store
    assert env_address(2, {}) is None


@pytest.mark.parametrize("change, message", [
    ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 but tensor_parallel_size is 2"),
    ({"RANK": "2"}, "RANK must be set"),
    ({"MASTER_PORT": "0"}, "MASTER_ADDR and MASTER_PORT"),
    ({"RANK": "x"}, "torch.distributed environment"),
])
def test_env_address_rejects_inconsistent_environments(change, message):
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=message):
        env_address(2, {**env, **change})


def test_config_travels_as_json():
    cfg = EngineConfig(model="m", dtype=torch.bfloat16, draft_model=["d"], tensor_parallel_size=2,
                       draft_tensor_parallel_size=2, speculative={"tree": "static", "expansion": [2, 1]})
    back = EngineConfig.from_json(cfg.to_json())
    assert resolve_config(back).target.dtype == torch.bfloat16 and back.speculative == cfg.speculative
    assert (back.tensor_parallel_size, back.draft_tensor_parallel_size, back.draft_model) == (2, 2, ["d"])


@pytest.mark.parametrize("kwargs, message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer"),
    ({"tensor_parallel_size": 2, "draft_tensor_parallel_size": 3}, "draft_tensor_parallel_size must be 1"),
    ({"distributed_timeout": 0}, "distributed_timeout"),
])
def test_config_rejects_bad_parallel_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
