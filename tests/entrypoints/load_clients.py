"""Streaming load clients and a /health prober, each run in its own process by ``test_load.py``.

``python -m tests.entrypoints.load_clients URL < jobs.json > results.json``: one
concurrent streaming client per job (``[prompt, max_tokens, delay_s]``; a client
connects after its delay), even ones on the OpenAI completions API, odd ones on
TGI's ``/generate_stream``.
``python -m tests.entrypoints.load_clients --probe URL``: GET /health every 20 ms
until stdin closes, then print the latencies. Separate processes keep the clients'
own work from competing with the server for the GIL, as real clients would not.
Imports only aiohttp and the standard library, so both start fast.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time

import aiohttp


async def openai_client(session: aiohttp.ClientSession, url: str, i: int, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    stamps, text, tokens, usage = [], "", 0, None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"i": i, "error": f"{r.status} {await r.text()}"}
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                return {"i": i, "error": chunk}
            if chunk["choices"]:
                stamps.append(time.perf_counter() - started)
                text += chunk["choices"][0]["text"]
                tokens += len(chunk["choices"][0]["logprobs"]["tokens"])
            else:
                usage = chunk["usage"]
    return {"kind": "openai", "i": i, "stamps": stamps, "text": text, "num_tokens": tokens, "usage": usage}


async def tgi_client(session: aiohttp.ClientSession, url: str, i: int, prompt: str, max_tokens: int) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}
    started = time.perf_counter()
    stamps, ids, indexes, final = [], [], [], None
    async with session.post(url + "/generate_stream", json=body) as r:
        if r.status != 200:
            return {"i": i, "error": f"{r.status} {await r.text()}"}
        async for line in r.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                return {"i": i, "error": event}
            stamps.append(time.perf_counter() - started)
            ids.append(event["token"]["id"])
            indexes.append(event["index"])
            if event["details"] is not None:
                final = event
    return {"kind": "tgi", "i": i, "stamps": stamps, "ids": ids, "indexes": indexes, "final": final}


async def run(url: str, jobs: list[list]) -> list[dict]:
    """Run every job at once; results in job order."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def client(i: int, prompt: str, max_tokens: int, delay: float) -> dict:
            await asyncio.sleep(delay)
            return await (openai_client if i % 2 == 0 else tgi_client)(session, url, i, prompt, max_tokens)

        return await asyncio.gather(*(client(i, *job) for i, job in enumerate(jobs)))


def probe(url: str) -> None:
    """Time GET /health on a fresh connection every 20 ms until stdin reaches EOF."""
    host, port = url.removeprefix("http://").split(":")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    probes, failures = [], []
    origin = time.perf_counter()
    while not stop.is_set():
        started = time.perf_counter()
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                failures.append(f"status {response.status}")
        except OSError as exc:
            failures.append(repr(exc))
        finally:
            conn.close()
        probes.append([started - origin, time.perf_counter() - started])
        stop.wait(0.02)
    json.dump({"probes": probes, "failures": failures}, sys.stdout)


def main() -> None:
    if sys.argv[1] == "--probe":
        probe(sys.argv[2])
        return
    jobs = json.load(sys.stdin)
    started = time.perf_counter()
    results = asyncio.run(run(sys.argv[1], jobs))
    json.dump({"seconds": time.perf_counter() - started, "results": results}, sys.stdout)


if __name__ == "__main__":
    main()
