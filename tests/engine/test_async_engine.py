"""AsyncEngine: streaming deltas, shared steps, cancellation, back-pressure, failures, shutdown."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.engine.async_stream import held_back_length
from pagedtree.engine.errors import EngineOverloadedError, EngineStoppedError

PROMPTS = ["Hello world", "def add(a, b):", "The quick brown fox", "Paged attention"]


@pytest.fixture(scope="module")
def engine(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256)
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def llm(tiny_text_model):
    return LLM(str(tiny_text_model.path), block_size=4, max_model_len=256)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(engine, prompt, params, request_id=None):
    outs = [out async for out in engine.generate(prompt, params, request_id)]
    return outs


async def wait_all_blocks_free(engine, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats["num_free_blocks"] == stats["num_total_blocks"] and not engine.num_active_requests:
            await engine.call(lambda e: e.block_manager.check_invariants())
            return stats
        assert time.monotonic() < deadline, f"blocks not freed: {stats}"
        await asyncio.sleep(0.01)


def test_streamed_deltas_equal_llm_generate(engine, llm):
    params = greedy(12)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))

    for outs, exp in zip(asyncio.run(main()), expected):
        final = outs[-1]
        assert final.finished and all(not o.finished for o in outs[:-1])
        delta = final.outputs[0]
        assert "".join(o.outputs[0].delta_text for o in outs) == exp.outputs[0].text == delta.text
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == exp.outputs[0].token_ids
        assert delta.finish_reason == "length" and delta.just_finished
        assert final.prompt_token_ids == exp.prompt_token_ids
        assert final.metrics.num_prompt_tokens == len(exp.prompt_token_ids)


def test_concurrent_requests_share_steps(engine):
    params = greedy(10)

    async def main():
        before = await engine.get_stats()
        results = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS * 2))
        after = await engine.get_stats()
        return results, after["num_forward_passes"] - before["num_forward_passes"]

    results, passes = asyncio.run(main())
    assert all(len(r[-1].outputs[0].token_ids) == 10 for r in results)
    # 8 requests x 10 tokens alone would need >= 80 forward passes.
    assert passes < 40, passes
    # Identical prompts give identical greedy outputs whatever they were batched with.
    for a, b in zip(results[:4], results[4:]):
        assert a[-1].outputs[0].token_ids == b[-1].outputs[0].token_ids


def test_cancelling_the_consumer_aborts_and_frees_blocks(engine):
    finished = []
    engine.add_metrics_listener(finished.append)

    async def main():
        seen = asyncio.Event()

        async def consume():
            async for out in engine.generate("Hello world", greedy(200), "cancel-me"):
                if len(out.outputs[0].token_ids) >= 3:
                    seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await wait_all_blocks_free(engine)

    stats = asyncio.run(main())
    assert stats["num_requests_running"] == 0
    metrics = next(m for m in finished if m.request_id == "cancel-me")
    assert metrics.finish_reason == "abort"
    assert 3 <= metrics.num_generation_tokens < 200


def test_breaking_out_of_the_loop_aborts(engine):
    async def main():
        gen = engine.generate("def add", greedy(200), "break-me")
        async for out in gen:
            if out.outputs[0].token_ids:
                break
        await gen.aclose()
        return await wait_all_blocks_free(engine)

    asyncio.run(main())


def test_abort_ends_the_stream_with_abort(engine):
    async def main():
        stream = await engine.add_request("Hello", greedy(200), "abort-me")
        first = await stream.__anext__()
        assert await engine.abort("abort-me") is True
        rest = [out async for out in stream]
        assert await engine.abort("abort-me") is False
        await wait_all_blocks_free(engine)
        return first, rest

    first, rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "prompt must not be empty"),
        ({"prompt_token_ids": [10**6]}, None, "outside the vocabulary"),
        ("word " * 300, None, "max_model_len"),
        ("Hello", "not params", "SamplingParams"),
    ],
)
def test_bad_input_raises_value_error_before_streaming(engine, prompt, params, match):
    async def main():
        gen = engine.generate(prompt, params)
        with pytest.raises(ValueError, match=match):
            await gen.__anext__()
        # The engine keeps serving.
        return await collect(engine, "Hello", greedy(3))

    assert asyncio.run(main())[-1].finished
    assert engine.num_active_requests == 0 and engine.num_waiting_requests == 0


def test_a_refused_prompt_is_freed_at_once(engine):
    """A refused request leaves nothing for the cycle collector: its exception crosses
    from the engine thread through a future, and a traceback holding the frames that
    hold that future kept each refused prompt's token ids until a full collection."""

    async def refuse(prompt):
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request(prompt, greedy(3))

    async def main():
        await refuse("word " * 300)  # too many tokens once tokenized (the engine thread refuses it)
        await refuse({"prompt_token_ids": [5] * 300})  # refused before the engine thread
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                await refuse("word " * 300)
                await refuse({"prompt_token_ids": [5] * 300})
            gc.collect()
            kept = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("pagedtree")
                    or type(o).__name__ == "frame"]
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            gc.enable()
        return kept

    assert asyncio.run(main()) == []


