"""The public doors on their ports, for the scheduler process and each frontend process alike
(scheduler_service/frontends): GenerationService with health and reflection on a grpc.aio
server, bound with TLS when configured, and the OpenAI HTTP API behind the bearer token when one
is configured. A port that cannot be bound is a StartupError naming its flag."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from planserve.v1 import generate_pb2, generate_pb2_grpc
from scheduler_service.api import security
from scheduler_service.api.admission import Admission
from scheduler_service.api.grpc_servicer import GenerationServicer
from scheduler_service.api.http_server import HttpServer
from scheduler_service.config import SchedulerConfig
from scheduler_service.ports import StartupError

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


def add_grpc_services(
    server: grpc.aio.Server, health_servicer: health.HealthServicer, servicer: GenerationServicer
) -> None:
    """GenerationService, health and reflection on `server`."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    generate_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )


def set_health(health_servicer: health.HealthServicer, serving: bool) -> None:
    """The server's overall health and GenerationService's, together."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, status)


def bind_grpc_port(server: grpc.aio.Server, config: SchedulerConfig, port: int) -> int:
    """Binds `port` on config.host (TLS with the configured certificate); the bound port."""
    address = f"{config.host}:{port}"
    credentials = security.server_credentials(config)
    try:
        if credentials:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError:  # taken between the ports check and now
        raise StartupError(f"--port {config.port}: cannot listen on {address}") from None


def http_api(
    admission: Admission, config: SchedulerConfig, port: int, **options: Any
) -> HttpServer:
    """The OpenAI HTTP API on `port` (TLS as configured), behind the bearer token when one is
    configured; `options`: HttpServer's (is_ready, registry, reuse_port, metrics_text)."""
    server = HttpServer(admission, config.host, port, security.http_ssl_options(config), **options)
    if config.auth_token_file:
        security.add_http_bearer_auth(server.app, security.read_token(config.auth_token_file))
    return server
