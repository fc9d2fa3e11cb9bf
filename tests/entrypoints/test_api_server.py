"""The HTTP server over raw aiohttp: shapes, SSE, errors, auth, disconnects, overload, metrics, shutdown."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.entrypoints.api_server import build_app, setup_routes
from tests.entrypoints.conftest import make_engine, read_sse, start_server, wait_until_idle


@pytest.fixture(scope="module")
def llm(chat_model_path):
    return LLM(str(chat_model_path), block_size=4, max_model_len=256)


def post(server, path, body, headers=None, raw: bytes | None = None):
    """POST and return (status, headers, parsed JSON or SSE payload list)."""

    async def main():
        async with aiohttp.ClientSession() as session:
            kwargs = {"data": raw} if raw is not None else {"json": body}
            sent = dict(headers or {})
            if raw is not None:  # raw bytes still declared as JSON, as a client sending bad JSON does
                sent.setdefault("Content-Type", "application/json")
            async with session.post(server.url + path, headers=sent, **kwargs) as r:
                if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return r.status, r.headers, await read_sse(r)
                return r.status, r.headers, await r.json(content_type=None)

    return asyncio.run(main())


def get(server, path, headers=None):
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + path, headers=headers) as r:
                return r.status, r.headers, await r.text()

    return asyncio.run(main())


def test_health_models_info(server):
    assert get(server, "/health")[:1] == (200,)
    status, _, text = get(server, "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "tiny"
    info = json.loads(get(server, "/info")[2])
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == 256


def test_greedy_completion_equals_llm_generate(server, llm):
    expected = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0]
    status, headers, body = post(server, "/v1/completions", {
        "model": "tiny", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
    }, headers={"X-Request-Id": "my-id-1"})
    assert status == 200 and headers["X-Request-Id"] == "my-id-1" and body["id"] == "cmpl-my-id-1"
    choice = body["choices"][0]
    assert choice["text"] == expected.outputs[0].text and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(expected.prompt_token_ids), "completion_tokens": 12,
                             "total_tokens": len(expected.prompt_token_ids) + 12}


def test_streamed_completion_joins_to_the_non_streamed_text(server):
    body = {"prompt": "The quick brown", "max_tokens": 10, "temperature": 1.0, "seed": 123, "ignore_eos": True}
    _, _, whole = post(server, "/v1/completions", body)
    status, headers, events = post(server, "/v1/completions",
                                   body | {"stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


def test_a_streamed_token_makes_a_chunk_while_its_text_is_held_back(server):
    """A stop string holds back text that may be its start; the token steps still
    stream, as chunks of empty text (as vLLM's do): one chunk per token, the text
    joined at the end the same, so inter-token latencies count tokens."""
    body = {"prompt": "The quick brown", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, _, whole = post(server, "/v1/completions", body)
    text = whole["choices"][0]["text"]
    stop = text[: len(text) // 2] + "\u2603\u2603"  # the output's first half, then what it never says
    assert stop not in text
    _, _, events = post(server, "/v1/completions", body | {"stream": True, "stop": [stop]})
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert len(chunks) == 8 and any(c["text"] == "" for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks) == text
    messages = [{"role": "user", "content": "Hello"}]
    chat = {"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, _, whole = post(server, "/v1/chat/completions", chat)
    text = whole["choices"][0]["message"]["content"]
    stop = text[: len(text) // 2] + "\u2603\u2603"
    _, _, events = post(server, "/v1/chat/completions", chat | {"stream": True, "stop": [stop]})
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    contents = [d["content"] for d in deltas[1:] if "content" in d]  # after the role chunk
    assert len(contents) == 8 and "".join(contents) == text


def test_n_choices_and_token_prompts(server):
    status, _, body = post(server, "/v1/completions", {
        "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 1, "ignore_eos": True,
    })
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


def test_chat_completion_uses_the_chat_template(server, chat_model_path, llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    expected = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0]
    status, _, body = post(server, "/v1/chat/completions", {
        "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
    })
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.outputs[0].text}
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_tgi_generate_and_stream(server, llm):
    expected = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    status, _, body = post(server, "/generate", {"inputs": "Hello world",
                                                  "parameters": {"max_new_tokens": 6, "details": True}})
    assert status == 200 and body["generated_text"] == expected.text
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 6
    assert [t["id"] for t in details["tokens"]] == expected.token_ids
    status, _, events = post(server, "/generate_stream", {"inputs": "Hello world", "parameters": {"max_new_tokens": 6}})
    events = [json.loads(e) for e in events]
    assert [e["token"]["id"] for e in events] == expected.token_ids
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == expected.text == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"


def test_tgi_stop_sequence_finish_reason(server, llm):
    full = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[3:5]
    status, _, body = post(server, "/generate", {"inputs": "Hello world",
                                                  "parameters": {"max_new_tokens": 16, "stop": [stop], "details": True}})
    assert status == 200 and body["details"]["finish_reason"] == "stop_sequence"
    assert body["generated_text"] == full[: full.find(stop)]


BAD_OPENAI = [
    (None, b"{not json", 400, "not valid JSON"),
    ({"max_tokens": 4}, None, 400, "prompt is required"),
    ({"prompt": 5}, None, 400, "prompt must be"),
    ({"prompt": "hi", "max_tokens": "ten"}, None, 400, "max_tokens must be an integer"),
    ({"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens must be >= 1"),
    ({"prompt": "hi", "max_tokens": 1000}, None, 400, "max_tokens"),
    ({"prompt": "word " * 400, "max_tokens": 2}, None, 400, "max_model_len"),
    (None, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature must be a finite number"),
    ({"prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ({"prompt": "hi", "presence_penalty": 0.5}, None, 400, "presence_penalty is not supported"),
    ({"prompt": "hi", "model": "gpt-5"}, None, 404, "'gpt-5' does not exist"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
]


@pytest.mark.parametrize("body, raw, status, message", BAD_OPENAI)
def test_bad_openai_input_gets_a_json_error_naming_the_field(server, body, raw, status, message):
    got, _, error = post(server, "/v1/completions", body, raw=raw)
    assert got == status, error
    assert message in error["error"]["message"] and error["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_chat_input(server, body, param):
    status, _, error = post(server, "/v1/chat/completions", body)
    assert status == 400 and error["error"]["param"] == param


@pytest.mark.parametrize("body, message", [
    (b"[1, 2", "not valid JSON"),
    (b'{"inputs": "hi", "parameters": {"temperature": NaN}}', "parameters.temperature must be a finite number"),
    ({"inputs": 7}, "inputs must be a string"),
    ({"parameters": {}}, "inputs is required"),
    ({"inputs": ""}, "inputs must not be empty"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens must be >= 1"),
    ({"inputs": "hi", "parameters": {"top_k": -1}}, "parameters.top_k"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 400}}, "plus parameters.max_new_tokens (400) exceeds"),
    ({"inputs": "hi", "parameters": {"grammar": {"type": "xml", "value": "a"}}}, "parameters.grammar.type"),
    ({"inputs": "hi", "parameters": []}, "parameters must be a JSON object"),
])
def test_bad_tgi_input_gets_tgi_errors(server, body, message):
    raw = body if isinstance(body, bytes) else None
    status, _, error = post(server, "/generate", None if raw else body, raw=raw)
    assert status == 400 and error["error_type"] == "validation" and message in error["error"], error


def test_server_keeps_serving_after_bad_input_and_leaks_nothing(server):
    for body, raw, _, _ in BAD_OPENAI:
        post(server, "/v1/completions", body, raw=raw)
    status, _, body = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200
    wait_until_idle(server)
    status, _, text = get(server, "/metrics")
    assert 'pagedtree:http_errors_total{model_name="tiny",status="400"}' in text


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    finished = []
    server.engine.add_metrics_listener(finished.append)

    async def main():
        async with aiohttp.ClientSession() as session:
            response = await session.post(server.url + "/v1/completions", json={
                "prompt": "Hello", "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True,
            }, headers={"X-Request-Id": "leaver"})
            seen = 0
            async for line in response.content:
                seen += line.startswith(b"data:")
                if seen >= 3:
                    break
            response.close()  # drop the connection mid-stream

    asyncio.run(main())
    wait_until_idle(server)
    metrics = next(m for m in finished if m.label == "leaver")
    assert metrics.finish_reason == "abort" and metrics.num_generation_tokens < 240


def test_client_disconnect_while_queued_non_streaming_aborts(server):
    finished = []
    server.engine.add_metrics_listener(finished.append)
    release = threading.Event()
    generated_before = server.run(server.engine.get_stats)["num_generated_tokens"]
    # Hold the engine thread: the request sits in the queue, writing nothing that could fail.
    blocked = server.run(lambda: _start_blocker(server, release))

    async def main():
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(server.url + "/generate", json={
                    "inputs": "Hello", "parameters": {"max_new_tokens": 240},
                }, headers={"X-Request-Id": "quitter"}, timeout=aiohttp.ClientTimeout(total=0.2))
        # The watcher notices the closed connection within its poll interval.
        await asyncio.sleep(0.8)

    asyncio.run(main())
    release.set()
    server.run(lambda: _wait_for(blocked))
    wait_until_idle(server)
    # Cancelled before the engine took it, or aborted at once: either way nothing was generated.
    assert all(m.finish_reason == "abort" for m in finished if m.label == "quitter")
    assert server.run(server.engine.get_stats)["num_generated_tokens"] == generated_before


async def _wait_for(future):
    return await future


async def _start_blocker(server, release):
    return asyncio.ensure_future(server.engine.call(lambda e: release.wait(10)))


def test_metrics_page_has_vllm_names(server):
    post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    status, headers, text = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in [
        "pagedtree:num_requests_running", "pagedtree:num_requests_waiting", "pagedtree:kv_cache_usage_perc",
        "pagedtree:prefix_cache_queries_total", "pagedtree:prefix_cache_hits_total",
        "pagedtree:prompt_tokens_total", "pagedtree:generation_tokens_total",
        "pagedtree:time_to_first_token_seconds_bucket", "pagedtree:inter_token_latency_seconds_bucket",
        "pagedtree:e2e_request_latency_seconds_count", "pagedtree:spec_decode_num_drafts_total",
        "pagedtree:spec_decode_num_draft_tokens_total", "pagedtree:spec_decode_num_accepted_tokens_total",
        "pagedtree:spec_decode_num_accepted_tokens_per_pos",
    ]:
        assert name in text, name


def test_metrics_report_where_the_memory_is(server):
    """Process RSS, glibc's heap (in use / free / mmapped), Python's allocated blocks,
    and the heap trims: what an operator needs to tell a leak from a cache."""
    import platform

    post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    wait_until_idle(server)
    text = get(server, "/metrics")[2]
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values["process_resident_memory_bytes"] > 50 * 2**20
    assert values['pagedtree:python_allocated_blocks{model_name="tiny"}'] > 10_000
    assert 'pagedtree:malloc_trims_total{model_name="tiny"}' in values
    assert "pagedtree:suffix_tree_nodes" not in text  # no suffix drafter here
    if platform.libc_ver()[0] == "glibc":
        heap = {state: values[f'pagedtree:malloc_bytes{{model_name="tiny",state="{state}"}}']
                for state in ("in_use", "free", "mmapped")}
        assert heap["in_use"] > 10 * 2**20 and heap["free"] >= 0 and heap["mmapped"] >= 0


def test_the_engine_trims_the_heap_once_idle(chat_model_path):
    """A burst of work, then a second without any: the engine thread hands the free
    heap back to the OS (counted in /metrics), once per idle period."""
    import platform
    import time

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    live = start_server(lambda e: build_app(e, model_name="tiny"), make_engine(chat_model_path))
    try:
        trims = lambda: live.engine.stats()["num_heap_trims"]  # noqa: E731
        assert trims() == 0  # nothing ran since start: nothing to trim
        post(live, "/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        deadline = time.monotonic() + 10
        while trims() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.5)
        assert trims() == 1
        assert 'pagedtree:malloc_trims_total{model_name="tiny"} 1.0' in get(live, "/metrics")[2]
    finally:
        live.stop()


def test_metrics_read_speculative_counters_when_present(server):
    from pagedtree.entrypoints.prometheus_metrics import ServerMetrics

    class FakeEngine:
        num_waiting_requests = 1
        num_active_requests = 3

        def stats(self):
            return {"num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 7,
                    "accepted_tokens_per_position": [3, 2, 2]}

        def add_metrics_listener(self, _):
            pass

    text = ServerMetrics(FakeEngine(), "m").render().decode()
    assert 'pagedtree:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'pagedtree:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0' in text
    assert 'pagedtree:num_requests_running{model_name="m"} 2.0' in text


@pytest.fixture(scope="module")
def key_server(chat_model_path):
    live = start_server(lambda e: build_app(e, api_key="sekret"), make_engine(chat_model_path, max_model_len=64))
    yield live
    live.stop()


def test_api_key(key_server):
    body = {"prompt": "Hello", "max_tokens": 2}
    status, _, error = post(key_server, "/v1/completions", body)
    assert status == 401 and "API key" in error["error"]["message"]
    assert post(key_server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    status, _, error = post(key_server, "/generate", {"inputs": "Hello"})
    assert status == 401 and error["error_type"] == "authentication"
    assert post(key_server, "/v1/completions", body, headers={"Authorization": "Bearer sekret"})[0] == 200
    assert get(key_server, "/health")[0] == 200
    # A keyed server keys its metrics too (they tell who uses it how much).
    assert get(key_server, "/metrics")[0] == 401
    assert get(key_server, "/metrics", headers={"Authorization": "Bearer sekret"})[0] == 200
    assert get(key_server, "/v1/models")[0] == 401


def test_metrics_can_stay_open_with_a_key(chat_model_path):
    live = start_server(lambda e: build_app(e, api_key="k", metrics_require_key=False),
                        make_engine(chat_model_path, max_model_len=64))
    try:
        assert get(live, "/metrics")[0] == 200
        assert get(live, "/v1/models")[0] == 401
    finally:
        live.stop()


def test_overload_gives_429_in_both_protocols(chat_model_path):
    live = start_server(lambda e: build_app(e), make_engine(chat_model_path, max_waiting_requests=1))
    try:
        release = threading.Event()
        # Hold the engine thread so one request stays waiting; the next overflows.
        live.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(live.engine.call(lambda e: release.wait(10))))

        async def main():
            async with aiohttp.ClientSession() as session:
                first = asyncio.ensure_future(session.post(live.url + "/v1/completions",
                                                           json={"prompt": "Hello", "max_tokens": 2}))
                while live.engine.num_waiting_requests < 1:
                    await asyncio.sleep(0.01)
                async with session.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}) as r:
                    openai_error = (r.status, await r.json())
                async with session.post(live.url + "/generate", json={"inputs": "Hi"}) as r:
                    tgi_error = (r.status, await r.json())
                release.set()
                response = await first
                return openai_error, tgi_error, response.status

        openai_error, tgi_error, first_status = asyncio.run(main())
        assert openai_error[0] == 429 and "overloaded" in openai_error[1]["error"]["message"]
        assert tgi_error[0] == 429 and tgi_error[1]["error_type"] == "overloaded"
        assert first_status == 200
        wait_until_idle(live)
    finally:
        live.stop()


def test_routes_mount_next_to_user_routes_and_shutdown_is_graceful(chat_model_path):
    from aiohttp import web

    async def hello(request):
        return web.json_response({"hello": "world"})

    def factory(engine):
        app = web.Application()
        app.router.add_get("/hello", hello)
        setup_routes(app, engine, prefix="/llm", api_key="k", grace_period=0.1)
        return app

    # A stream far longer than the grace period (480 tokens take several times 0.1 s
    # here), so that it is still running when the grace period ends.
    live = start_server(factory, make_engine(chat_model_path, max_model_len=512))
    try:
        assert get(live, "/hello")[0] == 200  # the user's route needs no key
        assert get(live, "/llm/health")[0] == 200

        async def main():
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as session:
                response = await session.post(live.url + "/llm/v1/completions", json={
                    "prompt": "Hello", "max_tokens": 480, "ignore_eos": True, "stream": True})
                await response.content.readline()
                # Shut down while the stream runs: it is aborted after the grace period.
                stopper = asyncio.get_running_loop().run_in_executor(None, live.stop)
                events = await read_sse(response)
                await stopper
                return events

        events = asyncio.run(main())
        assert events[-1] == "[DONE]"
        assert "aborted" in json.loads(events[-2])["error"]["message"]
        assert not live.engine.is_running and not live.engine.is_healthy
    finally:
        live.stop()
