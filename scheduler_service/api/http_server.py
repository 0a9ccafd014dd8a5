"""The HTTP serving port: uvicorn in the scheduler's event loop, serving the OpenAI-compatible API
(openai_http.py, with vLLM's render endpoints: openai_render.py) and the probe, scrape and
operator routes (ops_http.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Awaitable, Callable, Optional

import structlog
import uvicorn
from prometheus_client import CollectorRegistry

from scheduler_service.api.admission import Admission
from scheduler_service.api.anthropic_http import MessagesDoor
from scheduler_service.api.openai_http import OpenAIApp
from scheduler_service.api.openai_render import add_render_routes
from scheduler_service.api.ops_http import add_ops_routes
from scheduler_service.api.responses_http import ResponsesDoor
from scheduler_service.api.sse_direct import KeepServerSend
from scheduler_service.config import SchedulerConfig
from scheduler_service.ports import StartupError

log = structlog.get_logger("planserve.openai")


class _Uvicorn(uvicorn.Server):
    """Leaves the process's signal handlers alone: the CLI owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class EchoRequestId:
    """ASGI middleware: a response carries the X-Request-Id its request sent (the request's id
    too: api/gateway.py), as vLLM's server does, so a gateway can match the two."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        echo = [(k, v) for k, v in scope["headers"] if k == b"x-request-id"][:1]
        if not echo:
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), *echo])
            await send(message)

        return await self.app(scope, receive, send_with_id)


class HttpServer:
    """The OpenAI-compatible API on its own port, in the running event loop."""

    def __init__(
        self,
        admission: Admission,
        host: str,
        port: int,
        ssl_options: Optional[dict] = None,
        config: Optional[SchedulerConfig] = None,
        registry: Optional[CollectorRegistry] = None,
        is_ready: Callable[[], bool] = lambda: False,
        reuse_port: bool = False,
        metrics_text: Optional[Callable[[], Awaitable[bytes]]] = None,
    ):
        """ssl_options: uvicorn's ssl_* settings (security.http_ssl_options), empty for HTTP;
        config: the doors' settings (tool parser, gateway headers) when not the admission's;
        registry: what /metrics serves (none: no /metrics); is_ready: /health/ready's answer;
        reuse_port: share the port with the other frontend processes (SO_REUSEPORT);
        metrics_text: /metrics rendered elsewhere (a frontend process asks the engine core)."""
        door = OpenAIApp(admission, config)
        MessagesDoor(door)  # POST /v1/messages over the same path
        ResponsesDoor(door)  # POST /v1/responses too
        add_render_routes(door)
        self.app = door.app
        add_ops_routes(self.app, admission, registry, is_ready, metrics_text)
        self.app.add_middleware(EchoRequestId)
        self._sse_direct_writes = not (config or admission.config).no_sse_direct_writes
        self._host, self._requested_port = host, port
        self._reuse_port = reuse_port
        self._ssl_options = ssl_options or {}
        self.port: Optional[int] = None
        self._server: Optional[_Uvicorn] = None
        self._task: Optional[asyncio.Task] = None

    async def start(self) -> int:
        """Binds (port 0 picks a free one), serves and returns the bound port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP named, so that asyncio sets TCP_NODELAY on every accepted connection (it
        # does only for sockets whose proto says TCP): a response's head and body go out as two
        # writes, and without it the body waits for the client's delayed ACK (40 ms on Linux) on
        # every keep-alive request, a gateway's /metrics scrape every 50 ms included.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self._host, self._requested_port))
        except OSError as error:
            sock.close()
            raise StartupError(
                f"--http-port {self._requested_port}: cannot listen on {self._host}:"
                f"{self._requested_port} ({error.strerror or error})"
            ) from None
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            # A streamed response's socket, where the common chunk is written (api/sse_direct.py).
            KeepServerSend(self.app) if self._sse_direct_writes else self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            server_header=False,
            **self._ssl_options,
        )
        self._server = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start")
            await asyncio.sleep(0.01)
        log.info("openai http api serving", port=self.port, tls=bool(self._ssl_options))
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.1)
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 2)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self._server = self._task = None
