"""The aiohttp application: OpenAI and TGI protocols, ``/health`` and Prometheus ``/metrics``.

Two ways in:

* ``build_app(engine, ...)`` returns a ready ``web.Application`` (run it, or mount it
  with ``app.add_subapp("/llm/", build_app(engine))``);
* ``setup_routes(app, engine, prefix=...)`` adds the routes to your own application
  next to your routes, without touching them (no middlewares are installed).

``run_server`` serves an app on uvloop; ``pagedtree serve`` calls it.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from pagedtree.engine.async_engine import AsyncEngine
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
) -> ServerContext:
    """Add pagedtree's routes to ``app`` under ``prefix`` (e.g. ``"/llm"``).

    ``api_key`` protects every route but ``/health`` and ``/metrics`` (probes and
    scrapers usually carry no key). With ``manage_engine``, the app's shutdown stops
    accepting requests, lets in-flight ones finish for up to ``grace_period``
    seconds, aborts the rest and stops the engine thread.
    """
    prefix = prefix.rstrip("/")
    if prefix and not prefix.startswith("/"):
        raise ValueError(f"prefix must start with '/', got {prefix!r}")
    config = ServerConfig(
        model_name=model_name or default_model_name(engine),
        api_key=api_key or None,
        grace_period=grace_period,
        manage_engine=manage_engine,
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
    app.router.add_get(prefix + "/metrics", ctx.endpoint(metrics, "openai", auth=False))

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
    app = web.Application(client_max_size=16 * 1024**2)  # long prompts exceed aiohttp's 1 MiB default
    setup_routes(app, engine, **options)
    return app


def run_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
               shutdown_timeout: float = 15.0) -> None:
    """Serve ``app`` on uvloop until SIGINT/SIGTERM, then shut down gracefully."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep working without it
        uvloop = None
        logger.warning("uvloop is not installed; using the default asyncio loop")
    kwargs: dict[str, Any] = {}
    if uvloop is not None:
        kwargs["loop"] = uvloop.new_event_loop()
    web.run_app(
        app,
        host=host,
        port=port,
        shutdown_timeout=shutdown_timeout,
        # aiohttp's default accept queue (128) drops SYNs in a burst of clients,
        # which then wait a full 1 s retransmit; uvicorn and vLLM use 2048.
        backlog=2048,
        # A client that hangs up cancels its handler, which aborts its request at once.
        handler_cancellation=True,
        print=lambda message: logger.info("%s", message.strip()),
        **kwargs,
    )


__all__ = ["build_app", "setup_routes", "run_server", "default_model_name", "ServerContext", "CONTEXT_KEY"]
