"""The routes probes, scrapers and operators expect on the HTTP serving port: /metrics (also on
--metrics-port), /version and /health/ready open; /load behind the bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import http.client
import json
import os
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
        with _server_side(tiny_server, tiny_server.http_port, client_port) as server_side:
            assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        connection.close()


def _server_side(server, port: int, client_port: int) -> socket.socket:
    """The server's end of the connection from `client_port` to `port`, whichever process holds
    it (this one, or a frontend process behind --frontend-processes): found by its inode in
    /proc and copied into this process (pidfd_getfd, Linux 5.6; the frontends are this
    process's children, which ptrace's rules let it reach)."""
    inode = _established_inode(port, client_port)
    pids = [os.getpid(), *(server.hub.pids() if server.hub is not None else [])]
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(FileNotFoundError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return socket.socket(fileno=_pidfd_getfd(pid, int(fd)))
    raise AssertionError(f"no process of the server holds socket {inode}")


def _established_inode(port: int, client_port: int) -> str:
    """/proc/net/tcp's row (hex local and remote address:port, state 01 ESTABLISHED, inode in
    column 9) of the server's side of the connection."""
    with open("/proc/net/tcp") as table:
        for row in table.readlines()[1:]:
            fields = row.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ends = int(local.split(":")[1], 16), int(remote.split(":")[1], 16)
            if ends == (port, client_port) and state == "01":
                return inode
    raise AssertionError(f"no connection from {client_port} to {port}")


def _pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        copied = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd on x86-64 and arm64
    finally:
        os.close(pidfd)
    if copied < 0:
        raise OSError(ctypes.get_errno(), f"pidfd_getfd({pid}, {fd})")
    return copied