def test_check_context_rejects_max_tokens_over_the_context(engine):
    async def main():
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request("Hello", greedy(300), check_context=True)
        # Without the check the request is cut at the context limit instead.
        outs = await collect(engine, {"prompt_token_ids": [5] * 250}, greedy(300))
        return outs[-1].outputs[0]

    out = asyncio.run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_duplicate_request_id_is_rejected(engine):
    async def main():
        stream = await engine.add_request("Hello", greedy(50), "dup")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("Hello", greedy(5), "dup")
        await stream.aclose()
        await wait_all_blocks_free(engine)

    asyncio.run(main())


def test_stop_strings_are_held_back_while_streaming(engine, llm):
    full = llm.generate(["The quick brown"], greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = full[4:7]
    expected = llm.generate(["The quick brown"], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]

    async def main():
        return await collect(engine, "The quick brown", greedy(24, stop=[stop]))

    outs = asyncio.run(main())
    released = ""
    for out in outs:
        released += out.outputs[0].delta_text
        assert expected.text.startswith(released)
    assert released == expected.text and outs[-1].outputs[0].finish_reason == "stop"


def test_held_back_length():
    assert held_back_length("hello wo", ["world"]) == 2
    assert held_back_length("hello", ["xyz", "lo!"]) == 2
    assert held_back_length("hello", ["abc"]) == 0
    assert held_back_length("", ["abc"]) == 0


def test_n_continuations_stream_per_index(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)

    async def main():
        return await collect(engine, "Hello world", params)

    outs = asyncio.run(main())
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    for i in range(3):
        joined = [t for o in outs for t in o.outputs[i].delta_token_ids]
        assert joined == final.outputs[i].token_ids and len(joined) == 6
        assert sum(o.outputs[i].just_finished for o in outs) == 1


def test_metrics_listener_gets_latencies(engine):
    got = []
    engine.add_metrics_listener(got.append)

    async def main():
        await collect(engine, "Hello world", greedy(8), "timed")

    asyncio.run(main())
    m = next(m for m in got if m.request_id == "timed")
    assert m.finish_reason == "length" and m.num_generation_tokens == 8
    assert 0 < m.time_to_first_token <= m.e2e_latency
    assert len(m.inter_token_latencies) == 7 and all(x >= 0 for x in m.inter_token_latencies)


def test_overload_is_rejected_before_queueing(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=128, max_waiting_requests=2)

    async def main():
        release = threading.Event()
        # Hold the engine thread so the first two requests stay waiting.
        blocker = asyncio.ensure_future(engine.call(lambda e: release.wait(10)))
        first = [asyncio.ensure_future(collect(engine, "Hello", greedy(3))) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert engine.num_waiting_requests == 2
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
            await engine.add_request("Hello", greedy(3))
        release.set()
        await blocker
        done = await asyncio.gather(*first)
        # Once they generate, the queue has room again.
        again = await collect(engine, "Hello", greedy(3))
        await engine.shutdown()
        return done, again

    done, again = asyncio.run(main())
    assert all(d[-1].outputs[0].finish_reason == "length" for d in done)
    assert again[-1].finished


def test_a_request_of_n_choices_counts_n_against_the_waiting_bound(tiny_text_model):
    """Each of a request's ``n`` choices is a sequence the engine runs: one request
    cannot queue more work than the bound allows by asking for many choices."""
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=128, max_waiting_requests=4)

    async def main():
        release = threading.Event()
        blocker = asyncio.ensure_future(engine.call(lambda e: release.wait(10)))
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests=4"):
            await engine.add_request("Hello", greedy(3, n=5))
        first = asyncio.ensure_future(collect(engine, "Hello", greedy(3, n=3)))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError, match="3 sequences are already waiting"):
            await engine.add_request("Hello", greedy(3, n=2))
        release.set()
        await blocker
        done = await first
        again = await collect(engine, "Hello", greedy(3, n=4))  # room again once they generate
        await engine.shutdown()
        return done, again

    done, again = asyncio.run(main())
    assert len(done[-1].outputs) == 3 and len(again[-1].outputs) == 4


