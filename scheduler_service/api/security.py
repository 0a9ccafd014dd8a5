"""TLS, mutual TLS and bearer-token authentication of the scheduler's edges.

The public API takes TLS (`tls_cert` + `tls_key`), optionally requiring client certificates
signed by `tls_client_ca` (mutual TLS), on its gRPC port and on the OpenAI HTTP port alike, and
optionally a bearer token (`auth_token_file`): every call but health checks and reflection (HTTP:
OPEN_HTTP_PATHS, the probes, /metrics and /version) must carry `authorization: Bearer <token>`,
else UNAUTHENTICATED (HTTP: 401). The channel to the
model service takes TLS (`engine_tls_ca`) and a client certificate (`engine_tls_cert` +
`engine_tls_key`) for a model service that requires mTLS.
"""

from __future__ import annotations

import hmac
import inspect
import ssl
from typing import Optional

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from planserve import contract
from scheduler_service.config import SchedulerConfig

# Services a load balancer or an operator's tool must reach without the token.
OPEN_SERVICES = (
    health.SERVICE_NAME,
    reflection.SERVICE_NAME,
    "grpc.reflection.v1.ServerReflection",
)

# HTTP paths a probe or a scraper reaches without the token: none carries request content
# (api/ops_http.py).
OPEN_HTTP_PATHS = frozenset({"/health", "/health/ready", "/metrics", "/version"})


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(config: SchedulerConfig) -> Optional[grpc.ServerCredentials]:
    """The public API's TLS credentials, or None for plaintext."""
    if not config.tls_cert:
        return None
    client_ca = _read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key), _read(config.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def http_ssl_options(config: SchedulerConfig) -> dict:
    """uvicorn's TLS settings for the OpenAI HTTP API: the same certificate, key and client CA
    as the gRPC API (empty: plain HTTP)."""
    if not config.tls_cert:
        return {}
    options: dict[str, object] = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        options.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


def engine_channel_credentials(config: SchedulerConfig) -> Optional[grpc.ChannelCredentials]:
    """Credentials of the channel to the model service, or None for plaintext."""
    if not config.engine_tls_ca:
        return None
    key = _read(config.engine_tls_key) if config.engine_tls_key else None
    cert = _read(config.engine_tls_cert) if config.engine_tls_cert else None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.engine_tls_ca), private_key=key, certificate_chain=cert
    )


def engine_channel_options(config: SchedulerConfig) -> tuple:
    """The options of a channel to a model service: the link's keepalive, and the name its
    certificate is checked against when one is given."""
    options: list[tuple[str, int | str]] = [*contract.keepalive_options(config.engine_keepalive_s)]
    if config.engine_tls_server_name:
        options.append(("grpc.ssl_target_name_override", config.engine_tls_server_name))
    return tuple(options)


def read_token(path: str) -> str:
    """The bearer token in `path` (surrounding whitespace stripped); ValueError when empty."""
    token = _read(path).decode().strip()
    if not token:
        raise ValueError(f"auth_token_file: {path} holds no token")
    return token


def bearer_token_ok(authorization: Optional[str], token: str) -> bool:
    """Whether an `authorization` header value carries the token (constant-time compare)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[len("Bearer ") :].strip().encode(), token.encode())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call without `authorization: Bearer <token>`, except health and
    reflection. The check runs before the handler, so a refused call never reaches it."""

    def __init__(self, token: str):
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        handler = await continuation(handler_call_details)
        if handler is None or service in OPEN_SERVICES:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_token_ok(metadata.get("authorization"), self._token):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request_or_iterator, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "authorization: a valid 'Bearer <token>' is required"
        )

    deserialize, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, deserialize, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deserialize, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, deserialize, serialize)
    return grpc.unary_unary_rpc_method_handler(refuse, deserialize, serialize)


def server_options(config: SchedulerConfig) -> list[tuple[str, int]]:
    """Limits of the public API's gRPC server: concurrent streams and message size; and no
    SO_REUSEPORT (gRPC's default on Linux), so a second server on a taken port fails instead of
    silently sharing its connections."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", config.max_concurrent_streams),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]


def interceptors(config: SchedulerConfig) -> list[grpc.aio.ServerInterceptor]:
    """The token check first (a refused call is not even parsed), then malformed bytes."""
    chain: list[grpc.aio.ServerInterceptor] = []
    if config.auth_token_file:
        chain.append(BearerTokenInterceptor(read_token(config.auth_token_file)))
    chain.append(MalformedMessageInterceptor())
    return chain


def add_http_bearer_auth(app, token: str) -> None:
    """The same token on the OpenAI-compatible HTTP API: 401 in OpenAI's error shape for any path
    but OPEN_HTTP_PATHS without `Authorization: Bearer <token>` (or `x-api-key: <token>`, as
    Anthropic's clients send it). Call before the app starts."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def require_bearer_token(request, call_next):
        if request.url.path in OPEN_HTTP_PATHS or bearer_token_ok(
            request.headers.get("authorization"), token
        ):
            return await call_next(request)
        api_key = request.headers.get("x-api-key")  # how Anthropic's clients send the token
        if api_key and hmac.compare_digest(api_key.strip().encode(), token.encode()):
            return await call_next(request)
        return JSONResponse(
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
            content={
                "error": {
                    "message": "a valid 'Authorization: Bearer <token>' is required",
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            },
        )


class _Malformed:
    """Stands in for a request message whose bytes did not parse."""

    def __init__(self, error: Exception):
        self.error = error


class MalformedMessageInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT naming the message type for request bytes that do not parse (gRPC's own
    answer is UNKNOWN with a Python exception's text). The deserializer hands a marker to the
    handler instead of raising; the wrapped handler turns it into the status."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if handler is None or handler.request_deserializer is None or service in OPEN_SERVICES:
            return handler
        behavior = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous servicer: left as gRPC runs it
        if handler.response_streaming and not inspect.isasyncgenfunction(behavior):
            return handler  # a streaming coroutine (context.write): left alone too
        return _tolerant(handler)


def _tolerant(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    type_name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request message"

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as error:  # noqa: BLE001 - DecodeError and friends
            return _Malformed(error)

    async def refuse(context) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"request: the bytes are not a valid {type_name}"
        )

    async def checked(iterator, context):
        async for item in iterator:
            if isinstance(item, _Malformed):
                await refuse(context)
            yield item

    serialize = handler.response_serializer
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary
        if handler.response_streaming:

            async def stream_stream(iterator, context):
                async for item in behavior(checked(iterator, context), context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)

        async def stream_unary(iterator, context):
            return await behavior(checked(iterator, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, serialize)
    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            if isinstance(request, _Malformed):
                await refuse(context)
            async for item in behavior(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, serialize)
    behavior = handler.unary_unary

    async def unary_unary(request, context):
        if isinstance(request, _Malformed):
            await refuse(context)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
