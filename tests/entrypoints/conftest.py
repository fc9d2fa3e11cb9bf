"""A tiny chat model and a real server on a loopback port, run in a background thread."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.entrypoints.api_server import app_runner, build_app

# A minimal ChatML-style template: the test tokenizer ships none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_path(tiny_text_model, tmp_path_factory):
    """The tiny text model with a chat template added to its tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny_chat") / "model"
    shutil.copytree(tiny_text_model.path, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


@dataclass
class LiveServer:
    """An app served by aiohttp on 127.0.0.1 from a background event loop (uvloop)."""

    engine: AsyncEngine
    app: web.Application
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner
    port: int
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, coro_fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run a coroutine function on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result(timeout)

    def stop(self) -> None:
        """Graceful shutdown (the app's on_shutdown stops the engine), then end the loop."""
        if self.loop.is_closed():
            return
        try:
            self.run(self.runner.cleanup, timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def start_server(app_factory: Callable[[AsyncEngine], web.Application], engine: AsyncEngine) -> LiveServer:
    """Serve ``app_factory(engine)`` on a free loopback port."""
    import uvloop

    loop = uvloop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    app = app_factory(engine)

    async def setup():
        runner = app_runner(app, shutdown_timeout=10)
        await runner.setup()
        # As run_server does: a deep accept queue, so a burst of clients is not
        # answered with dropped SYNs (a 1 s retransmit).
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, port = asyncio.run_coroutine_threadsafe(setup(), loop).result(30)
    return LiveServer(engine, app, loop, runner, port, thread)


def make_engine(path, **kwargs) -> AsyncEngine:
    return AsyncEngine(str(path), **({"block_size": 4, "max_model_len": 256} | kwargs))


@pytest.fixture(scope="module")
def server(chat_model_path):
    """The default server: no API key, no waiting bound."""
    live = start_server(lambda engine: build_app(engine, model_name="tiny"), make_engine(chat_model_path))
    yield live
    live.stop()


def wait_until_idle(live: LiveServer, timeout: float = 10.0) -> dict:
    """Wait until no request runs and every KV block is free; returns the engine stats."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = live.run(live.engine.get_stats)
        if stats["num_free_blocks"] == stats["num_total_blocks"] and live.engine.num_active_requests == 0:
            live.run(lambda: live.engine.call(lambda e: e.block_manager.check_invariants()))
            return stats
        assert time.monotonic() < deadline, f"blocks still in use: {stats}"
        time.sleep(0.02)


async def read_sse(response) -> list[str]:
    """The ``data`` payloads of a server-sent-events response, in order."""
    events = []
    async for line in response.content:
        line = line.decode().rstrip("\n")
        if line.startswith("data:"):
            events.append(line[5:].strip())
    return events
