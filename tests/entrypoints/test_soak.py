"""Soak: a real ``pagedtree serve`` process under mixed valid and hostile clients.

For ``PAGEDTREE_SOAK_SECONDS`` (default 300) on loopback, several client loops run
side by side: streamed and plain completions, chat, TGI, disconnects mid-stream,
id collisions, oversized and malformed bodies, deep JSON, wrong content types,
slow headers. Afterwards every KV block is free, the engine thread is alive, and
the server's RSS is within 10% of what it was after the warm-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.entrypoints.test_serve_cli import ROOT, free_port, http, wait_healthy

DURATION = float(os.environ.get("PAGEDTREE_SOAK_SECONDS", "300"))
WARM_UP = min(30.0, DURATION / 5)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _valid(session: aiohttp.ClientSession, url: str, rng: random.Random, counts: dict) -> None:
    kind = rng.choice(["stream", "plain", "chat", "tgi", "tgi_stream", "list", "n2"])
    max_tokens = rng.randint(1, 24)
    if kind in ("stream", "plain", "list", "n2"):
        body = {"prompt": ["Hello", "world"] if kind == "list" else "Hello " * rng.randint(1, 20),
                "max_tokens": max_tokens, "stream": kind == "stream", "temperature": rng.choice([0, 0.8]),
                "n": 2 if kind == "n2" else 1, "stop": ["xyz"] * rng.randint(0, 16)}
        path = "/v1/completions"
    elif kind == "chat":
        body = {"messages": [{"role": "user", "content": "Hi " * rng.randint(1, 10)}], "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    else:
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": max_tokens, "do_sample": rng.random() < 0.5}}
        path = "/generate_stream" if kind == "tgi_stream" else "/generate"
    headers = {"X-Request-Id": rng.choice(["victim", "victim#0", "victim#1", f"r{rng.random()}"])}
    async with session.post(url + path, json=body, headers=headers) as r:
        if rng.random() < 0.15 and body.get("stream", path.endswith("_stream")):
            await r.content.readline()  # leave mid-stream: the request must be aborted
            r.close()
            counts["dropped"] += 1
            return
        await r.read()
        counts[r.status] = counts.get(r.status, 0) + 1


async def _hostile(session: aiohttp.ClientSession, url: str, rng: random.Random, counts: dict) -> None:
    kind = rng.choice(["stops", "deep", "text_plain", "too_big", "bad_json", "template", "tiny_temp", "ids"])
    headers = {"Content-Type": "application/json"}
    if kind == "stops":
        data = json.dumps({"prompt": "Hi", "stop": ["x" * 1500] * 2000}).encode()
    elif kind == "deep":
        data = b"[" * 50_000
    elif kind == "text_plain":
        data, headers = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(), {"Content-Type": "text/plain"}
    elif kind == "too_big":
        data = b'{"prompt": "' + b"a" * 2_500_000 + b'"}'
    elif kind == "bad_json":
        data = b'{"prompt": "Hi", "max_tokens": '
    elif kind == "template":
        data = json.dumps({"messages": [{"role": "user", "content": "x"}],
                           "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"}}).encode()
    elif kind == "tiny_temp":
        data = json.dumps({"prompt": "Hi", "temperature": 1e-300, "top_p": 1e-300, "max_tokens": 3}).encode()
    else:
        data = json.dumps({"prompt": "Hi", "n": 2, "max_tokens": 3, "seed": 2**70}).encode()
    path = "/v1/chat/completions" if kind == "template" else "/v1/completions"
    async with session.post(url + path, data=data, headers=headers) as r:
        await r.read()
        counts[r.status] = counts.get(r.status, 0) + 1


def _slowloris(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            while True:
                time.sleep(1.0)
                s.sendall(b"X-Slow: 1\r\n")
        except OSError:
            return  # closed by the server: good


@pytest.mark.slow
def test_soak_mixed_clients(chat_model_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedtree.entrypoints.cli", "serve", "--model", str(chat_model_path),
         "--device", "cpu", "--port", str(port), "--max-model-len", "256", "--block-size", "4",
         "--max-waiting-requests", "64", "--keepalive-timeout", "3", "--log-level", "warning"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(url, process)
        counts: dict = {"dropped": 0}
        health_worst = 0.0
        baseline: list[int] = []

        async def client(seed: int, hostile: bool, until: float) -> None:
            rng = random.Random(seed)
            async with aiohttp.ClientSession() as session:
                while time.monotonic() < until:
                    try:
                        await (_hostile if hostile else _valid)(session, url, rng, counts)
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        counts["client_errors"] = counts.get("client_errors", 0) + 1

        async def probe(until: float) -> None:
            nonlocal health_worst
            started_at = time.monotonic()
            async with aiohttp.ClientSession() as session:
                while time.monotonic() < until:
                    t = time.monotonic()
                    async with session.get(url + "/health") as r:
                        assert r.status == 200
                    health_worst = max(health_worst, time.monotonic() - t)
                    if not baseline and time.monotonic() - started_at > WARM_UP:
                        baseline.append(rss_bytes(process.pid))
                    await asyncio.sleep(0.2)

        async def main() -> None:
            until = time.monotonic() + DURATION
            loop = asyncio.get_running_loop()
            slow = [loop.run_in_executor(None, _slowloris, port) for _ in range(4)]
            await asyncio.gather(probe(until), *[client(i, hostile=i % 3 == 0, until=until) for i in range(12)])
            await asyncio.gather(*slow)

        asyncio.run(main())
        # Everything ended: no block in use, the engine thread alive, memory flat.
        deadline = time.monotonic() + 30
        while True:
            with urllib_open(url + "/metrics") as text:
                usage = _gauge(text, "pagedtree:kv_cache_usage_perc")
                running = _gauge(text, "pagedtree:num_requests_running") + _gauge(text, "pagedtree:num_requests_waiting")
            if usage == 0.0 and running == 0.0:
                break
            assert time.monotonic() < deadline, (usage, running)
            time.sleep(0.5)
        assert http(url + "/health")[0] == 200
        final = rss_bytes(process.pid)
        assert baseline and final <= 1.10 * baseline[0], (final, baseline)
        assert counts.get(200, 0) > 50 and counts.get(400, 0) > 10 and counts.get(500, 0) == 0, counts
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr[-3000:]
        print(f"soak: {DURATION:.0f} s, {counts}, /health worst {health_worst * 1000:.0f} ms, "
              f"RSS {baseline[0] / 2**20:.0f} -> {final / 2**20:.0f} MiB")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


class urllib_open:
    """``with urllib_open(url) as text``: a GET's body as text."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url, timeout=10) as r:
            return r.read().decode()

    def __exit__(self, *exc) -> None:
        return None


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
