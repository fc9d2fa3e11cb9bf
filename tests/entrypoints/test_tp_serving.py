"""``pagedtree serve --tensor-parallel-size 2``: the server's happy path on two
ranks, and no rank left behind after a graceful exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedtree import SamplingParams
from tests.entrypoints.test_serve_cli import ROOT, free_port, http, wait_healthy


@pytest.mark.slow
def test_serve_with_two_ranks(chat_model_path):
    from pagedtree.engine.llm import LLM as OfflineLLM

    expected = OfflineLLM(str(chat_model_path), dtype="float32", block_size=4, max_model_len=128).generate(
        ["def add(a, b):"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False,
    )[0].outputs[0].text
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedtree.entrypoints.cli", "serve", "--model", str(chat_model_path),
         "--device", "cpu", "--dtype", "float32", "--port", str(port), "--block-size", "4", "--max-model-len", "128",
         "--served-model-name", "tiny", "--tensor-parallel-size", "2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_healthy(url, process)
        workers = children_of(process.pid)
        assert workers, "no rank was spawned"
        status, body = http(url + "/v1/completions", {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 10,
                                                      "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["text"] == expected
        status, body = http(url + "/v1/chat/completions",
                            {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        status, body = http(url + "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
        assert status == 200 and "generated_text" in body
        assert stream_text(url, {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 10, "temperature": 0,
                                 "ignore_eos": True, "stream": True}) == expected
        assert http(url + "/health")[0] == 200
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    assert "tensor parallel over 2 ranks" in stderr
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "a rank outlived the server"


def stream_text(url: str, body: dict) -> str:
    """The text of a streamed completion (server-sent events), pieces joined."""
    import json
    import urllib.request

    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=30) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                pieces.append(json.loads(line[5:])["choices"][0]["text"])
    return "".join(pieces)


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_a_dead_rank_fails_requests_and_health(chat_model_path):
    import aiohttp

    from pagedtree.entrypoints.api_server import build_app
    from tests.entrypoints.conftest import make_engine, start_server

    live = start_server(lambda engine: build_app(engine, model_name="tiny"),
                        make_engine(chat_model_path, dtype="float32", tensor_parallel_size=2))
    try:
        async def call(method: str, path: str, body: dict | None = None) -> int:
            async with aiohttp.ClientSession() as session:
                async with session.request(method, live.url + path, json=body) as response:
                    await response.read()
                    return response.status

        request = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
        assert live.run(lambda: call("POST", "/v1/completions", request)) == 200
        worker = live.run(lambda: live.engine.call(lambda e: e.tensor_parallel.processes[1].pid))
        os.kill(worker, signal.SIGKILL)
        status = live.run(lambda: call("POST", "/v1/completions", request))
        assert status in (500, 503)
        deadline = time.monotonic() + 10
        while live.run(lambda: call("GET", "/health")) != 503:
            assert time.monotonic() < deadline, "/health still answers 200 with a dead rank"
            time.sleep(0.1)
        assert live.run(lambda: call("POST", "/v1/completions", request)) == 503
    finally:
        live.stop()
