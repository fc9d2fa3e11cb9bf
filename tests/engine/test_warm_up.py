"""The warm-up before serving: it runs every kind of step once, then leaves no trace."""

from __future__ import annotations

import asyncio

import pytest

from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.engine.warm_up import warm_up
from pagedtree import LLM


def _stop(engine: AsyncEngine) -> None:
    asyncio.run(engine.shutdown())


def test_an_async_engine_warms_up_before_it_is_ready(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256)
    try:
        stats = engine.stats()
        assert stats["num_forward_passes"] >= 4  # a prefill and the decode steps ran
        # ... but the counters a client sees start at zero, and nothing is left running.
        assert stats["num_prompt_tokens"] == 0 and stats["num_generated_tokens"] == 0
        assert stats["num_failed_requests"] == 0 and stats["prefix_cache_queries"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    finally:
        _stop(engine)
    cold = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256, warm_up=False)
    try:
        assert cold.stats()["num_forward_passes"] == 0
    finally:
        _stop(cold)


def test_the_warm_up_takes_every_path_and_fits_short_contexts(tiny_text_model, monkeypatch):
    """A prompt longer than the in-place attention kernel takes (SDPA), greedy, seeded
    and unseeded draws with logprobs, penalties and n=2; within any max_model_len."""
    import pagedtree.worker.model_runner as model_runner

    llm = LLM(str(tiny_text_model.path), block_size=4, max_model_len=256)
    seen = {"seeded": 0, "unseeded": 0, "greedy": 0, "logprobs": 0, "penalty": 0}
    real = model_runner.sample_rows

    def spy(logits, rows):
        for row in rows:
            kind = "greedy" if row.params.greedy else "seeded" if row.coupling_seed is not None else "unseeded"
            seen[kind] += 1
            seen["logprobs"] += row.params.logprobs is not None
            seen["penalty"] += row.params.repetition_penalty != 1.0
        return real(logits, rows)

    monkeypatch.setattr(model_runner, "sample_rows", spy)
    widths = []
    runner = llm.engine.runner
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda plan, *args: widths.append(max(c.num_tokens for c in plan.chunks))
                        or execute(plan, *args))
    report = warm_up(llm.engine)
    assert report.num_requests == 3 and report.num_steps == len(widths) >= 4
    assert max(widths) > 64  # the long-chunk attention path
    assert all(seen.values()), seen
    assert not llm.engine.has_unfinished_requests()
    short = LLM(str(tiny_text_model.path), block_size=4, max_model_len=8)
    assert warm_up(short.engine).num_steps >= 2


def test_the_warm_up_leaves_the_suffix_drafter_empty(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256,
                         speculative={"drafter": "suffix"})
    try:
        stats = engine.stats()
        assert stats["suffix_global_tokens"] == 0 and stats["suffix_global_nodes"] == 0
        assert stats["suffix_num_requests"] == 0 and stats["num_drafts"] == 0
    finally:
        _stop(engine)


def test_an_engine_that_cannot_warm_up_does_not_start(tiny_text_model, monkeypatch):
    import pagedtree.engine.engine_thread as engine_thread

    def broken(engine):
        raise RuntimeError("the first step failed")

    monkeypatch.setattr(engine_thread, "warm_up", broken)
    with pytest.raises(RuntimeError, match="the first step failed"):
        AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256)
