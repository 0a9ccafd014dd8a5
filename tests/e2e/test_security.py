"""Security on real servers: TLS and mutual TLS on both services (certificates made here with
`cryptography`), bearer-token authentication on gRPC and HTTP, the limits on message size and
concurrent streams, the engine's loopback default, and no prompt or output in the logs."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from api import complete, greedy_ids_request
from conftest import EngineProcess, start_scheduler
from planserve.v1 import generate_pb2, generate_pb2_grpc

TOKEN = "s3cret-token-for-tests"
PROMPT = [17, 4000, 1203, 88, 9, 3141, 59, 26]


# ---- a throwaway PKI ----------------------------------------------------------------------

def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class Pki:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, all as files."""

    def __init__(self, directory, name: str):
        self.directory = directory
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _certificate(f"{name} CA", ca_key, _name(f"{name} CA"), ca_key, ca=True)
        self.ca = self._write(f"{name}-ca.pem", ca_cert)
        for role, server in (("server", True), ("client", False)):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _certificate(f"{name} {role}", key, ca_cert.subject, ca_key, ca=False,
                                server=server)
            setattr(self, f"{role}_cert", self._write(f"{name}-{role}.pem", cert))
            setattr(self, f"{role}_key", self._write_key(f"{name}-{role}-key.pem", key))

    def _write(self, filename: str, cert: x509.Certificate) -> str:
        path = os.path.join(self.directory, filename)
        with open(path, "wb") as f:
            f.write(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def _write_key(self, filename: str, key) -> str:
        path = os.path.join(self.directory, filename)
        with open(path, "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
        return path

    def read(self, attribute: str) -> bytes:
        with open(getattr(self, attribute), "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(str(tmp_path_factory.mktemp("pki")), "planserve")


@pytest.fixture(scope="module")
def rogue_pki(tmp_path_factory):
    return Pki(str(tmp_path_factory.mktemp("rogue")), "rogue")


@pytest.fixture(scope="module")
def mtls_engine(pki):
    """A tiny model service that speaks only mutual TLS."""
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                           "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                           "--tls-client-ca", pki.ca)
    yield engine.address
    engine.stop()


@pytest_asyncio.fixture(scope="module")
async def secure_server(pki, mtls_engine, tmp_path_factory):
    """Public API over mutual TLS with a bearer token, engine over mutual TLS."""
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    server = await start_scheduler(
        mtls_engine, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca,
        engine_tls_ca=pki.ca, engine_tls_cert=pki.client_cert, engine_tls_key=pki.client_key,
        auth_token_file=str(token_file), http_port=0, max_message_bytes=64 * 1024)
    yield server
    await server.stop(grace_s=1)


def _credentials(pki: Pki, client: Pki | None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=pki.read("ca"))
    return grpc.ssl_channel_credentials(root_certificates=pki.read("ca"),
                                        private_key=client.read("client_key"),
                                        certificate_chain=client.read("client_cert"))


def _secure_stub(server, pki: Pki, client: Pki | None):
    channel = grpc.aio.secure_channel(f"127.0.0.1:{server.port}", _credentials(pki, client))
    return channel, generate_pb2_grpc.GenerationServiceStub(channel)


AUTH = (("authorization", f"Bearer {TOKEN}"),)


# ---- TLS and mutual TLS -----------------------------------------------------------------

async def test_mtls_client_with_token_is_served_over_an_mtls_engine(secure_server, pki):
    channel, stub = _secure_stub(secure_server, pki, pki)
    chunks = [c async for c in stub.Generate(greedy_ids_request(PROMPT, 8), metadata=AUTH)]
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    await channel.close()


@pytest.mark.parametrize("who", ["plaintext", "no client certificate", "rogue certificate"])
async def test_connections_without_a_trusted_client_certificate_are_refused(
        secure_server, pki, rogue_pki, who):
    if who == "plaintext":
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{secure_server.port}")
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
    else:
        channel, stub = _secure_stub(secure_server, pki, None if who == "no client certificate"
                                     else rogue_pki)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=AUTH, timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    await channel.close()


async def test_scheduler_without_the_engine_client_certificate_cannot_use_the_engine(
        pki, mtls_engine):
    from scheduler_service.config import SchedulerConfig
    from scheduler_service.server import SchedulerServer
    server = SchedulerServer(SchedulerConfig(port=0, engine_address=mtls_engine,
                                             engine_tls_ca=pki.ca, engine_connect_timeout_s=3))
    await server.start()
    try:
        with pytest.raises((asyncio.TimeoutError, grpc.aio.AioRpcError)):
            await server.connect_engine()
    finally:
        await server.stop(grace_s=0)


async def test_replica_router_reaches_mtls_engines(pki):
    """`--engine a,b` (one engine loop per replica) uses the same engine TLS settings."""
    engines = [EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                             "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                             "--tls-client-ca", pki.ca) for _ in range(2)]
    server = await start_scheduler(
        ",".join(e.address for e in engines), engine_tls_ca=pki.ca,
        engine_tls_cert=pki.client_cert, engine_tls_key=pki.client_key)
    try:
        assert len(server.loop.replicas) == 2
        stub = generate_pb2_grpc.GenerationServiceStub(
            grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
        done = await asyncio.gather(*(complete(stub, greedy_ids_request(PROMPT, 6))
                                      for _ in range(4)))
        assert all(len(c.token_ids) == 6 for c in done)
    finally:
        await server.stop(grace_s=1)
        for engine in engines:
            engine.stop()


# ---- bearer token -------------------------------------------------------------------------

@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", TOKEN),)])
async def test_calls_without_the_bearer_token_get_unauthenticated(secure_server, pki, metadata):
    channel, stub = _secure_stub(secure_server, pki, pki)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await complete(stub, greedy_ids_request(PROMPT, 4)) if not metadata else \
            [c async for c in stub.Generate(greedy_ids_request(PROMPT, 4), metadata=metadata)]
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in error.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.GetServerStatus(generate_pb2.GetServerStatusRequest(), metadata=metadata)
    assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Health checks stay open for load balancers.
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await channel.close()


def _client_tls(pki: Pki, client: Pki | None) -> ssl.SSLContext:
    """A client's TLS: trusts pki's CA, presents client's certificate (None: none)."""
    context = ssl.create_default_context(cafile=pki.ca)
    if client is not None:
        context.load_cert_chain(client.client_cert, client.client_key)
    return context


def _http_get(port: int, path: str, token: str | None, context: ssl.SSLContext | None = None,
              scheme: str = "https") -> int:
    request = urllib.request.Request(f"{scheme}://127.0.0.1:{port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


async def test_http_api_requires_the_same_token_except_health(secure_server, pki):
    port, tls = secure_server.http_port, _client_tls(pki, pki)
    run = asyncio.get_running_loop().run_in_executor
    assert await run(None, _http_get, port, "/v1/models", None, tls) == 401
    assert await run(None, _http_get, port, "/v1/models", "wrong", tls) == 401
    assert await run(None, _http_get, port, "/v1/models", TOKEN, tls) == 200
    assert await run(None, _http_get, port, "/health", None, tls) == 200


async def test_http_api_speaks_tls_with_the_grpc_certificates(secure_server, pki, rogue_pki):
    """The OpenAI port takes --tls-cert/--tls-key/--tls-client-ca as the gRPC port does: the
    openai client over HTTPS with a trusted client certificate is served; plain HTTP, HTTPS
    without a client certificate and one from another CA are refused."""
    import httpx
    import openai

    port = secure_server.http_port
    http_client = httpx.Client(verify=_client_tls(pki, pki))
    client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=TOKEN, http_client=http_client)
    run = asyncio.get_running_loop().run_in_executor
    completion = await run(None, lambda: client.completions.create(
        model=client.models.list().data[0].id, prompt="Hello", max_tokens=3, temperature=0.0))
    assert completion.usage.completion_tokens == 3
    http_client.close()
    for scheme, context in (("http", None), ("https", _client_tls(pki, None)), ("https", _client_tls(pki, rogue_pki))):
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            await run(None, _http_get, port, "/health", TOKEN, context, scheme)


# ---- limits -------------------------------------------------------------------------------

async def test_message_over_the_size_limit_gets_resource_exhausted(secure_server, pki):
    channel, stub = _secure_stub(secure_server, pki, pki)
    request = generate_pb2.GenerateRequest(text="x" * (65 * 1024))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [c async for c in stub.Generate(request, metadata=AUTH)]
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server serves the next request as before.
    chunks = [c async for c in stub.Generate(greedy_ids_request(PROMPT, 2), metadata=AUTH)]
    assert sum(len(c.token_ids) for c in chunks) == 2
    await channel.close()


async def test_concurrent_stream_limit_holds_the_second_stream_until_the_first_ends():
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    server = await start_scheduler(engine.address, max_concurrent_streams=1)
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        events: list[str] = []

        async def run(name: str, max_new_tokens: int) -> None:
            async for chunk in stub.Generate(greedy_ids_request(PROMPT, max_new_tokens)):
                events.append(f"{name} end" if chunk.finish_reason else f"{name} chunk")

        first = asyncio.ensure_future(run("first", 200))
        while not events:
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(run("second", 4))
        await asyncio.gather(first, second)
        # One stream at a time on the connection: nothing of the second before the first ended.
        assert events.index("first end") < events.index("second chunk")
        await channel.close()
    finally:
        await server.stop(grace_s=1)
        engine.stop()


# ---- defaults and logs --------------------------------------------------------------------

def test_model_service_binds_loopback_by_default():
    from model_service.__main__ import parse_args
    from model_service.config import ModelServiceConfig
    from tools.cli import build_parser
    assert ModelServiceConfig().host == "127.0.0.1"
    assert parse_args(["--model", "tiny"]).host == "127.0.0.1"
    assert build_parser().parse_args(["model-service"]).host == "127.0.0.1"


async def test_model_service_on_a_unix_socket(tmp_path):
    socket_path = f"unix:{tmp_path}/engine.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "model_service", "--model", "tiny", "--dtype", "float32",
         "--num-kv-blocks", "64", "--host", socket_path],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
    try:
        for line in process.stdout:
            if line.startswith("PLANSERVE_ENGINE_PORT="):
                break
        else:
            raise AssertionError(f"model service exited with {process.wait()}")
        assert os.path.exists(f"{tmp_path}/engine.sock")
        server = await start_scheduler(socket_path)
        try:
            stub = generate_pb2_grpc.GenerationServiceStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))
            done = await complete(stub, greedy_ids_request(PROMPT, 5))
            assert len(done.token_ids) == 5
        finally:
            await server.stop(grace_s=1)
    finally:
        process.terminate()
        process.wait(timeout=30)


async def test_no_prompt_or_output_in_the_logs_at_info_level():
    """A real scheduler process at --log-level info serves a text prompt; its logs name the
    request but hold neither the prompt's text nor its token ids nor the output text."""
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    process = subprocess.Popen(
        [sys.executable, "-m", "scheduler_service.cli", "--log-level", "info", "scheduler",
         "--engine", engine.address, "--port", "0", "--metrics-port", "-1", "--http-port", "-1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
    try:
        for line in process.stdout:
            if line.startswith("PLANSERVE_PORT="):
                port = int(line.split("=", 1)[1])
                break
        else:
            raise AssertionError(f"scheduler exited with {process.wait()}")
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        canary = "zebra canary quokka"
        text = await complete(stub, generate_pb2.GenerateRequest(
            request_id="canary-request", text=canary, sampling={"temperature": 0.0},
            stopping={"max_new_tokens": 12, "ignore_eos": True}))
        ids = await complete(stub, greedy_ids_request([4242, 4243, 4244, 4245], 12,
                                                      request_id="ids-request"))
        with pytest.raises(grpc.aio.AioRpcError):  # a bad request, with its content
            await complete(stub, generate_pb2.GenerateRequest(text=canary, sampling={"top_p": 2}))
        await channel.close()
        process.terminate()
        _, logs = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        engine.stop()
    assert "canary-request" in logs and "ids-request" in logs  # the logs do see the requests
    assert canary not in logs and "zebra" not in logs
    assert "4242, 4243" not in logs and "4242,4243" not in logs
    for output in (text.text, ids.text):
        assert len(output.strip()) > 8 and output.strip() not in logs


# ---- the conformance kit against secured servers ------------------------------------------

async def test_the_api_suite_passes_over_mtls_with_a_token(secure_server, pki):
    """`planserve conformance --api` with --tls-ca/--tls-cert/--tls-key/--auth-token-file: the
    whole suite passes against the mTLS + token server; without the token it fails, naming the
    refusal (so the flags are what made it pass)."""
    from tools.conformance import run_suite
    from tools.conformance.connection import Connection
    from tools.conformance.report import passed

    address = f"127.0.0.1:{secure_server.port}"
    mtls = Connection(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    secured = dataclasses.replace(mtls, auth_token_file=secure_server.config.auth_token_file)
    report, outcomes = await run_suite("api", address, connection=secured)
    assert passed(outcomes), report
    report, outcomes = await run_suite("api", address, only={"generate"}, connection=mtls)
    assert not passed(outcomes) and "UNAUTHENTICATED" in report, report


def test_the_engine_suite_passes_against_an_mtls_engine_via_the_cli(pki):
    engine = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64",
                           "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                           "--tls-client-ca", pki.ca)
    try:
        command = [sys.executable, "-m", "tools", "conformance", "--engine", engine.address,
                   "--check", "describe", "--check", "prefill", "--check", "decode", "--check", "abort"]
        tls = ["--tls-ca", pki.ca, "--tls-cert", pki.client_cert, "--tls-key", pki.client_key]
        result = subprocess.run(command + tls, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "4 passed, 0 failed" in result.stdout, result.stdout
        plain = subprocess.run(command + ["--connect-timeout", "2"], capture_output=True, text=True,
                               timeout=300)
        assert plain.returncode == 1 and "FAIL  connect" in plain.stdout, plain.stdout
    finally:
        engine.stop()