def test_a_failing_request_ends_with_error_and_others_finish(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=128)
    poison = 299

    def install_fault(llm_engine):
        model = llm_engine.runner.model
        original = model.forward

        def faulty(input_ids, positions, *args, **kwargs):
            if bool(((input_ids == poison) & (positions == 1)).any()):
                raise RuntimeError("injected fault")
            return original(input_ids, positions, *args, **kwargs)

        model.forward = faulty

    async def main():
        await engine.call(install_fault)
        good = asyncio.ensure_future(collect(engine, {"prompt_token_ids": [5, 6, 7]}, greedy(5)))
        bad = asyncio.ensure_future(collect(engine, {"prompt_token_ids": [8, poison, 9]}, greedy(5)))
        results = await asyncio.gather(good, bad)
        await wait_all_blocks_free(engine)
        await engine.shutdown()
        return results

    good, bad = asyncio.run(main())
    assert good[-1].outputs[0].finish_reason == "length" and good[-1].error is None
    assert bad[-1].finished and bad[-1].outputs[0].finish_reason == "error"
    assert "injected fault" in bad[-1].error


def test_shutdown_aborts_in_flight_and_refuses_new_work(tiny_text_model):
    engine = AsyncEngine(str(tiny_text_model.path), block_size=4, max_model_len=256)

    async def main():
        short = asyncio.ensure_future(collect(engine, "Hello", greedy(2)))
        long = asyncio.ensure_future(collect(engine, "Hello", greedy(250)))
        await short
        # Hold the engine thread between steps until the grace period is over, so the
        # long request is certain to be in flight when it ends (no race with its speed).
        release = threading.Event()
        hold = asyncio.ensure_future(engine.call(lambda e: release.wait(30)))
        stopping = asyncio.ensure_future(engine.shutdown(grace_period=0.3))
        await asyncio.sleep(0.6)
        assert not long.done() and not stopping.done()
        with pytest.raises(EngineStoppedError):
            await engine.add_request("Hello", greedy(2))
        release.set()
        await hold
        await stopping
        return await short, await long

    short, long = asyncio.run(main())
    assert short[-1].outputs[0].finish_reason == "length"
    assert long[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running


def test_from_config_and_load_errors(tiny_text_model, tmp_path):
    from pagedtree.config import EngineConfig

    engine = AsyncEngine.from_config(EngineConfig(model=str(tiny_text_model.path), max_model_len=64))
    assert engine.max_model_len == 64 and engine.tokenizer is not None
    asyncio.run(engine.shutdown())
    with pytest.raises(ValueError, match="missing"):
        AsyncEngine(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AsyncEngine(str(tiny_text_model.path), max_waiting_requests=0)
