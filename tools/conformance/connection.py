"""How the kit reaches a secured server: TLS (a CA to trust), mutual TLS (a client certificate)
and a bearer token, given as `planserve conformance` flags and used for every channel a suite
opens (health checks included)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import grpc


@dataclasses.dataclass(frozen=True)
class Connection:
    tls_ca: str = ""
    """PEM CA bundle that signed the server's certificate: TLS instead of plaintext."""
    tls_cert: str = ""
    """PEM client certificate (with tls_key), for a server that requires mutual TLS."""
    tls_key: str = ""
    """PEM private key of tls_cert."""
    auth_token_file: str = ""
    """A file whose first line is the bearer token every call carries."""
    tls_server_name: str = ""
    """The name the server's certificate is checked against, when it is not the address's host."""

    def validate(self) -> "Connection":
        if (self.tls_cert or self.tls_key) and not (self.tls_cert and self.tls_key and self.tls_ca):
            raise ValueError("--tls-cert and --tls-key go together, with --tls-ca")
        return self

    def channel(self, address: str, options: tuple = ()) -> grpc.aio.Channel:
        token = self._token()
        interceptors = bearer_token_interceptors(token) if token else None
        options = tuple(options)
        if self.tls_server_name:
            options += (("grpc.ssl_target_name_override", self.tls_server_name),)
        if not self.tls_ca:
            return grpc.aio.insecure_channel(address, options, interceptors=interceptors)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca),
            private_key=_read(self.tls_key) if self.tls_key else None,
            certificate_chain=_read(self.tls_cert) if self.tls_cert else None,
        )
        return grpc.aio.secure_channel(address, credentials, options, interceptors=interceptors)

    def _token(self) -> Optional[str]:
        if not self.auth_token_file:
            return None
        with open(self.auth_token_file, encoding="utf-8") as f:
            return f.readline().strip() or None


PLAINTEXT = Connection()  # no TLS, no token: what a suite uses unless told otherwise


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class _BearerToken:
    """Adds `authorization: Bearer <token>` to a call (plaintext channels too, where gRPC's own
    call credentials are refused)."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return details._replace(metadata=metadata)


# One class per call kind: grpc.aio files an interceptor under the first kind it implements only.
class _UnaryUnary(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStream(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class _StreamUnary(_BearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


class _StreamStream(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_token(client_call_details), request_iterator)


def bearer_token_interceptors(token: str) -> list:
    """Interceptors that put the token on every call of a grpc.aio channel."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
