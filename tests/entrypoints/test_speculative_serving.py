"""Every endpoint serves tree speculation transparently: same greedy tokens, spec metrics exposed."""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import pytest
import torch

from pagedtree import LLM, SamplingParams
from pagedtree.entrypoints.api_server import build_app
from tests.entrypoints.conftest import make_engine, read_sse, start_server, wait_until_idle

@pytest.fixture(scope="module")
def draft_path(tiny_text_model, tmp_path_factory):
    """The target's weights with a little noise: a draft that is often, not always, right."""
    folder = tmp_path_factory.mktemp("tiny_chat_draft")
    model = copy.deepcopy(tiny_text_model.hf_model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * p.std() * 0.1)
    model.save_pretrained(str(folder))
    tiny_text_model.tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def spec_server(chat_model_path, draft_path):
    live = start_server(lambda e: build_app(e, model_name="tiny"),
                        make_engine(chat_model_path, dtype="float32", draft_model=str(draft_path),
                                    speculative={"adaptive": False}))  # a draft as big as its target never pays
    yield live
    live.stop()


def test_speculative_server_matches_plain_greedy_and_reports_acceptance(spec_server, chat_model_path):
    llm = LLM(str(chat_model_path), dtype="float32", block_size=4, max_model_len=256)
    prompts = ["Hello world", "def add(a, b):", "The quick brown fox"]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    async def main():
        async with aiohttp.ClientSession() as session:
            results = []
            for prompt in prompts:
                async with session.post(spec_server.url + "/v1/completions", json={
                        "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}) as r:
                    whole = await r.json()
                async with session.post(spec_server.url + "/generate_stream", json={
                        "inputs": prompt, "parameters": {"max_new_tokens": 16}}) as r:
                    events = [json.loads(e) for e in await read_sse(r)]
                results.append((whole, events))
            async with session.get(spec_server.url + "/metrics") as r:
                return results, await r.text()

    results, metrics = asyncio.run(main())
    for (whole, events), exp in zip(results, expected):
        assert whole["choices"][0]["text"] == exp.outputs[0].text
        n = len(events)
        assert [e["token"]["id"] for e in events] == exp.outputs[0].token_ids[:n]
        assert [e["index"] for e in events] == list(range(n))
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
    drafts = next(line for line in metrics.splitlines() if line.startswith("pagedtree:spec_decode_num_drafts_total"))
    assert float(drafts.rsplit(" ", 1)[1]) > 0
    assert 'pagedtree:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in metrics
    stats = wait_until_idle(spec_server)
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]


def test_speculative_stream_aborts_cleanly(spec_server):
    async def main():
        async with aiohttp.ClientSession() as session:
            response = await session.post(spec_server.url + "/v1/completions", json={
                "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0.8})
            await response.content.readline()
            response.close()

    asyncio.run(main())
    stats = wait_until_idle(spec_server)
    assert stats["draft_num_free_blocks"] == stats["draft_num_total_blocks"]
