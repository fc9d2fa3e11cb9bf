"""``pagedtree serve`` as a real process (uvloop, signals, graceful exit) and the example app."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if http(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def test_pagedtree_serve_runs_and_exits_gracefully(chat_model_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedtree.entrypoints.cli", "serve", "--model", str(chat_model_path),
         "--device", "cpu", "--port", str(port), "--api-key", "s3", "--max-model-len", "128",
         "--served-model-name", "tiny-chat"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_healthy(url, process)
        status, body = http(url + "/v1/chat/completions",
                            {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
                            {"Authorization": "Bearer s3", "X-Request-Id": "cli-req-1"})
        assert status == 200 and body["id"] == "chatcmpl-cli-req-1"
        assert http(url + "/v1/models")[0] == 401
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    assert "cli-req-1" in stderr  # request ids reach the logs
    assert "shutting down" in stderr
    assert "warmed up in" in stderr  # before it served anyone


def test_speculation_options_reach_the_engine():
    from pagedtree.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args([
        "serve", "--model", "m", "--draft-model", "d1", "d2", "--spec-tree", "static",
        "--spec-expansion", "2,1", "--spec-max-nodes", "6", "--no-spec-adaptive",
    ])
    kwargs = engine_kwargs(args)
    assert kwargs["draft_model"] == ["d1", "d2"]
    assert kwargs["speculative"] == {"adaptive": False, "tree": "static", "expansion": (2, 1), "max_nodes": 6}
    assert "draft_model" not in engine_kwargs(build_parser().parse_args(["serve", "--model", "m"]))


def test_example_app_serves_its_routes_next_to_pagedtree(chat_model_path):
    import asyncio
    import importlib.util

    import aiohttp

    from tests.entrypoints.conftest import make_engine, start_server, wait_until_idle

    spec = importlib.util.spec_from_file_location("aiohttp_app_example", ROOT / "examples" / "aiohttp_app.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    live = start_server(lambda engine: example.build(engine, api_key="k"), make_engine(chat_model_path))
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                async with session.get(live.url + "/haiku?topic=trees") as r:
                    haiku = (r.status, await r.text())
                async with session.get(live.url + "/stats") as r:
                    stats = await r.json()
                async with session.post(live.url + "/llm/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                        headers={"Authorization": "Bearer k"}) as r:
                    completion = r.status
                async with session.post(live.url + "/llm/v1/completions", json={"prompt": "Hi"}) as r:
                    unauthorized = r.status
                return haiku, stats, completion, unauthorized

        haiku, stats, completion, unauthorized = asyncio.run(main())
        assert haiku[0] == 200 and haiku[1].endswith("\n")
        assert stats["num_generated_tokens"] >= 1
        assert (completion, unauthorized) == (200, 401)
        wait_until_idle(live)
    finally:
        live.stop()


@pytest.mark.slow
def test_a_second_signal_hurries_the_shutdown_without_aborting_the_process(chat_model_path):
    """SIGTERM starts the grace period; a second SIGTERM ends it at once: the
    in-flight stream gets an error event and [DONE], and the process exits 0 (it
    used to die with SIGABRT, "terminate called without an active exception")."""
    import threading

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedtree.entrypoints.cli", "serve", "--model", str(chat_model_path),
         "--device", "cpu", "--port", str(port), "--max-model-len", "512", "--grace-period", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    events: list[str] = []
    try:
        wait_healthy(url, process)
        body = json.dumps({"prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})

        def read_stream() -> None:
            with urllib.request.urlopen(request, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data:"):
                        events.append(line.decode().strip())

        reader = threading.Thread(target=read_stream)
        reader.start()
        while not events:
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        reader.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]  # the stream ended with an error event, not cut off
    assert "aborting the requests still running" in stderr
