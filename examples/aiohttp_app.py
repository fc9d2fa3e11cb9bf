"""Embed pagedtree in your own aiohttp application.

One process, one event loop: your routes call the ``AsyncEngine`` directly, and
pagedtree's OpenAI/TGI routes are mounted next to them under ``/llm`` (they share
the engine, so every request is batched together). Try:

    python examples/aiohttp_app.py --model smollm2-135m-instruct --port 8080
    curl -N 'localhost:8080/haiku?topic=autumn'            # your route, streamed text
    curl localhost:8080/stats                              # your route, engine counters
    curl localhost:8080/llm/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fib(n):", "max_tokens": 32}'  # pagedtree's OpenAI route
    curl localhost:8080/llm/metrics                        # Prometheus

Stopping it (Ctrl-C) lets in-flight requests finish for a few seconds, aborts the
rest and stops the engine thread.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from pagedtree import SamplingParams
from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.engine.errors import EngineOverloadedError
from pagedtree.entrypoints.api_server import run_server, setup_routes

ENGINE = web.AppKey("engine", AsyncEngine)


async def index(request: web.Request) -> web.Response:
    return web.Response(text="my app: /haiku?topic=..., /stats, and pagedtree under /llm/\n")


async def haiku(request: web.Request) -> web.StreamResponse:
    """A route of our own: stream a model's text as plain text while it is generated."""
    engine = request.app[ENGINE]
    topic = request.query.get("topic", "the sea")[:100]
    message = [{"role": "user", "content": f"Write a haiku about {topic}."}]
    tokenizer = engine.tokenizer
    prompt = (
        tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        if getattr(tokenizer, "chat_template", None)
        else f"A haiku about {topic}:\n"
    )
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=48)
    try:
        stream = await engine.add_request(prompt, params)  # validates and queues, or raises
    except EngineOverloadedError as exc:
        raise web.HTTPTooManyRequests(text=str(exc)) from exc
    response = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
    await response.prepare(request)
    # ``async with`` aborts the request (and frees its KV blocks) if the client leaves.
    async with stream:
        async for out in stream:
            await response.write(out.outputs[0].delta_text.encode())
    await response.write(b"\n")
    return response


async def stats(request: web.Request) -> web.Response:
    """Another route of our own: the engine's counters."""
    counters = request.app[ENGINE].stats()
    return web.json_response({k: v for k, v in counters.items() if isinstance(v, (int, float))})


def build(engine: AsyncEngine, api_key: str | None) -> web.Application:
    """Our app: our routes plus pagedtree's under /llm (only those need the API key)."""
    app = web.Application()
    app[ENGINE] = engine
    app.router.add_get("/", index)
    app.router.add_get("/haiku", haiku)
    app.router.add_get("/stats", stats)
    setup_routes(app, engine, prefix="/llm", api_key=api_key, grace_period=5.0)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded Qwen2.5-Coder-1.5B)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /llm routes")
    args = parser.parse_args()

    engine = AsyncEngine(args.model, device=args.device, max_model_len=args.max_model_len, max_waiting_requests=256)
    run_server(build(engine, args.api_key), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
