"""SIGTERM drain of a real `planserve scheduler` process: health NOT_SERVING and new requests
UNAVAILABLE during the drain, running requests finish, exit status 0; past the grace period the
process exits anyway. The engine is the null model with a step delay, so that a request is
certainly still running when the signal arrives."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from api import greedy_ids_request
from conftest import EngineProcess
from planserve.v1 import generate_pb2, generate_pb2_grpc

PORT_LINE = "PLANSERVE_PORT="
MAX_NEW_TOKENS = 200  # 200 steps of >= 10 ms: two seconds at least


@pytest.fixture(scope="module")
def slow_engine():
    engine = EngineProcess("--model", "null", "--null-step-delay-ms", "10")
    yield engine.address
    engine.stop()


class SchedulerProcess:
    def __init__(self, engine_address: str, drain_grace_s: float):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "scheduler_service.cli", "scheduler", "--engine", engine_address,
             "--port", "0", "--metrics-port", "-1", "--http-port", "-1",
             "--drain-grace-seconds", str(drain_grace_s)],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
        for line in self.process.stdout:
            if line.startswith(PORT_LINE):
                self.address = f"127.0.0.1:{int(line[len(PORT_LINE):])}"
                break
        else:
            raise RuntimeError(f"scheduler exited with {self.process.wait()}")
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = generate_pb2_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def health_status(self) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return reply.status

    async def wait_exit(self) -> int:
        return await asyncio.get_running_loop().run_in_executor(None, self.process.wait, 60)


async def _until(predicate, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(slow_engine):
    scheduler = SchedulerProcess(slow_engine, drain_grace_s=120)
    try:
        assert await scheduler.health_status() == health_pb2.HealthCheckResponse.SERVING
        running = scheduler.stub.Generate(greedy_ids_request([1, 2, 3], MAX_NEW_TOKENS))
        first = await running.read()
        num_tokens = len(first.token_ids)
        scheduler.process.send_signal(signal.SIGTERM)

        async def not_serving() -> bool:
            return await scheduler.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        await _until(not_serving)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in scheduler.stub.Generate(greedy_ids_request([1, 2, 3], 4)):
                pass
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert scheduler.process.poll() is None  # still draining: the request runs on

        last = first
        while (chunk := await running.read()) is not grpc.aio.EOF:
            num_tokens += len(chunk.token_ids)
            last = chunk
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert num_tokens == MAX_NEW_TOKENS
        assert await scheduler.wait_exit() == 0
    finally:
        await scheduler.channel.close()
        if scheduler.process.poll() is None:
            scheduler.process.kill()


async def test_drain_grace_expiry_ends_running_requests_and_exits_0(slow_engine):
    scheduler = SchedulerProcess(slow_engine, drain_grace_s=0)
    try:
        running = scheduler.stub.Generate(greedy_ids_request([1, 2, 3], MAX_NEW_TOKENS))
        await running.read()
        scheduler.process.send_signal(signal.SIGTERM)
        num_tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (chunk := await running.read()) is not grpc.aio.EOF:
                num_tokens += len(chunk.token_ids)
        assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert num_tokens < MAX_NEW_TOKENS
        assert await scheduler.wait_exit() == 0
    finally:
        await scheduler.channel.close()
        if scheduler.process.poll() is None:
            scheduler.process.kill()


async def test_a_second_sigterm_during_the_drain_stops_at_once(slow_engine):
    scheduler = SchedulerProcess(slow_engine, drain_grace_s=600)
    try:
        running = scheduler.stub.Generate(greedy_ids_request([1, 2, 3], 2000))  # 20 s at least
        await running.read()
        scheduler.process.send_signal(signal.SIGTERM)

        async def not_serving() -> bool:
            return await scheduler.health_status() == health_pb2.HealthCheckResponse.NOT_SERVING
        await _until(not_serving)
        scheduler.process.send_signal(signal.SIGTERM)
        num_tokens = 0
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while (chunk := await running.read()) is not grpc.aio.EOF:
                num_tokens += len(chunk.token_ids)
        assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert num_tokens < 2000
        assert await scheduler.wait_exit() == 0
    finally:
        await scheduler.channel.close()
        if scheduler.process.poll() is None:
            scheduler.process.kill()
