"""Routes for probes, scrapers and operators on the HTTP serving port, beside the OpenAI API.

Open (no bearer token, security.OPEN_HTTP_PATHS: they carry no request content): GET /metrics
(the Prometheus registry, the same as --metrics-port serves: the Gateway API Inference Extension
scrapes the serving port), GET /version and GET /health/ready (200 only once the model service
computed a real step, and not while it is down or the server drains). Behind the token: GET /load
(queue and batch now) and, with --enable-reset-prefix-cache, POST /reset_prefix_cache.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Awaitable, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from scheduler_service.api.admission import Admission
from scheduler_service.api.streams import refreshed
from scheduler_service.metrics_text import TextRenderer


def _version() -> str:
    try:
        return importlib.metadata.version("planserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


class ServeMetrics:
    """ASGI middleware answering GET /metrics itself: a gateway scrapes it every 50 ms, so it
    skips the framework's routing and exception layers (docs/benchmarks.md, the scrape cost)."""

    def __init__(
        self,
        app,
        registry: Optional[CollectorRegistry] = None,
        render: Optional[Callable[[], Awaitable[bytes]]] = None,
    ):
        """registry: rendered here; render: /metrics rendered elsewhere (a frontend process
        asks the engine core, whose registry is the one set of metrics)."""
        self.app = app
        self.text = TextRenderer(registry) if registry is not None else None
        self.render = render

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        if self.text is not None:
            body = self.text.render()
        else:
            assert self.render is not None  # one of the two is given
            body = await self.render()
        headers = [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def add_ops_routes(
    app: FastAPI,
    admission: Admission,
    registry: CollectorRegistry | None,
    is_ready: Callable[[], bool],
    metrics_text: Optional[Callable[[], Awaitable[bytes]]] = None,
) -> None:
    """Adds the routes above to `app`; /metrics only when there is a registry (or
    metrics_text, which renders it elsewhere)."""
    version = _version()

    if registry is not None or metrics_text is not None:
        app.add_middleware(ServeMetrics, registry=registry, render=metrics_text)

    @app.get("/version")
    async def version_route() -> dict:
        return {"version": version}

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        if is_ready():
            return JSONResponse(content={"status": "ready"})
        return JSONResponse(status_code=503, content={"status": "not ready"})

    if admission.config.enable_reset_prefix_cache:
        app.post("/reset_prefix_cache")(_reset_prefix_cache(admission))

    @app.get("/load")
    async def load() -> JSONResponse:
        serving = admission.serving
        if serving is None:
            return JSONResponse(status_code=503, content={"status": "starting"})
        await refreshed(serving.frontend)
        scheduler = serving.frontend.scheduler
        usable = scheduler.kv.num_usable_blocks
        return JSONResponse(
            content={
                "num_requests_waiting": scheduler.num_waiting,
                "num_requests_running": len(scheduler.running),
                "kv_cache_usage_perc": (usable - scheduler.kv.num_free_blocks) / usable,
            }
        )


def _reset_prefix_cache(admission: Admission):
    async def reset_prefix_cache() -> JSONResponse:
        serving = admission.serving
        if serving is None:
            return JSONResponse(status_code=503, content={"status": "starting"})
        scheduler = serving.frontend.scheduler
        reset = scheduler.kv.reset_prefix_cache()
        if inspect.isawaitable(reset):  # a frontend process asks the engine core
            reset = await reset
        if reset:
            return JSONResponse(content={"reset": True})
        message = (
            f"reset_prefix_cache: {len(scheduler.requests)} requests in flight hold KV blocks; "
            "retry when the server is idle"
        )
        error = {"message": message, "type": "conflict", "param": None, "code": "busy"}
        return JSONResponse(status_code=409, content={"error": error})

    return reset_prefix_cache
