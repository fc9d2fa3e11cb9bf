"""Fixtures for tensor-parallel tests: a draft for the tiny target, engine helpers."""

from __future__ import annotations

import pytest

from tests.conftest import TinyModel
from tests.speculative.conftest import save_perturbed_copy


@pytest.fixture(scope="session")
def tp_draft(tiny_llama, tmp_path_factory) -> TinyModel:
    """A perturbed copy of ``tiny_llama`` (partial acceptance)."""
    return save_perturbed_copy(tiny_llama, tmp_path_factory.mktemp("tp_draft"), noise=0.1, seed=11)


def token_ids(outputs) -> list[list[int]]:
    """The generated token ids of each request's first completion."""
    return [out.outputs[0].token_ids for out in outputs]


def assert_ranks_in_step(llm, num_models: int = 1) -> list[dict]:
    """Every rank ran what rank 0 ran (forwards, block and slot copies) on a cache of
    as many blocks, and rank 0's block pool is whole again: the other ranks' caches
    are addressed by its block ids, so no rank holds a block."""
    report = (llm.engine.tensor_parallel.report() if llm.engine.tensor_parallel else [])
    assert len(report[0]["models"]) == num_models
    keys = ("forward_passes", "block_copies", "slot_copies", "kv_blocks")  # bytes differ with uneven head splits

    def steps(rank: dict) -> list[dict]:
        return [{k: model[k] for k in keys} for model in rank["models"]]

    for rank in report[1:]:
        assert steps(rank) == steps(report[0])
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.block_manager.check_invariants()
    for draft in llm.engine.speculation.drafts:
        assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    return report
