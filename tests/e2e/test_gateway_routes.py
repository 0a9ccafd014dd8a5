"""The routes probes, scrapers and operators expect on the HTTP serving port: /metrics (also on
--metrics-port), /version and /health/ready open; /load behind the bearer token."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import urllib.error
import urllib.request

import pytest
import pytest_asyncio
from api import complete, greedy_ids_request, stub_for, wait_until_idle
from conftest import EngineProcess, start_scheduler
from prometheus_client.parser import text_string_to_metric_families

from scheduler_service.config import SchedulerConfig
from scheduler_service.server import SchedulerServer

TOKEN = "gateway-test-token"


def _get(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def get(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    return await asyncio.to_thread(_get, port, path, token)


@pytest.fixture(scope="module")
def engine():
    """A model service of its own: the session's tiny_server holds the shared one's stream."""
    process = EngineProcess("--model", "tiny", "--dtype", "float32", "--num-kv-blocks", "64")
    yield process.address
    process.stop()


@pytest_asyncio.fixture
async def token_server(engine, tmp_path):
    """A scheduler with a bearer token and both ports, listening before it meets the engine."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    config = SchedulerConfig(
        port=0,
        engine_address=engine,
        http_port=0,
        metrics_port=0,
        auth_token_file=str(token_file),
    )
    server = SchedulerServer(config)
    await server.start()
    yield server
    await server.stop(grace_s=1)


async def test_ready_only_after_a_real_step_and_not_while_draining(token_server):
    port = token_server.http_port
    assert await get(port, "/health/ready") == (503, b'{"status":"not ready"}')
    await token_server.connect_engine()  # Describe, then a one-token step on the model
    assert await get(port, "/health/ready") == (200, b'{"status":"ready"}')
    await token_server.drain(grace_s=0)
    assert (await get(port, "/health/ready"))[0] == 503


async def test_open_and_guarded_routes_under_a_token(token_server):
    await token_server.connect_engine()
    port = token_server.http_port
    status, body = await get(port, "/version")
    assert status == 200 and json.loads(body)["version"]
    assert (await get(port, "/load"))[0] == 401
    assert (await get(port, "/v1/models"))[0] == 401
    status, body = await get(port, "/load", TOKEN)
    assert status == 200
    assert json.loads(body) == {
        "num_requests_waiting": 0,
        "num_requests_running": 0,
        "kv_cache_usage_perc": 0.0,
    }
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    request = greedy_ids_request([4, 5, 6], 3)
    await complete_with(stub_for(token_server), request, metadata)
    # /metrics needs no token, on the serving port and on --metrics-port alike.
    status, served = await get(port, "/metrics")
    assert status == 200
    status, dedicated = await get(token_server.metrics_port, "/metrics")
    assert status == 200

    def names(text: bytes) -> set[str]:
        return {family.name for family in text_string_to_metric_families(text.decode())}

    assert names(served) == names(dedicated)
    assert {"vllm:num_requests_waiting", "vllm:cache_config_info"} <= names(served)
    assert b'vllm:request_success_total{finished_reason="length"} 1.0' in served


async def complete_with(stub, request, metadata) -> None:
    async for _ in stub.Generate(request, metadata=metadata):
        pass


async def test_load_reports_the_queue_while_busy(tiny_server):
    stub = stub_for(tiny_server)
    call = stub.Generate(greedy_ids_request(list(range(1, 20)), 300))
    await call.read()
    status, body = await get(tiny_server.http_port, "/load")
    assert status == 200
    load = json.loads(body)
    assert load["num_requests_running"] >= 1 and load["kv_cache_usage_perc"] > 0
    call.cancel()
    await complete(stub, greedy_ids_request([1, 2], 1))


def _post(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


async def post(port: int, path: str, token: str | None = None) -> tuple[int, bytes]:
    return await asyncio.to_thread(_post, port, path, token)


async def test_reset_prefix_cache_is_off_unless_enabled(token_server):
    await token_server.connect_engine()
    assert (await post(token_server.http_port, "/reset_prefix_cache", TOKEN))[0] == 404


async def test_reset_prefix_cache_forgets_the_cache_when_idle(engine, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server = await start_scheduler(
        engine, http_port=0, enable_reset_prefix_cache=True, auth_token_file=str(token_file)
    )
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    stub = stub_for(server)

    async def cached_tokens(prompt: list[int], max_new_tokens: int = 2) -> int:
        last = None
        async for chunk in stub.Generate(
            greedy_ids_request(prompt, max_new_tokens), metadata=metadata
        ):
            last = chunk
        return last.usage.cached_tokens

    try:
        prompt = list(range(100, 150))  # 3 full blocks
        assert await cached_tokens(prompt) == 0
        assert await cached_tokens(prompt) == 48
        port = server.http_port
        assert (await post(port, "/reset_prefix_cache"))[0] == 401  # behind the token
        # A request holding blocks: refused, the cache kept.
        call = stub.Generate(greedy_ids_request(list(range(1, 20)), 300), metadata=metadata)
        await call.read()
        status, body = await post(port, "/reset_prefix_cache", TOKEN)
        assert status == 409 and b"retry when the server is idle" in body
        call.cancel()
        await wait_until_idle(server)
        assert server.loop.scheduler.kv.pool.num_cached > 0
        assert await post(port, "/reset_prefix_cache", TOKEN) == (200, b'{"reset":true}')
        assert server.loop.scheduler.kv.pool.num_cached == 0
        assert await cached_tokens(prompt) == 0  # computed again
        assert await cached_tokens(prompt) == 48
    finally:
        await server.stop(grace_s=1)


async def test_keep_alive_connections_send_without_delay(tiny_server):
    """A gateway scrapes /metrics every 50 ms on one keep-alive connection: the server's side of
    it has TCP_NODELAY, so a response's body never waits for the client's delayed ACK (40 ms)."""
    connection = http.client.HTTPConnection("127.0.0.1", tiny_server.http_port, timeout=30)
    try:
        await asyncio.to_thread(connection.request, "GET", "/metrics")
        response = await asyncio.to_thread(connection.getresponse)
        assert response.status == 200 and await asyncio.to_thread(response.read)
        client_port = connection.sock.getsockname()[1]
        # uvicorn's open connections: the one whose peer is this client.
        [server_side] = [
            protocol.transport.get_extra_info("socket")
            for protocol in tiny_server.http._server.server_state.connections
            if protocol.transport.get_extra_info("peername")[1] == client_port
        ]
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        connection.close()
