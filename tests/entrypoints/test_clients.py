"""Real clients against the real server: the ``openai`` package and TGI's ``text_generation``."""

from __future__ import annotations

import asyncio

import pytest

from pagedtree import LLM, SamplingParams
from pagedtree.entrypoints.api_server import build_app
from tests.entrypoints.conftest import make_engine, start_server, wait_until_idle

openai = pytest.importorskip("openai")
text_generation = pytest.importorskip("text_generation")


@pytest.fixture(scope="module")
def llm(chat_model_path):
    return LLM(str(chat_model_path), block_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def greedy(llm, prompt, n):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]


# ------------------------------------------------------------------ openai
def test_openai_completion_greedy_equals_llm(client, llm):
    expected = greedy(llm, "def add(a, b):", 10)
    out = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


def test_openai_streaming_equals_non_streaming_for_a_seed(client):
    kwargs = dict(model="tiny", prompt="The quick brown", max_tokens=12, temperature=0.9, top_p=0.95, seed=42,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_openai_chat_streaming_and_not(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_openai_logprobs(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    comp = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    assert len(comp.choices[0].logprobs.tokens) == 3 and len(comp.choices[0].logprobs.top_logprobs[0]) >= 1


def test_openai_errors_are_typed(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="Hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_openai_async_client_concurrent_streams(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(i):
            stream = await aclient.completions.create(model="tiny", prompt=f"Hello {i}", max_tokens=5 + i,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            return [c async for c in stream]

        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await aclient.close()

    results = asyncio.run(main())
    for i, chunks in enumerate(results):
        assert chunks[-1].choices[0].finish_reason == "length"
    wait_until_idle(server)


def test_openai_client_with_api_key(chat_model_path):
    live = start_server(lambda e: build_app(e, api_key="k1"), make_engine(chat_model_path, max_model_len=64))
    try:
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="k1", max_retries=0)
        model = good.models.list().data[0].id
        done = good.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 2 and done.choices[0].finish_reason == "length"
        bad = openai.OpenAI(base_url=live.url + "/v1", api_key="k2", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="x", prompt="Hi", max_tokens=2)
    finally:
        live.stop()


# --------------------------------------------------------- text_generation
def test_tgi_client_generate_greedy_equals_llm(server, llm):
    # TGI has no ignore_eos: compare with plain decoding that also stops at EOS.
    expected = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    tgi = text_generation.Client(server.url, timeout=30)
    out = tgi.generate("Hello world", max_new_tokens=8)
    assert out.details.generated_tokens == len(out.details.tokens) == len(expected.token_ids)
    assert [t.id for t in out.details.tokens] == expected.token_ids
    assert out.generated_text == expected.text
    assert out.details.finish_reason.value == {"length": "length", "stop": "eos_token"}[expected.finish_reason]
    assert out.details.seed is None  # greedy


def test_tgi_client_stream_joins_to_generate_for_a_seed(server):
    tgi = text_generation.Client(server.url, timeout=30)
    kwargs = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=50, seed=7)
    whole = tgi.generate("The quick brown", **kwargs)
    events = list(tgi.generate_stream("The quick brown", **kwargs))
    assert "".join(e.token.text for e in events if not e.token.special) == whole.generated_text
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert events[-1].generated_text == whole.generated_text
    assert events[-1].details.seed == 7 == whole.details.seed
    assert all(e.details is None for e in events[:-1])


def test_tgi_async_client(server):
    async def main():
        tgi = text_generation.AsyncClient(server.url, timeout=30)
        whole = await tgi.generate("Paged attention", max_new_tokens=6, stop_sequences=["\x00"])
        tokens = [e async for e in tgi.generate_stream("Paged attention", max_new_tokens=6)]
        return whole, tokens

    whole, tokens = asyncio.run(main())
    assert "".join(t.token.text for t in tokens) == tokens[-1].generated_text
    assert [t.token.id for t in tokens] == [t.id for t in whole.details.tokens]


def test_tgi_client_errors(server):
    tgi = text_generation.Client(server.url, timeout=30)
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        tgi.generate("Hello", max_new_tokens=500)
    with pytest.raises(text_generation.errors.ValidationError, match="typical_p"):
        tgi.generate("Hello", typical_p=0.5)
