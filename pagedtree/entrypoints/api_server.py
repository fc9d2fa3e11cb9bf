"""The aiohttp application: OpenAI and TGI protocols, ``/health`` and Prometheus ``/metrics``.

Two ways in:

* ``build_app(engine, ...)`` returns a ready ``web.Application`` (run it, or mount it
  with ``app.add_subapp("/llm/", build_app(engine))``);
* ``setup_routes(app, engine, prefix=...)`` adds the routes to your own application
  next to your routes, without touching them (no middlewares are installed).

``run_server`` serves an app on uvloop; ``pagedtree serve`` calls it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from aiohttp import web

from pagedtree.engine.async_engine import AsyncEngine
from pagedtree.entrypoints.limits import ServerLimits
from pagedtree.entrypoints.openai_api import OpenAIRoutes
from pagedtree.entrypoints.server_context import ServerConfig, ServerContext
from pagedtree.entrypoints.tgi_api import TGIRoutes

logger = logging.getLogger("pagedtree.server")

CONTEXT_KEY = web.AppKey("pagedtree_server", ServerContext)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def default_model_name(engine: AsyncEngine) -> str:
    """The name clients use in ``"model"``: the engine's model argument, else its folder."""
    return engine.config.model or engine.model_path.name


def setup_routes(
    app: web.Application,
    engine: AsyncEngine,
    prefix: str = "",
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    grace_period: float = 10.0,
    manage_engine: bool = True,
    limits: ServerLimits | None = None,
    metrics_require_key: bool | None = None,
    chat_template: str | None = None,
) -> ServerContext:
    """Add pagedtree's routes to ``app`` under ``prefix`` (e.g. ``"/llm"``).

    ``api_key`` protects every route but ``/health``, and ``/metrics`` too unless
    ``metrics_require_key=False`` (scrapers often carry no key; by default a keyed
    server keys its metrics). ``limits`` bounds what one request may ask
    (``ServerLimits``); ``chat_template`` replaces the tokenizer's chat template. With
    ``manage_engine``, the app's shutdown stops accepting requests, lets in-flight
    ones finish for up to ``grace_period`` seconds, aborts the rest and stops the
    engine thread.
    """
    prefix = prefix.rstrip("/")
    if prefix and not prefix.startswith("/"):
        raise ValueError(f"prefix must start with '/', got {prefix!r}")
    config = ServerConfig(
        model_name=model_name or default_model_name(engine),
        api_key=api_key or None,
        grace_period=grace_period,
        manage_engine=manage_engine,
        limits=limits or ServerLimits(),
        metrics_require_key=metrics_require_key,
        chat_template=chat_template,
    )
    ctx = ServerContext(engine, config)
    OpenAIRoutes(ctx).add_to(app, prefix)
    TGIRoutes(ctx).add_to(app, prefix)

    async def health(request: web.Request) -> web.Response:
        if engine.is_running and engine.is_healthy:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable"}, status=503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=ctx.metrics.render(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})

    app.router.add_get(prefix + "/health", ctx.endpoint(health, "openai", auth=False))
    app.router.add_get(prefix + "/metrics", ctx.endpoint(metrics, "openai", auth=bool(config.metrics_require_key)))

    if manage_engine:
        async def on_shutdown(_: web.Application) -> None:
            logger.info("shutting down: %d requests in flight, grace period %.1fs",
                        engine.num_active_requests, grace_period)
            await engine.shutdown(grace_period)

        app.on_shutdown.append(on_shutdown)
    if CONTEXT_KEY not in app:
        app[CONTEXT_KEY] = ctx
    return ctx


def build_app(engine: AsyncEngine, **options: Any) -> web.Application:
    """A new ``web.Application`` serving ``engine``; ``options`` are those of ``setup_routes``."""
    # Bodies are read within ServerLimits.max_request_bytes by the routes themselves.
    app = web.Application()
    setup_routes(app, engine, **options)
    return app


def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
               shutdown_timeout: float = 15.0, keepalive_timeout: float | None = None) -> None:
    """Serve ``app`` on uvloop until SIGINT/SIGTERM, then shut down gracefully.

    The first signal stops accepting connections and lets in-flight requests finish
    within the app's grace period (``on_shutdown``); a second one ends the grace
    period at once: what still runs is aborted, its clients get an error event, and
    the server still exits in order (never by an abort of the process). Later
    signals are ignored. ``keepalive_timeout`` (default: the app's
    ``ServerLimits.keepalive_timeout``) closes connections idle that long, which also
    bounds how long a client may take to send its request line and headers.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        uvloop = None
        logger.warning("uvloop is not installed; using the default asyncio loop")
    loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_serve(app, host, port, shutdown_timeout, keepalive_timeout))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def app_runner(app: web.Application, shutdown_timeout: float = 15.0,
               keepalive_timeout: float | None = None) -> web.AppRunner:
    """The ``AppRunner`` that ``run_server`` serves ``app`` with (for embedding it in
    your own loop): handlers cancelled when their client hangs up, connections
    without a complete request closed after ``keepalive_timeout`` (default: the
    app's ``ServerLimits.keepalive_timeout``)."""
    if keepalive_timeout is None:
        ctx = app.get(CONTEXT_KEY)
        keepalive_timeout = ctx.config.limits.keepalive_timeout if ctx is not None else ServerLimits().keepalive_timeout
    return web.AppRunner(
        app,
        # A client that hangs up cancels its handler, which aborts its request at once.
        handler_cancellation=True,
        keepalive_timeout=keepalive_timeout,
        shutdown_timeout=shutdown_timeout,
        access_log=None,  # the routes log each request themselves
    )


async def _serve(app: web.Application, host: str, port: int, shutdown_timeout: float,
                 keepalive_timeout: float | None) -> None:
    runner = app_runner(app, shutdown_timeout, keepalive_timeout)
    await runner.setup()
    # aiohttp's default accept queue (128) drops SYNs in a burst of clients, which
    # then wait a full 1 s retransmit; uvicorn and vLLM use 2048.
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    logger.info("serving on http://%s:%d (Ctrl+C to stop)", host, port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received = 0

    def on_signal(signum: int) -> None:
        nonlocal received
        received += 1
        if received == 1:
            logger.info("%s: shutting down gracefully (send it again to abort what still runs)",
                        signal.Signals(signum).name)
            stop.set()
        elif received == 2:
            logger.warning("%s again: aborting the requests still running", signal.Signals(signum).name)
            ctx = app.get(CONTEXT_KEY)
            if ctx is not None:
                ctx.engine.hurry_shutdown()
        else:
            logger.warning("%s: already shutting down", signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await stop.wait()
    finally:
        # Signals stay handled (by on_signal) until the engine thread has stopped:
        # Python's default handler would raise in the middle of the shutdown.
        await runner.cleanup()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


__all__ = ["build_app", "setup_routes", "run_server", "app_runner", "default_model_name", "ServerContext", "CONTEXT_KEY"]
