"""`planserve serve`'s supervision of its model service child (tools/supervisor.py), on the null
model with a step delay, so that a request is certainly still running at the fault: a child
killed is restarted; a child alive but no longer answering (stopped here with SIGSTOP, as a
process wedged holding Python's lock would be) is killed by the liveness probe and restarted.
Either way the request in flight finishes with its undisturbed tokens. Without the probe nothing
ends a stopped child: the scheduler drops its stream, but every reconnect waits on it."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import grpc

from api import child_pids, complete, greedy_ids_request, stream_tokens
from planserve.v1 import generate_pb2, generate_pb2_grpc


def _serve(*flags: str) -> tuple[subprocess.Popen, int, list[str]]:
    """`planserve serve` on the null model, its port, and its log lines as they come."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tools", "serve", "--model", "null", "--null-step-delay-ms", "5",
         "--port", "0", "--engine-port", "0", "--http-port", "-1", "--metrics-port", "-1",
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PLANSERVE_LOG_JSON="1"))
    logs: list[str] = []
    threading.Thread(target=lambda: logs.extend(process.stderr), daemon=True).start()
    for line in process.stdout:
        if line.startswith("PLANSERVE_PORT="):
            return process, int(line.split("=", 1)[1]), logs
    raise AssertionError(f"planserve serve exited with {process.wait()}")


async def _a_request_outlives(fault: signal.Signals, *flags: str) -> list[str]:
    """Sends `fault` to the child mid-request; checks the request finishes as undisturbed on a
    new child and that serve stops cleanly; returns serve's log events."""
    process, port, logs = _serve(*flags)
    try:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        request = greedy_ids_request([1, 2, 3], 300)
        reference = await complete(stub, request)
        [child] = child_pids(process.pid)

        tokens: list[list[int]] = [[]]
        task = asyncio.ensure_future(stream_tokens(stub, request, tokens, 0))
        while len(tokens[0]) < 10:
            await asyncio.sleep(0.005)
        os.kill(child, fault)
        assert not task.done()  # 290 steps of 5 ms to go
        chunks = await asyncio.wait_for(task, timeout=60)
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert tokens[0] == reference.token_ids
        [restarted] = child_pids(process.pid)
        assert restarted != child
        await channel.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        return [json.loads(line).get("event") for line in logs if line.startswith("{")]
    finally:
        if process.poll() is None:
            for pid in child_pids(process.pid):  # a child left stopped would stay so
                os.kill(pid, signal.SIGKILL)
            process.kill()


async def test_a_killed_model_service_is_restarted_and_its_requests_finish():
    events = await _a_request_outlives(signal.SIGKILL)
    assert "model_service_died" in events and "model_service_restarted" in events


async def test_a_stopped_model_service_is_killed_restarted_and_its_requests_finish():
    events = await _a_request_outlives(signal.SIGSTOP, "--model-service-liveness-seconds", "0.5")
    assert "model_service_unresponsive" in events and "model_service_restarted" in events


def test_a_negative_liveness_period_is_refused_naming_the_flag():
    result = subprocess.run(
        [sys.executable, "-m", "tools", "serve", "--model", "null",
         "--model-service-liveness-seconds", "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--model-service-liveness-seconds must be >= 0, got -1.0" in result.stderr
